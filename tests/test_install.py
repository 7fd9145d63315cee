"""A plain (not editable) ``pip install .`` ships the top-level ``ops/`` and JIT-builds the native op from it.

The package is installed, without its dependencies, into a folder of its own (``pip install --target``) that this
interpreter then puts first on its path: the environment running the tests (the machine's Python or a virtual
environment) provides torch and DeepSpeed, whatever it is (a nested ``venv --system-site-packages`` would see the base
interpreter's packages instead of a virtual environment's). Outside the repository, the installed package holds
``ds_usp/native/op_builder`` with the C++ sources as package data, and ``python -m ds_usp.report --build`` builds the op
from them (into a temporary extension cache: a build of its own, about a minute) and reports it JIT-built. The editable
install the other tests use reads the same builders from the repository's ``ops/``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_plain_install_ships_and_jit_builds_the_op(tmp_path):
    target = tmp_path / "site"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                           str(ROOT)], env={**env, "PYTHONPATH": ""}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    # the start-up files of the JSON key's hook (tests/test_json_key.py has the editable install's): at the top of
    # site-packages, listed in RECORD (so pip uninstall removes them), and the .pth (processed as site.py does for
    # site-packages) installs the finder
    record = "\n" + next(target.glob("ds_usp-*.dist-info")).joinpath("RECORD").read_text()
    for name, text in (("ds_usp_auto.pth", "import _ds_usp_auto; _ds_usp_auto.install()\n"),
                       ("ds_usp_auto.start", "_ds_usp_auto:install\n"), ("_ds_usp_auto.py", None)):
        assert f"\n{name}," in record, name
        assert text is None or (target / name).read_text() == text, name
    hook = subprocess.run([sys.executable, "-c", f"import site, sys; site.addsitedir({str(target)!r}); import "
                           "_ds_usp_auto; print(_ds_usp_auto.__file__, any(getattr(f, '_ds_usp_watcher', False) "
                           "for f in sys.meta_path))"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert hook.stdout.split() == [str(target / "_ds_usp_auto.py"), "True"], hook.stdout + hook.stderr
    where = subprocess.run([sys.executable, "-c", "import ds_usp.native.op_builder as b; print(b.CSRC)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stdout + where.stderr
    csrc = Path(where.stdout.strip().splitlines()[-1])
    assert str(csrc).startswith(str(target)) and (csrc / "cpu" / "usp_cpu.cpp").is_file(), where.stdout + where.stderr
    report = subprocess.run([sys.executable, "-m", "ds_usp.report", "--build"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
    assert report.returncode == 0, report.stdout + report.stderr
    line = next(x for x in report.stdout.splitlines() if x.startswith("native op (cpu)"))
    assert ": jit-built: cached in " + str(tmp_path / "extensions") in line, report.stdout
