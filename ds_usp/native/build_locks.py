"""Stale JIT build locks: named within a minute instead of an endless silent wait; another host's never called stale.

torch's JIT extension builds (ds-usp's op, DeepSpeed's shm op) serialise on a ``lock`` file in the build folder
(``torch.utils.file_baton.FileBaton``); a process killed during its build leaves the file, and every later build of that
extension waits for it forever, printing nothing. :func:`watch_build_locks`, started when ds-usp starts a build
(``ds_usp.initialize`` before DeepSpeed's, and before the native op's), looks at the extensions folder every few
seconds in a daemon thread; a lock that no live process holds on two looks in a row is reported on stderr with the
command that removes it. It watches for :data:`WATCH_SECONDS` and never touches a lock itself.

Which host holds a lock: torch's ``lock`` is an empty file, and ``TORCH_EXTENSIONS_DIR`` may be shared by several
nodes, where this host's ``/proc`` says nothing about another's builds. So ds-usp records the holder beside the lock,
in :data:`OWNER` (``{"host": ..., "pid": ...}``): the process that holds the lock open (torch's baton keeps its file
descriptor until it releases it) writes it as soon as it is found holding it (:func:`record_if_held`: ds-usp's own
build checks every quarter second, the watcher every look for any local process). A record older than its lock is
from an earlier build and ignored. A lock recorded by another host is never declared stale here: it is reported once as
held elsewhere (:func:`report_elsewhere`: this host cannot know whether that build is alive). A lock recorded by this
host is stale when its process is gone; a lock without a record falls back to the ``/proc`` look (no live process works
in its build folder, names it on its command line, or holds it open).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

WATCH_SECONDS = 900.0  # builds happen at start-up: stop watching after this
OWNER = "lock.owner"  # beside torch's ``lock``: the host and pid of the process that holds it, written by ds-usp
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
    """Whether a live process of this host works in ``folder`` (its working directory, as ninja's, or a path on its
    command line, as the compiler's) or holds its lock open (then recorded, :func:`record_if_held`)."""
    target = str(folder.resolve())
    pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]
    if record_if_held(folder / "lock", pids) is not None:
        return True
    for pid in pids:
        if int(pid) == os.getpid():  # this process waits; its builds run in children
            continue
        proc = Path("/proc", pid)
        try:
            if os.readlink(proc / "cwd").startswith(target):
                return True
            if target.encode() in (proc / "cmdline").read_bytes():
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


@dataclass(frozen=True)
class Owner:
    """Who holds a build lock, as recorded in :data:`OWNER`.

    Attributes:
        host: ``socket.gethostname()`` of the holder.
        pid: its process id there.
    """

    host: str
    pid: int


