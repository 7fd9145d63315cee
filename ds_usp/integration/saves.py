"""Checkpoints that are complete or absent: a manifest written last, ``latest`` moved only after it, loads verified.

``ds_usp.initialize`` gives its engine a ``save_checkpoint`` that runs DeepSpeed's own save without touching
``latest``, then (after every rank has written its files) has rank 0 fsync every file of the tag, write
:data:`MANIFEST` (each file's size and SHA-256, the step) through a temporary file and an atomic rename, and only then
move ``latest`` the same way. A crash at any point before that rename leaves the previous checkpoint as ``latest``, and
a tag without a manifest is never taken for a complete one.

Its ``load_checkpoint`` verifies before anything is loaded or communicated: every rank reads the manifest and checks
every file (present, size, checksum), so a missing, truncated or corrupt file is named (path, expected vs found)
identically on every rank. By default it falls back to the newest complete checkpoint with a warning naming what was
skipped; ``load_checkpoint(..., fallback=False)`` makes that an error. A directory saved without manifests (before
ds-usp wrote them, or by DeepSpeed directly) loads as before, unverified.

The files of a tag must be visible to rank 0 (one node, or a shared filesystem: what DeepSpeed's own ``latest``
assumes).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from ds_usp.log import log_warning

MANIFEST = "ds_usp_manifest.json"
LATEST = "latest"


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
                       not p.name.startswith(f".{MANIFEST}")):
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
    if not with_manifest:
        return tag
    if tag is not None:
        verify(root / tag)
        return tag
    latest = root / LATEST
    first = latest.read_text().strip() if latest.is_file() else None
    order = ([first] if first else []) + [p.name for p in with_manifest if p.name != first]
    return first_complete(root, order, fallback)


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


def install(engine: Any) -> None:
    """Give ``engine`` the atomic ``save_checkpoint`` and the verifying ``load_checkpoint`` (module docstring)."""
    save: Callable[..., Any] = engine.save_checkpoint
    load: Callable[..., Any] = engine.load_checkpoint

    def save_checkpoint(save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, **kwargs: Any) -> Any:
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        out = save(save_dir, tag=tag, client_state=client_state or {}, save_latest=False, **kwargs)
        distributed = dist.is_initialized()
        if distributed:
            dist.barrier()  # every rank's files are written
        if not distributed or dist.get_rank() == 0:
            write_manifest(Path(save_dir) / tag, int(engine.global_steps))
            if save_latest:
                _write_atomically(Path(save_dir) / LATEST, tag)
        if distributed:
            dist.barrier()  # nobody returns before the checkpoint is complete
        return out

    def load_checkpoint(load_dir: str, tag: Optional[str] = None, *args: Any, fallback: bool = True,
                        **kwargs: Any) -> Any:
        return load(load_dir, resolve_tag(load_dir, tag, fallback), *args, **kwargs)

    load_checkpoint.unverified = load  # for a caller that resolved (verified) the tag itself
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
