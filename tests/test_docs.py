"""What the docs and setup.py state is what the code and CI do.

* setup.py: the installed versions satisfy every requirement; the floors of the packages CI pins (torch, deepspeed,
  transformers, accelerate, trl) are the versions the dev extra pins or the oldest ones tests/test_oldest.py runs, and
  the dev extra's exact pins are the installed versions, so a floor no CI run uses fails here; the README's and CI's ``pip install torch==...`` is the dev pin.
* docs/config.md: every key of the schema (``ds_usp.config.USPSettings``) has a row in the key table and a section, no
  key outside the schema is documented as one, the values listed for a key are its ``Literal`` values, and every
  context-free row of an "invalid value | error" table is the error ``load_usp_config`` raises for that value.
"""
from __future__ import annotations

import ast
import json
import re
import typing
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from ds_usp.config import OLD_KEYS, SP_MODES, USPConfigError, USPSettings, _valid, load_usp_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "config.md"
PINNED_EXACTLY = ("torch", "deepspeed")  # the dev extra pins these with ==, as the README's install command pins torch


# ------------------------------------------------------------------------------------------------------ setup.py


def _requirements() -> dict[str, list[Requirement]]:
    """``install_requires`` (under ``"install"``) and each extra of setup.py, read without running it."""
    call = next(node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords
              if k.arg in ("install_requires", "extras_require")}
    groups = {"install": kwargs["install_requires"], **kwargs["extras_require"]}
    return {name: [Requirement(r) for r in reqs] for name, reqs in groups.items()}


def _installed(name: str) -> Version | None:
    try:
        return Version(version(name))
    except PackageNotFoundError:
        return None


