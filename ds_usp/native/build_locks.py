"""Stale JIT build locks: named within a minute instead of an endless silent wait.

torch's JIT extension builds (ds-usp's op, DeepSpeed's shm op) serialise on a ``lock`` file in the build folder
(``torch.utils.file_baton.FileBaton``); a process killed during its build leaves the file, and every later build of that
extension waits for it forever, printing nothing. :func:`watch_build_locks`, started when ds-usp starts a build
(``ds_usp.initialize`` before DeepSpeed's, and before the native op's), looks at the extensions folder every few
seconds in a daemon thread; a lock that no live process holds (no process works in its build folder or names it on its
command line) on two looks in a row is reported on stderr with the command that removes it. It watches for :data:`WATCH_SECONDS` and never touches a lock itself.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

WATCH_SECONDS = 900.0  # builds happen at start-up: stop watching after this
_started = threading.Event()


def extensions_root() -> Path:
    """The folder torch builds JIT extensions in (``TORCH_EXTENSIONS_DIR``, else torch's default)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(get_default_build_root())
    import torch

    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return root / f"{version}_{cuda}"


def _build_in_progress(folder: Path) -> bool:
    """Whether a live process works in ``folder`` (its working directory, as ninja's, or a path on its command line,
    as the compiler's)."""
    target = str(folder.resolve())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():  # this process waits; its builds run in children
            continue
        try:
            if os.readlink(proc / "cwd").startswith(target):
                return True
            if target.encode() in (proc / "cmdline").read_bytes():
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def unheld_locks(root: Path) -> list[Path]:
    """The ``lock`` files under ``root`` (one folder per extension, torch's versioned sub-folders too) that no live
    build holds."""
    if not root.is_dir():
        return []
    locks = list(root.glob("*/lock")) + list(root.glob("*/*/lock"))
    return sorted(lock for lock in locks if not _build_in_progress(lock.parent))


def report(lock: Path) -> str:
    """The message for a stale lock."""
    return (f"ds-usp: the JIT build lock {lock} is held by no live build (a process was killed while building "
            f"{lock.parent.name}); every build of it waits on this file forever. Remove it and launch again: rm {lock}")


def watch_build_locks(root: Optional[Path] = None, interval: float = 10.0, duration: float = WATCH_SECONDS,
                      emit: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
                      once: bool = True) -> Optional[threading.Thread]:
    """Start the daemon thread that reports stale build locks (see the module docstring).

    Args:
        root: the extensions folder (default :func:`extensions_root`).
        interval: seconds between looks (a lock is reported after two looks without a holder).
        duration: seconds to watch.
        emit: where a report goes (stderr).
        once: start at most one watcher per process.

    Returns:
        The thread, or None when one already runs (or on a system without ``/proc``).
    """
    if (once and _started.is_set()) or not Path("/proc").is_dir():
        return None
    _started.set()

    def watch() -> None:
        folder = root if root is not None else extensions_root()
        suspects: set[Path] = set()
        reported: set[Path] = set()
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            now = set(unheld_locks(folder))
            for lock in sorted((now & suspects) - reported):
                if lock.exists():
                    emit(report(lock))
                    reported.add(lock)
            suspects = now
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="ds-usp build-lock watch", daemon=True)
    thread.start()
    return thread
