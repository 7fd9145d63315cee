"""Checkpoints that are complete or absent: a manifest written last, ``latest`` moved only after it, loads verified.

``ds_usp.initialize`` gives its engine a ``save_checkpoint`` that runs DeepSpeed's own save without touching
``latest``, then (after a collective says every rank has written its files) has the first rank of each directory
fsync every file of the tag there, write :data:`MANIFEST` (each file's size and SHA-256, the step) through a temporary
file and an atomic rename, and only then move that directory's ``latest`` the same way. A crash at any point before
that rename leaves the previous checkpoint as ``latest``, and a tag without a manifest is never taken for a complete
one.

Directories: every rank may save to a folder of its own node (node-local disks, what DeepSpeed's
``use_node_local_storage`` is for) or all to one shared folder. The ranks all-gather where they save (host name and
real path); the lowest rank of each (host, path) commits its directory (:func:`commit_directory`): the manifest lists
what that directory holds, so no rank reads a file of another directory. Two hosts' first ranks whose paths are one
shared folder both qualify: the one that creates the tag's claim file (:data:`CLAIM`, exclusive create, atomic on
NFS too) commits, the other does nothing; the claim is removed once every rank knows the commits are done.

Its ``load_checkpoint`` verifies before anything is loaded or communicated: every rank reads the manifest of its own
directory and checks every file (present, size, checksum), so a missing, truncated or corrupt file is named (path,
expected vs found) identically on every rank. By default it falls back to the newest complete checkpoint with a
warning naming what was skipped; ``load_checkpoint(..., fallback=False)`` makes that an error. Then one all-gather
checks that every rank resolved the same tag (directories whose ``latest`` differ, a save killed between two nodes'
commits, are refused by name). A directory saved without manifests (before ds-usp wrote them, or by DeepSpeed
directly) loads as before, unverified.

Asynchronous saves (``save_checkpoint(..., async_save=True)``, or ``"usp": {"async_save": true}``): the step pauses
only while each rank builds its state dicts with DeepSpeed's own per-rank builders against a checkpoint engine that
copies them (:class:`_Snapshots`), after one small all-reduce (the tag the same on every rank, no earlier background
write failed): DeepSpeed's barriers, tag check and ZeRO-3's re-gather of its persistent parameters stay off the
training thread (:func:`ds_usp.upstream.deepspeed.state_only_save`). A background thread on every rank then writes and
syncs its copies and commits by a collective, not by files: the threads all-gather (this rank's write error or none,
where it saves) over a process group of their own (gloo, every rank, created by every rank at its first asynchronous
save, the same point of the program on every rank since saves are collective; a group used by one thread only, so
the training thread's collectives never interleave with it), then each directory's committer writes the manifest
and moves ``latest``, and a second all-gather over that group tells every rank whether every commit succeeded (an
error is raised by every rank's ``wait_for_checkpoint`` or next save). The collective's timeout is
``usp.timeout_seconds``: a rank that never finishes its files fails the others' commit instead of hanging it. A save,
a load or the end of the process waits for the pending one (``engine.wait_for_checkpoint()`` does so explicitly and
raises what the background write raised; call it before ``torch.distributed.destroy_process_group``). A crash before
the manifest leaves the previous checkpoint as ``latest``, as for a blocking save. :class:`AtomicCheckpoints` holds
the three methods.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ds_usp.comm import all_gather_objects, all_reduce_max_, barrier
from ds_usp.upstream.deepspeed import checkpoint_engine_as, state_only_save
from ds_usp.log import log_warning

MANIFEST = "ds_usp_manifest.json"
LATEST = "latest"
CLAIM = ".ds_usp_commit"  # in a tag's folder while its directory's committer commits it (exclusive create)


class CheckpointDamaged(ValueError):
    """A checkpoint whose files do not match its manifest (or that has none while its directory's others do)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or its old content, never a part: a synced temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def write_manifest(folder: Path, step: int) -> dict:
    """Sync every file of a tag and write its manifest (last). Returns the manifest."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST and
                       not p.name.startswith((f".{MANIFEST}", CLAIM))):
        _fsync(path)
        files[str(path.relative_to(folder))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"step": step, "files": files}
    _write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def problems(folder: Path) -> list[str]:
    """What is wrong with a tag's files against its manifest (empty: complete and intact)."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return [f"{folder}: no {MANIFEST} (the save did not complete)"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        return [f"{manifest_path}: unreadable ({err})"]
    found = []
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            found.append(f"{path}: missing (expected {want['size']} bytes)")
        elif path.stat().st_size != want["size"]:
            found.append(f"{path}: {path.stat().st_size} bytes, expected {want['size']} (truncated or overwritten)")
        elif (digest := _sha256(path)) != want["sha256"]:
            found.append(f"{path}: SHA-256 {digest[:16]}..., expected {want['sha256'][:16]}... (corrupt)")
    return found


def read_step(folder: Path) -> int:
    """The step a tag's manifest records (-1: none)."""
    try:
        return int(json.loads((folder / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def resolve_tag(load_dir: str, tag: Optional[str], fallback: bool = True) -> Optional[str]:
    """The tag to load: ``tag`` (verified), else ``latest`` if complete, else the newest complete one.

    Args:
        load_dir: the directory given to ``save_checkpoint``.
        tag: an explicit tag (never replaced by another), or None.
        fallback: take the newest complete checkpoint when ``latest``'s is damaged (with a warning); False: raise.

    Returns:
        The tag, or None when the directory has no manifests at all (a checkpoint saved without them: unverified).

    Raises:
        CheckpointDamaged: the explicit tag, or (``fallback=False``) ``latest``'s, is damaged; or nothing complete is
            left. The message lists every file found wrong.
    """
    root = Path(load_dir)
    with_manifest = sorted((p for p in root.iterdir() if (p / MANIFEST).is_file()), key=read_step, reverse=True) \
        if root.is_dir() else []
    latest = root / LATEST
    first = latest.read_text().strip() if with_manifest and latest.is_file() else None
    order = ([first] if first else []) + [p.name for p in with_manifest if p.name != first]
    found = complete_or_newest(root, order, None if tag is None else root / tag, fallback)
    return tag if tag is not None or found is None else found.name


def complete_or_newest(root: Path, newest_first: list[str], wanted: Optional[Path],
                       fallback: bool = True) -> Optional[Path]:
    """The checkpoint folder to resume from: ``wanted`` verified, else the first complete one of ``newest_first``.

    Args:
        root: the folder holding the checkpoints.
        newest_first: the candidates' folder names under ``root``, the one to try first first.
        wanted: an explicit folder (never replaced by another), or None.
        fallback: skip a damaged candidate with a warning (False: raise).

    Returns:
        The folder; ``wanted`` itself (None included) when no candidate has a manifest (saved without ds-usp: taken
        unverified).

    Raises:
        CheckpointDamaged: ``wanted``, or (``fallback=False``) the first candidate, is damaged; or none is complete.
    """
    if not any((root / name / MANIFEST).is_file() for name in newest_first):
        return wanted
    if wanted is not None:
        verify(wanted)
        return wanted
    return root / first_complete(root, newest_first, fallback)


def verify(folder: Path) -> None:
    """Raise :class:`CheckpointDamaged` listing every file of ``folder`` found wrong against its manifest."""
    found = problems(folder)
    if found:
        raise CheckpointDamaged(f"checkpoint {folder} is damaged: " + "; ".join(found))


def first_complete(root: Path, order: list[str], fallback: bool = True) -> str:
    """The first of ``order`` (folder names under ``root``) that is complete; those before it are skipped with a
    warning naming what is wrong (``fallback=False``: an error instead).

    Raises:
        CheckpointDamaged: the first is damaged and ``fallback`` is False, or none is complete.
    """
    skipped = []
    for candidate in order:
        found = problems(root / candidate)
        if not found:
            if skipped:
                if not fallback:
                    raise CheckpointDamaged(f"the latest checkpoint in {root} is damaged: " + "; ".join(skipped) +
                                            f" (the newest complete one is {candidate!r}; load it by tag, or allow "
                                            f"the fallback)")
                log_warning(f"ds-usp: skipped damaged checkpoint(s), loading {root / candidate} instead: " +
                            "; ".join(skipped))
            return candidate
        skipped.extend(found)
    raise CheckpointDamaged(f"no complete checkpoint in {root}: " + "; ".join(skipped))


def commit(save_dir: str, tag: str, step: int, save_latest: bool) -> None:
    """A directory's committer, once every rank's files of ``tag`` are written: the manifest (last of the tag's files),
    then ``latest``."""
    write_manifest(Path(save_dir) / tag, step)
    if save_latest:
        _write_atomically(Path(save_dir) / LATEST, tag)


def where_saved(save_dir: str) -> tuple[str, str]:
    """This rank's directory as the ranks compare them: (host name, real path).

    Args:
        save_dir: the directory given to ``save_checkpoint`` on this rank.

    Returns:
        ``(socket.gethostname(), os.path.realpath(save_dir))``.
    """
    return socket.gethostname(), os.path.realpath(save_dir)


def commit_directory(save_dir: str, tag: str, step: int, save_latest: bool, places: list[tuple[str, str]],
                     rank: int) -> bool:
    """Commit this rank's directory if this rank is its committer (every rank's files are written).

    Args:
        save_dir: this rank's directory.
        tag: the checkpoint's tag.
        step: the step the manifest records.
        save_latest: move ``latest`` after the manifest.
        places: every rank's :func:`where_saved`, in rank order.
        rank: this rank.

    Returns:
        Whether this rank committed (then it holds the tag's :data:`CLAIM`, for :func:`release_claim`).
    """
    if places.index(places[rank]) != rank:  # a lower rank saves to the same (host, path)
        return False
    try:  # a first rank of another host may share the folder (a shared file system): one of them commits
        os.close(os.open(Path(save_dir) / tag / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    commit(save_dir, tag, step, save_latest)
    return True


def release_claim(save_dir: str, tag: str) -> None:
    """Remove a tag's :data:`CLAIM` (its committer, once every rank knows the commits are done; every rank before a
    save of that tag starts, for one a killed save left).

    Args:
        save_dir: this rank's directory.
        tag: the checkpoint's tag.
    """
    (Path(save_dir) / tag / CLAIM).unlink(missing_ok=True)


def _snapshot(obj: Any) -> Any:
    """A copy of a state dict that later training steps cannot change: tensors copied to host memory (a view becomes
    a compact tensor, as DeepSpeed's own clone before ``torch.save`` does), containers copied, other values deep-copied
    (numbers and strings shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, (dict, list)):
        out = copy.copy(obj)
        for key in (out.keys() if isinstance(out, dict) else range(len(out))):
            out[key] = _snapshot(out[key])
        return out
    if isinstance(obj, tuple):
        items = [_snapshot(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)):
        return obj
    return copy.deepcopy(obj)


class _Snapshots:
    """A checkpoint engine in front of DeepSpeed's: ``save`` keeps a :func:`_snapshot` of each state dict to be written
    later by the engine behind it; everything else is the engine behind it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.files: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        self.files.append((path, _snapshot(state_dict)))

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot is already compact: DeepSpeed need not clone first

    def is_decoupled(self) -> bool:
        return False


class _Pending:
    """The asynchronous save a rank still writes (at most one)."""

    def __init__(self) -> None:
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.what = ""
        self.started = False  # an asynchronous save was ever started (the same on every rank: saves are collective)

    def start(self, what: str, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - kept for wait(), logged now
                self.error = err
                log_warning(f"ds-usp: the background save of {what} failed: {err}")

        self.what, self.error, self.started = what, None, True
        self.thread = threading.Thread(target=run, name="ds-usp-save", daemon=False)  # a normal exit finishes it
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"ds-usp: the background save of {self.what} failed: {err}") from err


def _agree(mine: Any, group: Any, what: str) -> list[Any]:
    """Every rank's ``mine`` over the save's own group (just ``[mine]`` without one: a single process)."""
    return all_gather_objects(mine, group, what) if group is not None else [mine]


def _failures(found: list[str]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in enumerate(found) if e)


def _write_later(inner: Any, files: list[tuple[str, Any]], save_dir: str, tag: str, step: int, save_latest: bool,
                 rank: int, group: Any) -> None:
    """A background save's work on one rank: its files written and synced; then, over ``group`` (every rank's thread),
    one all-gather of (write error, :func:`where_saved`), each directory's commit, and one all-gather of the commits'
    errors. Every rank reaches both all-gathers whatever failed, and raises what any rank's failure was."""
    error = ""
    try:
        for path, state in files:
            inner.save(state, path)
            _fsync(Path(path))
    except Exception as err:  # noqa: BLE001 - told to every rank, raised below
        error = f"{type(err).__name__}: {err}"
    found = _agree((error, where_saved(save_dir)), group, "asynchronous checkpoint: files written")
    if any(e for e, _ in found):
        raise RuntimeError(f"{Path(save_dir) / tag}: files not written ({_failures([e for e, _ in found])}); the "
                           f"checkpoint stays incomplete and latest unchanged")
    committed = False
    try:
        committed = commit_directory(save_dir, tag, step, save_latest, [place for _, place in found], rank)
    except Exception as err:  # noqa: BLE001 - told to every rank, raised below
        error = f"{type(err).__name__}: {err}"
    errors = _agree(error, group, "asynchronous checkpoint: committed")
    if committed:
        release_claim(save_dir, tag)
    if any(errors):
        raise RuntimeError(f"{Path(save_dir) / tag}: not committed ({_failures(errors)})")


class _VerifyingLoad:
    """``engine.load_checkpoint``: the checkpoint's files verified against its manifest (:func:`resolve_tag`) before
    DeepSpeed's own load runs; ``unverified`` is DeepSpeed's load, for a caller that verified the tag itself
    (:func:`ds_usp.checkpoint.load_checkpoint`)."""

    def __init__(self, unverified: Callable[..., Any], settle: Callable[[], None]) -> None:
        self.unverified, self.settle = unverified, settle

    def __call__(self, load_dir: str, tag: Optional[str] = None, *args: Any, fallback: bool = True,
                 **kwargs: Any) -> Any:
        self.settle()
        tag = resolve_tag(load_dir, tag, fallback)
        agree_on_tag(tag)
        return self.unverified(load_dir, tag, *args, **kwargs)


def agree_on_tag(tag: Optional[str]) -> None:
    """Check that every rank resolved the same tag to load (one all-gather; nothing without a process group).

    Each rank resolves the tag in its own directory; with node-local directories a save killed between two
    directories' commits leaves their ``latest`` on different tags, and loading them would mix two steps' states.

    Args:
        tag: the tag this rank would load (None: DeepSpeed's ``latest``, unverified).

    Raises:
        CheckpointDamaged: the ranks would load different tags (every rank's named, on every rank).
    """
    if not dist.is_initialized():
        return
    tags = all_gather_objects(tag, None, "checkpoint tag to load")
    if len(set(tags)) > 1:
        named = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise CheckpointDamaged(f"ds-usp: the ranks' checkpoint directories name different checkpoints to load "
                                f"({named}): a save was interrupted between two directories' commits; load a tag "
                                f"complete in every directory by name")


class AtomicCheckpoints:
    """An engine's checkpoints complete or absent (module docstring): :meth:`save_checkpoint` (blocking or
    asynchronous), ``load_checkpoint`` (a :class:`_VerifyingLoad`) and :meth:`wait_for_checkpoint`, in front of
    DeepSpeed's own save and load (:func:`ds_usp.upstream.deepspeed.replace_checkpointing` makes them the
    engine's).

    Args:
        engine: the DeepSpeed engine, its methods still DeepSpeed's.
        async_save: whether a save without ``async_save=`` is asynchronous (``usp.async_save``).
        timeout: seconds a background commit waits for the other ranks' files (``usp.timeout_seconds``): the timeout
            of the asynchronous saves' own process group.
    """

    def __init__(self, engine: Any, async_save: bool = False, timeout: float = 1800.0) -> None:
        self.engine, self.async_save, self.timeout = engine, async_save, timeout
        self.deepspeed_save: Callable[..., Any] = engine.save_checkpoint
        self.load_checkpoint = _VerifyingLoad(engine.load_checkpoint, self.settle)
        self.pending = _Pending()
        self.commit_group: Any = None  # the background threads' own group (gloo, every rank), made at the first use

    def _commit_group(self) -> Any:
        """The group the background threads commit over: made at this engine's first asynchronous save, which every
        rank reaches at the same point (saves are collective); None in a single process."""
        if self.commit_group is None and dist.is_initialized():
            self.commit_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return self.commit_group

    def wait_for_checkpoint(self) -> None:
        """Wait for this rank's asynchronous save (if one is pending).

        Raises:
            RuntimeError: what its background write raised.
        """
        self.pending.wait()

    def settle(self, tag: Optional[str] = None, before: Callable[[], Any] = lambda: None) -> None:
        """Wait for this rank's pending save; once the engine has saved asynchronously (or a ``tag`` is to be
        checked), one all-reduce tells every rank whether any rank's background write failed (then every rank raises,
        so none goes on into a collective the failed one never reaches) and whether ``tag`` is the same on every rank
        (else every rank raises, naming it). ``before`` runs on each rank before that all-reduce.

        Raises:
            RuntimeError: a rank's background write failed (every rank's error named).
            ValueError: ``tag`` differs across ranks.
        """
        try:
            self.pending.wait()
            mine = ""
        except RuntimeError as err:
            mine = str(err)
        before()
        if not dist.is_initialized() or not (self.pending.started or tag is not None):
            if mine:
                raise RuntimeError(mine)
            return
        digest = int.from_bytes(hashlib.sha1(str(tag).encode()).digest()[:7], "big")
        flags = torch.tensor([int(bool(mine)), digest, -digest], dtype=torch.int64, device=self.engine.device)
        all_reduce_max_(flags, None, "checkpoint save check")
        if flags[0]:
            everyone = all_gather_objects(mine, None, "checkpoint save errors")
            raise RuntimeError("; ".join(f"rank {r}: {e}" for r, e in enumerate(everyone) if e))
        if tag is not None and flags[1] != -flags[2]:
            raise ValueError(f"ds-usp: the checkpoint tag differs across ranks (this rank: {tag!r}); every rank must "
                             f"save under the same tag")

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, async_save: Optional[bool] = None, **kwargs: Any) -> Any:
        """DeepSpeed's save, then the manifest and ``latest`` (module docstring); asynchronous when ``async_save``
        (default: ``usp.async_save``).

        Returns:
            What DeepSpeed's save returns.
        """
        engine = self.engine
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        step = int(engine.global_steps)
        distributed = dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        if self.async_save if async_save is None else async_save:
            return self._save_later(save_dir, tag, client_state or {}, save_latest, step, rank, **kwargs)
        self.settle()
        release_claim(save_dir, tag)  # one a killed save of this tag left; before the all-gather below on every rank
        out = self.deepspeed_save(save_dir, tag=tag, client_state=client_state or {}, save_latest=False, **kwargs)
        here = where_saved(save_dir)
        places = all_gather_objects(here, None, "checkpoint files written") if distributed else [here]  # all written
        committed = commit_directory(save_dir, tag, step, save_latest, places, rank)
        if distributed:
            barrier(None, "checkpoint committed")  # nobody returns before the checkpoint is complete
        if committed:
            release_claim(save_dir, tag)
        return out

    def _save_later(self, save_dir: str, tag: str, client_state: dict, save_latest: bool, step: int, rank: int,
                    **kwargs: Any) -> Any:
        """The asynchronous save: this rank's state copied now, written and committed in the background."""
        # one save at a time, in order (an older one never moves latest after a newer one); a claim left by an
        # earlier save of this tag that was killed must not stop its commit: each rank drops it before settle's
        # all-reduce, which comes before any rank's thread starts
        self.settle(tag, lambda: release_claim(save_dir, tag))
        group = self._commit_group()
        with checkpoint_engine_as(self.engine, _Snapshots) as snapshots:
            out = state_only_save(self.engine, save_dir, tag, client_state, **kwargs) or self.deepspeed_save(
                save_dir, tag=tag, client_state=client_state, save_latest=False, **kwargs)
        self.pending.start(f"{Path(save_dir) / tag}", lambda: _write_later(
            snapshots.inner, snapshots.files, save_dir, tag, step, save_latest, rank, group))
        return out