def _lower_bound(req: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    return bounds[0] if bounds else None


def _is_pin(req: Requirement) -> bool:
    """``==x`` or ``>=x,<y``: the dev extra says which version CI runs."""
    return any(s.operator == "==" for s in req.specifier) or any(s.operator in ("<", "<=") for s in req.specifier)


def test_installed_versions_satisfy_setup_py():
    """What CI installs (the install requirements and the dev extra) is there and satisfies them; the other extras'
    requirements are satisfied where their package is installed (CI does not install matplotlib or flash-attn)."""
    problems = []
    for group, reqs in _requirements().items():
        for req in reqs:
            found = _installed(req.name)
            if found is None:
                if group in ("install", "dev"):
                    problems.append(f"{group}: {req} is not installed")
            elif not req.specifier.contains(found, prereleases=True):
                problems.append(f"{group}: {req} but {req.name} {found} is installed")
    assert not problems, "\n".join(problems)


def test_floors_are_the_versions_ci_runs():
    """A floor of a package the dev extra pins is the dev pin's version, and the exact pins are the installed ones."""
    groups = _requirements()
    dev = {req.name: req for req in groups["dev"] if _is_pin(req)}
    assert set(PINNED_EXACTLY) <= set(dev), f"the dev extra must pin {PINNED_EXACTLY} exactly"
    for name in PINNED_EXACTLY:
        pin = _lower_bound(dev[name])
        assert [s.operator for s in dev[name].specifier] == ["=="], dev[name]
        installed = _installed(name)
        assert installed is not None and Version(installed.public) == pin, (
            f"the dev extra pins {dev[name]} but {name} {installed} is installed: pin the version CI runs")
    from test_oldest import OLDEST  # the oldest set a subset of the suite runs at (LLaMA-Factory 0.9.5's pins)

    oldest = {Requirement(pin).name: _lower_bound(Requirement(pin)) for pin in OLDEST}
    wrong = []
    for group in ("install", "hf", "demo", "trainer"):
        for req in groups[group]:
            floor = _lower_bound(req)
            if req.name in dev and floor not in (_lower_bound(dev[req.name]), oldest.get(req.name)):
                wrong.append(f"{group}: {req}, but CI runs {dev[req.name]} (and {oldest.get(req.name)})")
    assert not wrong, "floors that CI does not run:\n" + "\n".join(wrong)
    pinned_here = {req.name for group in ("install", "hf", "demo", "trainer") for req in groups[group]} & set(dev)
    assert {"torch", "deepspeed", "transformers", "accelerate", "trl"} <= pinned_here


def test_the_install_commands_pin_the_dev_torch():
    """The README's quick start and .ci/run install the torch the dev extra pins."""
    pin = next((str(_lower_bound(r)) for r in _requirements()["dev"] if r.name == "torch"), None)
    assert pin is not None, "the dev extra does not pin torch"
    for path in (ROOT / "README.md", ROOT / ".ci" / "run"):
        pins = set(re.findall(r"pip install torch==([\w.+]+)", path.read_text()))
        assert pins == {pin}, f"{path.name} installs torch {pins}, the dev extra pins {pin}"


# --------------------------------------------------------------------------------------------- docs/config.md


def _values(annotation: typing.Any) -> set | None:
    """The values a key's annotation allows when they can be listed (``Literal`` strings, ``true``/``false``), else
    None (integers, numbers)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return set(typing.get_args(annotation))
    if origin is typing.Annotated:
        return _values(typing.get_args(annotation)[0])
    if annotation is bool:
        return {True, False}
    if origin is typing.Union:
        parts = [_values(a) for a in typing.get_args(annotation) if a is not type(None)]
        return None if any(p is None for p in parts) else set().union(*parts)
    return None


ENUMERABLE = {key: _values(info.annotation) for key, info in USPSettings.model_fields.items()}
ENUMERABLE = {key: values for key, values in ENUMERABLE.items() if values is not None}


def _listed(text: str) -> set:
    """The values a "valid values" text names: ``'auto'`` -> "auto", ``true`` -> True."""
    found = {m for m in re.findall(r"'([^']*)'", text)}
    found |= {word == "true" for word in re.findall(r"\b(true|false)\b", re.sub(r"'[^']*'", "", text))}
    return found


def _sections() -> list[tuple[str, list[str]]]:
    """``(heading, lines)`` for each ``##``/``###`` section of docs/config.md."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    for line in CONFIG_DOC.read_text().splitlines():
        if line.startswith("## ") or line.startswith("### "):
            sections.append((line, []))
        else:
            sections[-1][1].append(line)
    return sections


def test_every_schema_key_is_documented_and_no_other():
    doc = CONFIG_DOC.read_text()
    table = set(re.findall(r"^\| `usp\.(\w+)` \|", doc, flags=re.M))
    headed = {key for heading, _ in _sections() for key in re.findall(r"`usp\.(\w+)`", heading)}
    schema = set(USPSettings.model_fields)
    assert table == schema, f"key table vs schema: {sorted(table ^ schema)}"
    assert headed == schema, f"keys with a section vs schema: {sorted(headed ^ schema)}"
    # any other usp.<name> the doc mentions is an old name or documented as refused
    others = set(re.findall(r"(?<![\w.])usp\.(\w+)", doc)) - schema - set(OLD_KEYS)  # not engine.usp.topo
    unrefused = {name for name in others if f"usp.{name} is not a known key" not in doc}
    assert not unrefused, f"docs/config.md documents keys the schema does not have: {sorted(unrefused)}"
    for block in re.findall(r"```json\n(.*?)```", doc, flags=re.S):
        assert set(json.loads(block).get("usp", {})) <= schema, block


def test_listed_values_are_the_schemas():
    """The schema's own "valid" text (what the key table and the messages show), every "must be ..." in the doc,
    and the value bullets of a key's section list exactly the key's Literal values."""
    doc = CONFIG_DOC.read_text()
    for key, values in ENUMERABLE.items():
        assert _listed(_valid(key)) == values, (key, _valid(key), values)
        for stated in re.findall(rf"usp\.{key} \([^)]*\) is invalid: must be ([^`;]+)", doc):
            assert stated == _valid(key), (key, stated)
    bullets_checked = 0
    for heading, lines in _sections():
        keys = re.findall(r"`(usp\.\w+|sequence_parallel)`", heading)
        if len(keys) != 1:
            continue
        key = keys[0]
        values = set(SP_MODES) if key == "sequence_parallel" else ENUMERABLE.get(key.removeprefix("usp."))
        bullets = {json.loads(v) for v in (re.match(r"- `([^`]+)`", line).group(1) for line in lines
                                           if re.match(r"- `[^`]+`", line))}
        if bullets:
            assert values is not None and bullets == values, (key, bullets, values)
            bullets_checked += 1
    assert bullets_checked >= 4  # sequence_parallel, attn_backend, native_op, comm_dtype


def _documented_errors():
    """``(section key, invalid value cell, error)`` of each "invalid value | error" row that needs no context."""
    rows = []
    for heading, lines in _sections():
        keys = re.findall(r"`(usp\.\w+|usp|sequence_parallel_size|sequence_parallel)`", heading)
        in_table = False
        for line in lines:
            if line.startswith("| invalid value"):
                in_table, with_when = True, line.count("|") > 3
                continue
            if not line.startswith("|"):
                in_table = False
            if not in_table or line.startswith("| ---"):
                continue
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if with_when and cells[-1] != "config":
                continue
            value = re.sub(r"\([^)]*\)", "", cells[0])  # remarks in parentheses
            tokens = re.findall(r"`([^`]+)`", value)
            if not tokens or re.sub(r"`[^`]+`|[,\s]", "", value):  # "... with ...": needs a context
                continue
            rows.append((keys[0] if len(keys) == 1 else None, tokens[0], re.search(r"`([^`]+)`", cells[1]).group(1)))
    return rows


def _config_for(key: str | None, token: str) -> dict:
    """A config with the invalid value of a row: ``"k": v`` pairs go into the usp block, a bare value under ``key``."""
    cfg: dict = {"sequence_parallel": "usp", "sequence_parallel_size": 8}
    try:
        value = json.loads(token)
    except json.JSONDecodeError:
        cfg["usp"] = json.loads("{" + token + "}")
        return cfg
    assert key is not None, f"a bare value {token} in a section about several keys"
    if key.startswith("usp."):
        cfg["usp"] = {key.removeprefix("usp."): value}
    else:
        cfg[key] = value
    return cfg


DOCUMENTED_ERRORS = _documented_errors()


def test_enough_documented_errors_are_checked():
    assert len(DOCUMENTED_ERRORS) >= 20, DOCUMENTED_ERRORS


@pytest.mark.parametrize("key,token,error", DOCUMENTED_ERRORS, ids=[f"{k}={t}" for k, t, _ in DOCUMENTED_ERRORS])
def test_documented_error_is_the_codes(key, token, error):
    """World and ``sequence_parallel_size`` 8, as the doc's tables assume unless a row says otherwise."""
    with pytest.raises(USPConfigError) as raised:
        load_usp_config(_config_for(key, token), world_size=8, local_world_size=8)
    assert str(raised.value) == error
