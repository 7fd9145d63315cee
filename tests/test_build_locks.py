"""A JIT build lock left by a killed build is named within a minute (issue 39), a live build's is not.

Single process. A fake extensions folder with a ``lock`` no process works on is reported (path and the command that
removes it); the same lock while a process works in the build folder (as ninja does) is not. End to end: a fresh
interpreter that builds ds-usp's native op (as ``ds_usp.initialize`` does) while its folder holds a stale lock, the
wait torch would keep silent forever, prints the report within the test's 60 s.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from ds_usp.native.build_locks import report, unheld_locks, watch_build_locks


def test_a_lock_no_build_holds_is_found_and_a_live_builds_is_not(tmp_path):
    stale, live = tmp_path / "old_op" / "lock", tmp_path / "busy_op" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir()
        lock.touch()
    worker = subprocess.Popen(["sleep", "30"], cwd=live.parent)  # ninja works in the build folder
    try:
        assert unheld_locks(tmp_path) == [stale]
        seen = []
        watch_build_locks(tmp_path, interval=0.1, duration=2.0, emit=seen.append, once=False).join()
        assert seen == [report(stale)] and f"rm {stale}" in seen[0]
    finally:
        worker.kill()


def test_a_silent_wait_on_a_stale_lock_is_named_within_a_minute(tmp_path):
    """The native op's build, started the way ds_usp.initialize starts it, over a lock a killed build left."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    ask = "from ds_usp.native import _builder; print(_builder('cpu').build_name())"
    name = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    folder = tmp_path / name
    folder.mkdir()
    (folder / "lock").touch()  # what a build killed by a signal leaves
    script = "import ds_usp; ds_usp.native.resolve_native_op(True, 'cpu')"
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    named = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "held by no live build" in line:
                named.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert named.wait(60), "no report within 60 s:\n" + "".join(lines)
    finally:
        proc.kill()
    assert any(str(folder / "lock") in line and "rm " in line for line in lines), "".join(lines)
