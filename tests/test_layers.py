"""The package's layering is the one docs/architecture.md states, and no module imports one above it.

The layer table of docs/architecture.md (``| layer | modules |``) is parsed here, so the picture and the code
cannot drift: every ``ds_usp`` module must appear in it, and every import of a ``ds_usp`` module (module level
or inside a function) must go to the same layer or one below. The native op's builders (the top-level ``ops/``,
installed as ``ds_usp.native.op_builder``) import nothing from ``ds_usp``: setup.py loads them before it exists.
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
DOC = ROOT / "docs" / "architecture.md"


def _layers() -> dict[str, int]:
    """``module prefix -> layer number`` from the doc's table (rows ``| n | `a`, `b` |``)."""
    layers = {}
    for number, modules in re.findall(r"^\| (\d+) \| (.+?) \|", DOC.read_text(), flags=re.M):
        for name in re.findall(r"`([\w.]+)`", modules):
            layers[name] = int(number)
    assert layers, "docs/architecture.md has no layer table"
    return layers


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_of(module: str, layers: dict[str, int]) -> int:
    """The layer of the longest table entry that is ``module`` or a package containing it."""
    if module == "ds_usp.native.op_builder" or module.startswith("ds_usp.native.op_builder."):
        module = "ds_usp.native"  # the native op's builders belong to the native-op layer
    best = max((name for name in layers if module == name or module.startswith(name + ".")), key=len, default=None)
    assert best is not None, f"{module} is not in docs/architecture.md's layer table"
    return layers[best]


def _imports(path: Path) -> set[str]:
    """The ``ds_usp`` modules a file imports, at module level or inside a function (``from pkg import mod`` counts
    as ``pkg.mod`` when ``mod`` is a module of the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for alias in node.names:
                sub = ROOT.joinpath(*node.module.split("."), alias.name)
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in ("ds_usp", "_ds_usp_auto") or m.startswith("ds_usp.")}


BOOTSTRAP = ROOT / "_ds_usp_auto.py"  # the top-level bootstrap, outside the package but in its picture


def _with_packages(targets: set[str], me: str, modules: dict[str, Path]) -> set[str]:
    """``targets`` and the packages Python runs first to import them (``import a.b.c`` runs ``a/__init__`` and
    ``a/b/__init__``), but for the packages ``me`` itself lives in (Python ran those before ``me``)."""
    found = set()
    for target in targets:
        parts = target.split(".")
        for n in range(1, len(parts) + 1):
            name = ".".join(parts[:n])
            if name in modules and not me.startswith(name + ".") and name != me:
                found.add(name)
    return found


def _import_graph() -> dict[str, set[str]]:
    """``module -> the ds_usp modules it imports`` over the whole package and the bootstrap, each import counted with
    the package ``__init__`` files it runs (a package's own ``__init__`` excluded from its children's imports of it:
    Python runs it before them anyway)."""
    modules = {_module_name(p): p for p in (ROOT / "ds_usp").rglob("*.py")}
    modules["_ds_usp_auto"] = BOOTSTRAP
    return {me: _with_packages(_imports(path), me, modules) for me, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected set of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No two modules import each other, directly or around a circle, also inside one layer and also through an
    import hidden in a function (the layer rule alone cannot see a circle between two modules of one layer)."""
    circles = _cycles(_import_graph())
    assert not circles, "modules that import each other (around a circle): " + "; ".join(" <-> ".join(c)
                                                                                       for c in circles)


def test_the_circle_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_through_a_package_init():
    """``ds_usp.comm`` importing ``ds_usp.upstream.c10d`` runs ``ds_usp/upstream/__init__``: had that ``__init__``
    imported every patch module (as it once did), ``comm`` -> ``upstream`` -> ``accelerate`` -> ``comm`` was a
    circle no import statement showed. The bootstrap is a room of the picture too."""
    modules = {name: Path() for name in ("p", "p.sub", "p.sub.a", "p.sub.b", "p.c")}
    assert _with_packages({"p.sub.a"}, "p.c", modules) == {"p.sub", "p.sub.a"}  # p: p.c lives in it
    assert _with_packages({"p.sub.a"}, "p.sub.b", modules) == {"p.sub.a"}
    graph = _import_graph()
    assert "ds_usp.upstream" in graph["ds_usp.comm"] and "_ds_usp_auto" in graph["ds_usp"]
    assert graph["_ds_usp_auto"] == set(), "the bootstrap imports nothing of the package"
    assert graph["ds_usp.upstream"] == set(), "upstream/__init__ imports none of its modules (catalog does)"


def test_no_module_imports_upward():
    layers = _layers()
    upward = []
    for path in [*sorted((ROOT / "ds_usp").rglob("*.py")), BOOTSTRAP]:
        me = _module_name(path)
        mine = _layer_of(me, layers)
        for target in _imports(path):
            if target != me and _layer_of(target, layers) > mine:
                upward.append(f"{me} (layer {mine}) imports {target} (layer {_layer_of(target, layers)})")
    assert not upward, "imports against the layering of docs/architecture.md:\n" + "\n".join(upward)