def owner_of(lock: Path) -> Optional[Owner]:
    """The holder recorded beside ``lock``.

    Args:
        lock: a ``lock`` file.

    Returns:
        The record, or None: none, unreadable, or older than the lock (left by an earlier build).
    """
    path = lock.with_name(OWNER)
    try:
        if path.stat().st_mtime_ns < lock.stat().st_mtime_ns:
            return None
        record = json.loads(path.read_text())
        return Owner(str(record["host"]), int(record["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_owner(lock: Path, pid: int) -> None:
    """Record this host and ``pid`` as ``lock``'s holder (a temporary file renamed over :data:`OWNER`).

    Args:
        lock: the ``lock`` file.
        pid: the holder's process id on this host.
    """
    tmp = lock.with_name(f".{OWNER}.{socket.gethostname()}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
        os.replace(tmp, lock.with_name(OWNER))
    except OSError:  # the build folder went away, or is not writable: nothing recorded
        tmp.unlink(missing_ok=True)


def _holds_open(pid: str, target: str) -> bool:
    """Whether process ``pid`` has the file ``target`` open (a descriptor closed while they are read is skipped, not
    taken for the whole answer: a busy process opens and closes files all the time)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # gone, or not ours to read
        return False
    for fd in fds:
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False


def record_if_held(lock: Path, pids: Optional[list[str]] = None) -> Optional[int]:
    """Record the local process that holds ``lock`` open (torch's baton keeps it open while it builds).

    Args:
        lock: the ``lock`` file.
        pids: the processes to look at (``/proc`` entries; default: every process of this host).

    Returns:
        The holder's pid, or None when no process looked at holds it.
    """
    target = str(lock.resolve())
    for pid in pids if pids is not None else [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]:
        if _holds_open(pid, target):
            mine = owner_of(lock)
            if mine != Owner(socket.gethostname(), int(pid)):
                record_owner(lock, int(pid))
            return int(pid)
    return None


@contextlib.contextmanager
def recording_holder(lock: Path, every: float = 0.25) -> Iterator[None]:
    """While the block runs (this process building into ``lock``'s folder), record this process as the lock's holder
    as soon as it holds it (within ``every`` seconds), so that another host sharing the folder never takes the build
    for a stale one; the record is removed afterwards if it is still this process's.

    Args:
        lock: the ``lock`` file of the build folder.
        every: seconds between looks at this process's open files.

    Yields:
        Nothing.
    """
    done, me = threading.Event(), str(os.getpid())

    def look() -> None:
        while record_if_held(lock, [me]) is None and not done.wait(every):
            pass

    thread = threading.Thread(target=look, name="ds-usp build-lock record", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        record = lock.with_name(OWNER)
        try:
            if json.loads(record.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}:
                record.unlink()
        except (OSError, ValueError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def lock_state(lock: Path) -> str:
    """Whether ``lock`` is held, and where.

    Args:
        lock: a ``lock`` file.

    Returns:
        ``"elsewhere"`` (recorded by another host: never stale from here), ``"held"`` (a live process of this host
        holds it or works on its build) or ``"stale"`` (recorded by this host for a process that is gone, or
        unrecorded and no live process works on it).
    """
    owner = owner_of(lock)
    if owner is not None and owner.host != socket.gethostname():
        return "elsewhere"
    if owner is not None:
        return "held" if _alive(owner.pid) else "stale"
    return "held" if _build_in_progress(lock.parent) else "stale"


def _locks(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(list(root.glob("*/lock")) + list(root.glob("*/*/lock")))


def unheld_locks(root: Path) -> list[Path]:
    """The ``lock`` files under ``root`` (one folder per extension, torch's versioned sub-folders too) that no live
    build holds: those :func:`lock_state` calls stale (never one recorded by another host).

    Args:
        root: the extensions folder.

    Returns:
        The stale locks, sorted.
    """
    return [lock for lock in _locks(root) if lock_state(lock) == "stale"]


def held_elsewhere(root: Path) -> dict[Path, Owner]:
    """The ``lock`` files under ``root`` that another host records holding.

    Args:
        root: the extensions folder.

    Returns:
        Each such lock and its recorded holder.
    """
    found = {lock: owner_of(lock) for lock in _locks(root)}
    return {lock: owner for lock, owner in found.items() if owner is not None and owner.host != socket.gethostname()}


def report(lock: Path) -> str:
    """The message for a stale lock."""
    return (f"ds-usp: the JIT build lock {lock} is held by no live build (a process was killed while building "
            f"{lock.parent.name}); every build of it waits on this file forever. Remove it and launch again: rm {lock}")


def report_elsewhere(lock: Path, owner: Owner) -> str:
    """The message for a lock another host holds (``TORCH_EXTENSIONS_DIR`` shared between nodes)."""
    return (f"ds-usp: waiting for the JIT build of {lock.parent.name} by process {owner.pid} on host {owner.host} "
            f"(its lock {lock}; this host cannot see that process). If that build was killed, remove the lock on "
            f"any host: rm {lock}")


def watch_build_locks(root: Optional[Path] = None, interval: float = 10.0, duration: float = WATCH_SECONDS,
                      emit: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
                      once: bool = True) -> Optional[threading.Thread]:
    """Start the daemon thread that reports stale build locks, and those another host holds (module docstring).

    Args:
        root: the extensions folder (default :func:`extensions_root`).
        interval: seconds between looks (a lock is reported after two looks that find it the same way).
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
        suspects: dict[Path, str] = {}
        reported: set[tuple[Path, str]] = set()
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            now = {lock: lock_state(lock) for lock in _locks(folder)}
            for lock, state in sorted(now.items()):
                if state == "held" or suspects.get(lock) != state or (lock, state) in reported:
                    continue  # a report needs the same finding on two looks in a row
                owner = owner_of(lock) if state == "elsewhere" else None
                if lock.exists() and (state == "stale" or owner is not None):
                    emit(report(lock) if state == "stale" else report_elsewhere(lock, owner))
                    reported.add((lock, state))
            suspects = now
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="ds-usp build-lock watch", daemon=True)
    thread.start()
    return thread
