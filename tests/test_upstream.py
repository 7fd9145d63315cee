"""Every change to a third-party object is in ds_usp/upstream/, and every collective in ds_usp/comm.py.

The package's syntax trees are walked (no import, no world) and each rule names the offending file, line and
expression:

* (a) an attribute assigned, augmented or deleted (``x.a = ...``, ``x.a += ...``, ``del x.a``), or a ``setattr`` /
  ``delattr`` (``object.__setattr__``) call, on anything but ``self`` / ``cls``, or the ``ctx`` that torch's autograd
  hands to a ``torch.autograd.Function``'s ``forward`` / ``setup_context`` / ``backward`` (or to the functions given
  to ``torch.library.register_autograd``): that object may be someone else's;
* (b) a call of a single-underscore attribute (``x._name(...)``) on anything but ``self``, ``cls`` or ``super()``:
  someone else's private API (torch's operator namespaces, ``torch.ops.aten._foo`` or a module-level alias of
  ``torch.ops.aten``, name operators and are allowed);
* (c) a ``torch.distributed`` collective called outside ds_usp/comm.py, whatever its alias (``dist.all_reduce``,
  ``torch.distributed.barrier``, ``from torch.distributed import all_gather``).

Rules (a) and (b) skip ds_usp/upstream/ (the registered patches live there); rule (c) skips only
ds_usp/comm.py. Each rule is shown to catch a violation planted in a temporary file, through the same function.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ds_usp"
UPSTREAM = PACKAGE / "upstream"
COMM = PACKAGE / "comm.py"

COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_coalesced", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list", "gather", "gather_object",
    "scatter", "scatter_object_list", "reduce"})
OWN = frozenset({"self", "cls"})
AUTOGRAD_METHODS = frozenset({"forward", "setup_context", "backward"})


def _aliases(tree: ast.Module) -> dict[str, str]:
    """``local name -> dotted name`` of every import in the module (at any depth) and of module-level assignments of
    a dotted name (``aten = torch.ops.aten``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = _dotted(node.value, names)
            if target is not None:
                names[node.targets[0].id] = target
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> Optional[str]:
    """``a.b.c`` with ``a`` resolved through the imports (None: not a name or a chain of attributes)."""
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _is_function_class(cls: ast.ClassDef, names: dict[str, str]) -> bool:
    """Whether ``cls`` subclasses torch's autograd ``Function``."""
    return any((_dotted(base, names) or "").split(".")[-1] == "Function" for base in cls.bases)


def _autograd_hooks(tree: ast.Module, names: dict[str, str]) -> set[str]:
    """The functions given to ``torch.library.register_autograd`` as backward or ``setup_context``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (_dotted(node.func, names) or "").endswith("register_autograd"):
            given = node.args[1:2] + [k.value for k in node.keywords if k.arg in ("backward", "setup_context")]
            found.update(arg.id for arg in given if isinstance(arg, ast.Name))
    return found


class _Checker(ast.NodeVisitor):
    """Collects the offences of one module (see the module docstring)."""

    def __init__(self, path: str, tree: ast.Module, rules: str) -> None:
        self.path, self.rules, self.found = path, rules, []
        self.names = _aliases(tree)
        self.hooks = _autograd_hooks(tree, self.names)
        self.classes: list[ast.ClassDef] = []
        self.ctx: list[Optional[str]] = [None]  # per enclosing function: the name of autograd's ctx there

    def _offence(self, rule: str, node: ast.AST, text: Optional[str] = None) -> None:
        expr = " ".join((text or ast.unparse(node)).split())
        self.found.append(f"{self.path}:{node.lineno}: ({rule}) {expr[:160]}")

    def _own(self, obj: ast.AST) -> bool:
        return isinstance(obj, ast.Name) and (obj.id in OWN or obj.id == self.ctx[-1])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.ctx.append(None)
        self.generic_visit(node)
        self.ctx.pop()
        self.classes.pop()

    def _visit_function(self, node: ast.AST) -> None:
        args = node.args.posonlyargs + node.args.args
        first = args[0].arg if args else None
        in_function_class = bool(self.classes) and _is_function_class(self.classes[-1], self.names)
        autograd = (in_function_class and node.name in AUTOGRAD_METHODS) or node.name in self.hooks
        self.ctx.append(first if autograd and first == "ctx" else None)
        self.generic_visit(node)
        self.ctx.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def _foreign(self, target: ast.AST) -> bool:
        """Whether an assignment or deletion target is an attribute of an object that is not this one's."""
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(self._foreign(element) for element in target.elts)
        if isinstance(target, ast.Starred):
            return self._foreign(target.value)
        return isinstance(target, ast.Attribute) and not self._own(target.value)

    def _statement(self, node: ast.AST, targets: list[ast.AST]) -> None:
        if "a" in self.rules and any(self._foreign(target) for target in targets):
            self._offence("a", node, ast.unparse(node).split("\n")[0])
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._statement(node, node.targets)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._statement(node, [node.target])

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._statement(node, [node.target])

    def visit_Delete(self, node: ast.Delete) -> None:
        self._statement(node, node.targets)

    def visit_Call(self, node: ast.Call) -> None:
        func, name = node.func, _dotted(node.func, self.names) or ""
        setter = (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")) or name in (
            "object.__setattr__", "object.__delattr__")
        if "a" in self.rules and setter and node.args and not self._own(node.args[0]):
            self._offence("a", node)
        if ("b" in self.rules and isinstance(func, ast.Attribute) and func.attr.startswith("_")
                and not func.attr.startswith("__") and not self._own(func.value) and not _is_super(func.value)
                and not (_dotted(func.value, self.names) or "").startswith("torch.ops.")):
            self._offence("b", node)
        if "c" in self.rules and name.startswith("torch.distributed.") and name.split(".")[-1] in COLLECTIVES:
            self._offence("c", node)
        self.generic_visit(node)


def _is_super(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def offences(source: str, path: str = "<source>", rules: str = "abc") -> list[str]:
    """The offences against ``rules`` (a subset of ``"abc"``, see the module docstring) in one module's source.

    Args:
        source: the module's text.
        path: its name in the messages.
        rules: which rules to apply.

    Returns:
        ``"path:line: (rule) expression"``, one per offence, in source order.
    """
    tree = ast.parse(source)
    checker = _Checker(path, tree, rules)
    checker.visit(tree)
    return checker.found


INSTRUMENTS = PACKAGE / "instruments"  # the tests' and benchmarks' meters: they wrap torch.distributed to count


def package_offences(package: Path = PACKAGE) -> list[str]:
    """Every offence in ``package``: rules a and b outside its ``upstream/``, rule c outside its
    ``comm.py``, none in ``instruments/`` (paths named from the package's parent)."""
    upstream, comm = package / UPSTREAM.relative_to(PACKAGE), package / COMM.relative_to(PACKAGE)
    instruments = package / INSTRUMENTS.relative_to(PACKAGE)
    found = []
    for path in sorted(package.rglob("*.py")):
        if instruments in path.parents:
            continue
        rules = ("" if upstream in path.parents else "ab") + ("" if path == comm else "c")
        if rules:
            found += offences(path.read_text(), str(path.relative_to(package.parent)), rules)
    return found


def _rule(rule: str) -> list[str]:
    return [line for line in package_offences() if f": ({rule}) " in line]


def test_no_third_party_object_is_changed_outside_upstream():
    found = _rule("a")
    assert not found, ("attributes of objects that are not self/cls/autograd's ctx are changed outside "
                       "ds_usp/upstream/ (register the change there as a Patch):\n" + "\n".join(found))


def test_no_private_call_outside_upstream():
    found = _rule("b")
    assert not found, ("single-underscore attributes of other objects are called outside "
                       "ds_usp/upstream/ (register the call there as a Patch):\n" + "\n".join(found))


BOOTSTRAP = ROOT / "_ds_usp_auto.py"
# the bootstrap's only changes to other objects, each a registered patch: the import finder's loaders
# ("import_finder") and the gates' wraps ("deepspeed_initialize", "deepspeed_config_batch", "trainer_batch_size",
# "trainer_adoption")
BOOTSTRAP_CHANGES = {"_Loader.exec_module": "import_finder", "_Watcher.find_spec": "import_finder",
                     "_wrap": "deepspeed_initialize"}


def _functions_of_lines(tree: ast.Module) -> dict[int, str]:
    """``line -> Class.function`` (or ``function``) for every line inside a function of the module."""
    where = {}
    for node in tree.body:
        inner = node.body if isinstance(node, ast.ClassDef) else [node]
        for fn in inner:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{node.name}.{fn.name}" if isinstance(node, ast.ClassDef) else fn.name
                where.update({line: name for line in range(fn.lineno, fn.end_lineno + 1)})
    return where


def test_the_bootstrap_changes_only_what_the_patch_table_records():
    """The bootstrap (top-level ``_ds_usp_auto.py``, outside the package) is walked by the same rules: it changes
    other objects only in the functions listed above, each a registered patch, and runs no collective."""
    from ds_usp.upstream.catalog import PATCHES

    text = BOOTSTRAP.read_text()
    where = _functions_of_lines(ast.parse(text))
    found = offences(text, "_ds_usp_auto.py", "abc")
    outside = [line for line in found if where.get(int(line.split(":")[1])) not in BOOTSTRAP_CHANGES]
    assert found and not outside, "the bootstrap changes other objects outside its recorded places:\n" + "\n".join(
        outside)
    assert {BOOTSTRAP_CHANGES[where[int(line.split(":")[1])]] for line in found} == set(BOOTSTRAP_CHANGES.values())
    assert all(key in PATCHES for key in ("import_finder", "deepspeed_initialize", "deepspeed_config_batch",
                                          "trainer_batch_size", "trainer_adoption"))
    assert "sys.meta_path" in PATCHES["import_finder"].target


def test_every_collective_goes_through_comm():
    found = _rule("c")
    assert not found, "torch.distributed collectives called outside ds_usp/comm.py:\n" + "\n".join(found)


# ---- the rules are not vacuous: planted violations, through the same function ------------------------------------

def _planted(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "planted.py"
    path.write_text(text)
    return offences(path.read_text(), path.name)


def test_rule_a_catches_an_assignment_to_another_object(tmp_path):
    found = _planted(tmp_path, "import deepspeed\n"
                               "def f(engine, model):\n"
                               "    engine.forward = lambda: 0\n"
                               "    engine.steps += 1\n"
                               "    del engine.save_checkpoint\n"
                               "    setattr(model, 'fused', True)\n"
                               "    delattr(model, 'fused')\n"
                               "    a, model.b = 1, 2\n"
                               "    object.__setattr__(model, 'c', 3)\n"
                               "    deepspeed.initialize = f\n")
    assert [line.split(":")[1] for line in found] == ["3", "4", "5", "6", "7", "8", "9", "10"], found
    assert found[0] == "planted.py:3: (a) engine.forward = lambda: 0"
    assert all(": (a) " in line for line in found)


def test_rule_a_allows_self_cls_and_autograds_ctx(tmp_path):
    assert _planted(tmp_path, "import torch\n"
                              "class A:\n"
                              "    def __init__(self):\n"
                              "        self.x = 1\n"
                              "        setattr(self, 'y', 2)\n"
                              "        object.__setattr__(self, 'z', 3)\n"
                              "    @classmethod\n"
                              "    def make(cls):\n"
                              "        cls.count = 0\n"
                              "class F(torch.autograd.Function):\n"
                              "    @staticmethod\n"
                              "    def forward(ctx, x):\n"
                              "        ctx.n = 1\n"
                              "        return x\n"
                              "def setup(ctx, inputs, output):\n"
                              "    ctx.rank = 0\n"
                              "torch.library.register_autograd('ns::op', lambda ctx, g: g, setup_context=setup)\n"
                              ) == []
    found = _planted(tmp_path, "class NotAutograd:\n"
                               "    def forward(ctx, x):\n"
                               "        ctx.n = 1\n")
    assert found == ["planted.py:3: (a) ctx.n = 1"]  # ctx is only autograd's inside a Function


def test_rule_b_catches_a_private_call_on_another_object(tmp_path):
    found = _planted(tmp_path, "import torch\n"
                               "import torch.distributed as dist\n"
                               "aten = torch.ops.aten\n"
                               "class A(Base):\n"
                               "    def f(self, engine):\n"
                               "        self._mine()\n"
                               "        super()._theirs()\n"
                               "        torch.ops.aten._scaled_dot_product_flash_attention(1)\n"
                               "        aten._efficient_attention_forward(1)\n"
                               "        engine._save_checkpoint('d', 't')\n"
                               "        dist.distributed_c10d._resolve_process_group('g')\n"
                               "        self.accelerator.state._set_sync_gradients(True)\n")
    assert found == ["planted.py:10: (b) engine._save_checkpoint('d', 't')",
                     "planted.py:11: (b) dist.distributed_c10d._resolve_process_group('g')",
                     "planted.py:12: (b) self.accelerator.state._set_sync_gradients(True)"], found


def test_rule_c_catches_a_collective_under_any_alias(tmp_path):
    found = _planted(tmp_path, "import torch\n"
                               "import torch.distributed as dist\n"
                               "from torch import distributed as td\n"
                               "from torch.distributed import all_gather_object as ago\n"
                               "def f(x, group):\n"
                               "    dist.all_reduce(x, group=group)\n"
                               "    torch.distributed.barrier()\n"
                               "    td.broadcast(x, 0)\n"
                               "    ago([None], x)\n"
                               "    dist.get_rank(group)\n"
                               "    dist.get_world_size()\n")
    assert [line.split(":")[1] for line in found] == ["6", "7", "8", "9"], found
    assert found[3] == "planted.py:9: (c) ago([None], x)"
    assert all(": (c) " in line for line in found)


def test_the_package_walk_applies_each_rule_where_it_holds(tmp_path):
    """Rules a/b skip upstream/, rule c skips comm.py only (a planted package with the same names)."""
    package = tmp_path / "ds_usp"
    upstream = package / "upstream"
    upstream.mkdir(parents=True)
    body = "import torch.distributed as dist\ndef f(e):\n    e.x = 1\n    e._p()\n    dist.barrier()\n"
    for path in (upstream / "patch.py", package / "comm.py", package / "other.py"):
        path.write_text(body)
    found = sorted((line.split(":")[0], line.split(" ")[1]) for line in package_offences(package))
    assert found == [("ds_usp/comm.py", "(a)"), ("ds_usp/comm.py", "(b)"),
                     ("ds_usp/other.py", "(a)"), ("ds_usp/other.py", "(b)"), ("ds_usp/other.py", "(c)"),
                     ("ds_usp/upstream/patch.py", "(c)")], found


def test_architecture_doc_lists_every_registered_patch():
    """docs/architecture.md's patch table is the registry's (every ``Patch`` registered, with its texts), so a patch
    added without its row, or a row left after its patch went, fails here."""
    from ds_usp.upstream import catalog

    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = catalog.patch_table()
    assert len(catalog.PATCHES) > 20
    assert table in doc, ("docs/architecture.md's patch table differs from the registry's; paste this under "
                          "'## Patches of third-party code':\n" + table)


def test_the_instruments_are_exempt_only_because_nothing_of_the_package_imports_them():
    """``ds_usp/instruments/`` wraps torch.distributed's functions while it measures (the bytes a rank sends) and
    runs barriers of its own: it is the tests' and the benchmarks' tool, so it is exempt from the rules only as long
    as no module of the package imports it."""
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if INSTRUMENTS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n == "ds_usp.instruments" or n.startswith("ds_usp.instruments.") for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert not importers, f"the package imports its instruments: {importers}"