def test_the_native_op_builders_import_nothing_of_ds_usp():
    for path in sorted((ROOT / "ops").rglob("*.py")):
        assert not _imports(path), f"{path} imports {_imports(path)}: setup.py loads it before ds_usp is installed"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: a config module importing the integration layer would be caught."""
    layers = _layers()
    fake = tmp_path / "config.py"
    fake.write_text("from ds_usp.integration.engine.initialize import initialize\n")
    assert _layer_of("ds_usp.integration.engine.initialize", layers) > _layer_of("ds_usp.config", layers)
    assert _imports(fake) == {"ds_usp.integration.engine.initialize"}


def test_test_modules_do_not_decide_cuda_at_import():
    """conftest.py hides the GPU from this process's children by clearing CUDA_VISIBLE_DEVICES, after which torch
    answered no CUDA on the H100 host: a skip condition on CUDA evaluated at a module's import skipped every GPU
    test there. The ``gpu`` marker alone decides (conftest skips those tests without CUDA and runs them with the
    variable restored)."""
    import conftest

    offenders = [p.name for p in TESTS.glob("test_*.py") if re.search(r"skipif\(\s*not torch\.cuda\.is_available",
                                                                          p.read_text())]
    assert not offenders, f"decide CUDA through the gpu marker, not at import: {offenders}"
    saved = (conftest.CUDA_VISIBLE, os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        conftest.CUDA_VISIBLE = "3"
        conftest.gpu_visible(True)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
        conftest.gpu_visible(False)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        conftest.CUDA_VISIBLE = None
        conftest.gpu_visible(True)
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    finally:
        conftest.CUDA_VISIBLE = saved[0]
        if saved[1] is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved[1]


# ---------------------------------------------------------------------------------- names in docs and docstrings

_NAME = re.compile(r"\bds_usp(?:\.\w+)+")


def _top_level_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    exported = next((node.value for node in tree.body if isinstance(node, ast.Assign) and any(
        isinstance(x, ast.Name) and x.id == "__all__" for x in node.targets)), None)
    if exported is not None:  # names a module's __getattr__ makes on first use (ds_usp.USPTrainer) are listed there
        names.update(n.value for n in ast.walk(exported) if isinstance(n, ast.Constant) and isinstance(n.value, str))
        names.update(n.id for n in ast.walk(exported) if isinstance(n, ast.Name))  # *_RL_TRAINERS
        for star in (n.value.id for n in ast.walk(exported) if isinstance(n, ast.Starred)
                     and isinstance(n.value, ast.Name)):
            value = next(node.value for node in tree.body if isinstance(node, ast.Assign) and any(
                isinstance(x, ast.Name) and x.id == star for x in node.targets))
            names.update(n.value for n in ast.walk(value) if isinstance(n, ast.Constant))
    return names


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (the native op's builders as ``ds_usp.native.op_builder``)."""
    found = {_module_name(p): p for p in (ROOT / "ds_usp").rglob("*.py")}
    found["ds_usp.native.op_builder"] = ROOT / "ops" / "__init__.py"
    builders = ast.parse(found["ds_usp.native.op_builder"].read_text())  # the extensions they build (prebuilt)
    for node in ast.walk(builders):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value):
            found.setdefault(node.value, found["ds_usp.native.op_builder"])
    return found


def unknown_names(text: str, modules: dict[str, Path]) -> list[str]:
    """The ``ds_usp.*`` names in ``text`` that are neither a module nor a name a module defines at its top level
    (``ds_usp.cost.choose_features``); an attribute of that name (``ds_usp.cost.Features.describe``) is not checked
    further."""
    bad = []
    for name in sorted(set(_NAME.findall(text))):
        parts = name.split(".")
        prefix = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules), default=0)
        if prefix == len(parts):
            continue
        module = ".".join(parts[:prefix])
        if not prefix or not (parts[prefix] in _top_level_names(modules[module]) or
                              re.fullmatch(r"__\w+__", parts[prefix])):
            bad.append(name)
    return bad


def test_architecture_doc_names_every_module_and_only_real_ones():
    """docs/architecture.md names every module of the package (in backticks), and every ``ds_usp.*`` name it gives is
    a module or something a module defines."""
    modules = _modules()
    doc = DOC.read_text()
    named = set(re.findall(r"`(ds_usp(?:\.\w+)*)`", doc))
    missing = sorted(m for m in modules if m not in named and not m.startswith("ds_usp.native.op_builder"))
    assert not missing, f"docs/architecture.md does not name these modules: {missing}"
    assert not unknown_names(doc, modules), f"docs/architecture.md names what does not exist: {unknown_names(doc, modules)}"


def relative_names(text: str, me: str) -> list[str]:
    """The ``:mod:`.name``` references of module ``me``'s text, as absolute names (relative to its package)."""
    package = me if (ROOT.joinpath(*me.split(".")) / "__init__.py").exists() else me.rpartition(".")[0]
    return [f"{package}.{name}" for name in re.findall(r":mod:`\.([\w.]+)`", text)]


def test_docstrings_and_comments_name_existing_modules():
    """A docstring or comment that names a ``ds_usp`` module or function names one that exists (modules move; the
    docstrings that pointed at them must move too), also as a relative ``:mod:`` reference."""
    modules = _modules()
    stale = {}
    for path in sorted((ROOT / "ds_usp").rglob("*.py")):
        text = path.read_text()
        bad = unknown_names(text, modules) + [n for n in relative_names(text, _module_name(path)) if n not in modules]
        if bad:
            stale[str(path.relative_to(ROOT))] = bad
    assert not stale, f"names of things that do not exist: {stale}"


def test_the_name_check_sees_a_missing_name():
    modules = _modules()
    assert unknown_names("see ds_usp.cost.choose_features and ds_usp.integration.step.forward", modules) == []
    assert unknown_names("see ds_usp.integration.memory.apply, ds_usp.cost.no_such_thing", modules) == [
        "ds_usp.cost.no_such_thing", "ds_usp.integration.memory.apply"]
