"""Checkpoints of USP training: what a checkpoint holds, whether it can resume here, and conversion.

``engine.save_checkpoint(dir)`` / ``engine.load_checkpoint(dir)`` of a ``ds_usp.initialize`` engine
are DeepSpeed's own. What they mean under USP (DeepSpeed 0.19, checked by tests/test_checkpoint.py):

* ZeRO-1/2/3 partition their state over the sequence x data-parallel group, which is every rank
  in every ``(U, R, dp)`` layout, in global-rank order. A parameter's partition depends only on
  that group's size and the parameter order, not on ``U``, ``R`` or ``dp``. The files are named by
  the rank in that group (``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``; ZeRO-3 also writes
  ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``, ZeRO-1/2 one ``mp_rank_00_model_states.pt``),
  and the model-states file records the group's size as ``dp_world_size``. So a checkpoint loads
  unchanged into any layout with the same number of ranks.
* Another number of ranks: DeepSpeed refuses ZeRO state saved on another ``dp_world_size``. Convert
  the checkpoint to DeepSpeed's universal format (:func:`convert_to_universal`) and load it with
  ``"checkpoint": {"load_universal": true}``.
* Another ZeRO stage: 1 <-> 2 share one format and load; 1/2 <-> 3 do not (DeepSpeed stops with a
  bare ``AssertionError`` while looking for files of the other stage).

:func:`load_checkpoint` is ``engine.load_checkpoint`` with those cases refused up front, with a
message that says what to do, and with a missing checkpoint an error instead of ``(None, None)``.
Nothing here communicates: every rank reads the same small metadata and raises the same error.
"""
from __future__ import annotations

import argparse
import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ds_usp.config import load_usp_config
from ds_usp.integration.engine.checkpoints import read_step, resolve_tag, write_manifest
from ds_usp.log import log_warning


class CheckpointMismatchError(ValueError):
    """A checkpoint cannot resume in this run as it is (the message says why and what to do)."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """What :func:`read_checkpoint` found about one saved checkpoint.

    Attributes:
        directory: the checkpoint's folder (``<load_dir>/<tag>``).
        tag: its tag (e.g. ``global_step20``).
        universal: a universal checkpoint (converted by :func:`convert_to_universal`).
        zero_stage: ``zero_optimization.stage`` it was trained with.
        world_size: ranks its ZeRO state is partitioned over (sequence x data-parallel ranks).
        sequence_parallel_size: ``U * R`` (1 without sequence parallelism).
        ulysses_degree: ``usp.ulysses_degree`` as written in its config (``None``: chosen automatically).
        ring_degree: ``usp.ring_degree`` as written in its config (``None``: chosen automatically).
        global_batch_size: sequences per optimizer step (micro batch x accumulation x replicas).
        global_steps: optimizer steps taken before it was saved.
        ds_config: the DeepSpeed config it was trained with.
    """

    directory: str
    tag: str
    universal: bool
    zero_stage: int
    world_size: int
    sequence_parallel_size: int
    ulysses_degree: Optional[int]
    ring_degree: Optional[int]
    global_batch_size: int
    global_steps: int
    ds_config: Mapping[str, Any] = field(repr=False)

    @property
    def data_parallel_size(self) -> int:
        """Model replicas it was trained with."""
        return max(1, self.world_size // self.sequence_parallel_size)

    def describe(self) -> str:
        """One line for messages, e.g. ``ZeRO-3 on 4 ranks (U=2 R=2 dp=1), global batch 2, step 20``."""
        if self.ulysses_degree is not None and self.ring_degree is not None:
            split = f"U={self.ulysses_degree} R={self.ring_degree} dp={self.data_parallel_size}"
        else:
            split = f"sp={self.sequence_parallel_size} dp={self.data_parallel_size}"
        kind = "universal checkpoint" if self.universal else "checkpoint"
        return (f"{kind} {self.directory}: ZeRO-{self.zero_stage} on {self.world_size} ranks ({split}), "
                f"global batch {self.global_batch_size}, step {self.global_steps}")


def _latest_tag(load_dir: str, universal: bool) -> str:
    name = "latest_universal" if universal else "latest"
    path = os.path.join(load_dir, name)
    if not os.path.isfile(path):
        hint = (" (convert one with `python -m ds_usp.checkpoint to-universal DIR`)" if universal else "")
        raise FileNotFoundError(f"no checkpoint to resume in {load_dir!r}: {name!r} is missing{hint} (nothing was "
                                f"saved there yet, or name the checkpoint's tag explicitly)")
    with open(path) as f:
        return f.read().strip()


def _model_states_file(folder: str) -> str:
    files = sorted(glob.glob(os.path.join(folder, "*model_states.pt")))
    if not files:
        raise FileNotFoundError(f"{folder!r} holds no DeepSpeed model-states file (*model_states.pt)")
    preferred = [f for f in files if os.path.basename(f) in ("mp_rank_00_model_states.pt",
                                                              "zero_pp_rank_0_mp_rank_00_model_states.pt")]
    return (preferred or files)[0]


def read_checkpoint(load_dir: str, tag: Optional[str] = None, universal: bool = False) -> SavedCheckpoint:
    """Read what a DeepSpeed checkpoint was trained with (the metadata only: tensors are memory-mapped, not read).

    Args:
        load_dir: the directory given to ``engine.save_checkpoint``.
        tag: the checkpoint's tag; ``None`` reads ``latest`` (``latest_universal`` when ``universal``).
        universal: read the universal checkpoint made by :func:`convert_to_universal`.

    Returns:
        The :class:`SavedCheckpoint`.

    Raises:
        FileNotFoundError: no such checkpoint.
    """
    import torch

    tag = _latest_tag(load_dir, universal) if tag is None else str(tag)
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no checkpoint folder {folder!r}")
    state = torch.load(_model_states_file(folder), map_location="cpu", weights_only=False, mmap=True)
    cfg = state.get("ds_config") or {}
    cfg = cfg if isinstance(cfg, Mapping) else {}
    world = int(state.get("dp_world_size") or 1)
    sp, u, r = 1, 1, 1
    if cfg.get("sequence_parallel") is not None:  # the degrees as the saved run derived them
        saved_usp = load_usp_config(cfg, world, local_world_size=world)
        sp, u, r = saved_usp.sequence_parallel_size, saved_usp.ulysses_degree, saved_usp.ring_degree
        if saved_usp.degrees_chosen_automatically:  # chosen from head counts and node sizes not saved here
            u = r = None
    steps = int(state.get("global_steps") or 0)
    samples = state.get("global_samples")
    if steps > 0 and samples:
        batch = int(samples) // steps
    elif "train_batch_size" in cfg:
        batch = int(cfg["train_batch_size"])
    else:
        batch = (int(cfg.get("train_micro_batch_size_per_gpu", 1)) * int(cfg.get("gradient_accumulation_steps", 1))
                 * max(1, world // sp))
    zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), Mapping) else {}
    return SavedCheckpoint(directory=folder, tag=tag, universal=universal, zero_stage=int(zero.get("stage", 0)),
                           world_size=world, sequence_parallel_size=sp, ulysses_degree=u, ring_degree=r,
                           global_batch_size=batch, global_steps=steps, ds_config=cfg)


def _convert_hint(saved: SavedCheckpoint) -> str:
    load_dir = os.path.dirname(saved.directory)
    return (f"convert it once (one process): `python -m ds_usp.checkpoint to-universal {load_dir} --tag {saved.tag}`, "
            f'then resume with "checkpoint": {{"load_universal": true}} in the DeepSpeed config')


def check_resume(saved: SavedCheckpoint, *, zero_stage: int, world_size: int, global_batch_size: int) -> list[str]:
    """Whether ``saved`` can resume a run of ``world_size`` ranks under ZeRO-``zero_stage`` (pure; no I/O).

    Any ``(U, R, dp)`` layout of the same number of ranks is fine (ZeRO partitions over all ranks
    in every layout).

    Args:
        saved: from :func:`read_checkpoint`.
        zero_stage: this run's ``zero_optimization.stage``.
        world_size: this run's sequence x data-parallel ranks (every rank with USP).
        global_batch_size: this run's sequences per optimizer step.

    Returns:
        Warnings (changes that load but change what training sees), empty when none.

    Raises:
        CheckpointMismatchError: the checkpoint cannot be loaded into this run as it is; the message
            says what to change or how to convert it.
    """
    stages = {saved.zero_stage, zero_stage}
    if saved.zero_stage != zero_stage and not stages <= {1, 2}:
        raise CheckpointMismatchError(
            f"{saved.describe()} cannot resume under ZeRO-{zero_stage}: ZeRO-{saved.zero_stage} and "
            f"ZeRO-{zero_stage} checkpoints are laid out differently (only ZeRO-1 <-> ZeRO-2 share one); resume "
            f'with "zero_optimization": {{"stage": {saved.zero_stage}}}')
    if zero_stage > 0 and not saved.universal and saved.world_size != world_size:
        raise CheckpointMismatchError(
            f"{saved.describe()} cannot resume on {world_size} ranks as it is: ZeRO-{saved.zero_stage} state is "
            f"partitioned over all {saved.world_size} ranks it was saved on (any U x R x dp layout of "
            f"{saved.world_size} ranks loads it unchanged); to resume on {world_size} ranks, {_convert_hint(saved)}")
    notes = []
    if saved.global_batch_size != global_batch_size:
        notes.append(f"{saved.describe()} resumes with a global batch of {global_batch_size} sequences per step "
                     f"instead of {saved.global_batch_size}: training continues, but not as the saved run would "
                     f"have (keep train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp equal to "
                     f"continue it exactly)")
    return notes


def load_checkpoint(engine: Any, load_dir: str, tag: Optional[str] = None, **kwargs: Any) -> tuple[str, dict]:
    """``engine.load_checkpoint`` that refuses checkpoints it cannot load correctly, before touching the engine.

    Args:
        engine: the engine from ``ds_usp.initialize`` (or ``deepspeed.initialize``).
        load_dir: the directory given to ``engine.save_checkpoint``.
        tag: the checkpoint's tag (``None``: the latest; ``latest_universal`` when the config sets
            ``"checkpoint": {"load_universal": true}``).
        **kwargs: passed on to ``engine.load_checkpoint`` (``load_optimizer_states`` ...); ``fallback=False`` refuses
            a damaged latest checkpoint instead of loading the newest complete one
            (:func:`ds_usp.integration.engine.checkpoints.resolve_tag`).

    Returns:
        ``(load_path, client_state)`` as ``engine.load_checkpoint`` returns them.

    Raises:
        FileNotFoundError: no checkpoint there (DeepSpeed itself would return ``(None, None)``).
        CheckpointMismatchError: see :func:`check_resume`.
    """
    universal = bool(engine.load_universal_checkpoint())
    if not universal:  # a damaged latest is skipped (or refused) before its metadata is read
        tag = resolve_tag(load_dir, tag, kwargs.pop("fallback", True))
    saved = read_checkpoint(load_dir, tag, universal=universal)
    world = int(getattr(engine, "seq_dp_world_size", None) or engine.dp_world_size)
    for note in check_resume(saved, zero_stage=int(engine.zero_optimization_stage()), world_size=world,
                             global_batch_size=int(engine.train_batch_size())):
        if getattr(engine, "global_rank", 0) == 0:
            log_warning(note)
    load = engine.load_checkpoint
    if not universal:  # the tag is verified above: the engine's own check would read every file again
        load = getattr(load, "unverified", load)
    path, client_state = load(load_dir, saved.tag, **kwargs)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed loaded nothing from {saved.directory!r}")
    return path, client_state


def convert_to_universal(load_dir: str, tag: Optional[str] = None, workers: int = 1) -> str:
    """Convert a checkpoint to DeepSpeed's universal format, for resuming on another number of ranks.

    The same as ``python -m deepspeed.checkpoint.ds_to_universal --input_folder DIR/TAG
    --output_folder DIR/TAG_universal --inject_missing_state`` (``--inject_missing_state`` adds the
    ``universal_checkpoint_info`` that Megatron-style trainers save and HuggingFace models lack).
    It writes ``DIR/latest_universal``, and the output's manifest last (a conversion cut short is refused on load,
    :mod:`ds_usp.integration.engine.checkpoints`); a damaged source is refused before converting. Run it in one process, not on
    every rank.

    Args:
        load_dir: the directory given to ``engine.save_checkpoint``.
        tag: the checkpoint's tag (``None``: ``latest``).
        workers: processes that extract and merge the ZeRO shards (1: in this process).

    Returns:
        The universal checkpoint's folder.

    Raises:
        FileNotFoundError: no such checkpoint.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tag = _latest_tag(load_dir, universal=False) if tag is None else str(tag)
    src = os.path.join(load_dir, tag)
    if not os.path.isdir(src):
        raise FileNotFoundError(f"no checkpoint folder {src!r}")
    resolve_tag(load_dir, tag)  # a damaged source is named, not converted
    dst = f"{src}_universal"
    ds_to_universal(argparse.Namespace(input_folder=src, output_folder=dst, num_extract_workers=workers,
                                       num_merge_workers=workers, keep_temp_folder=False, strict=True,
                                       inject_missing_state=True))
    write_manifest(Path(dst), read_step(Path(src)))  # last: a half-written conversion never looks complete
    return dst


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m ds_usp.checkpoint info DIR`` / ``python -m ds_usp.checkpoint to-universal DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m ds_usp.checkpoint", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect a DeepSpeed checkpoint of USP training, or convert it to DeepSpeed's universal format.\n\n"
                    "A checkpoint resumes unchanged on any (U, R, dp) layout of the same number of ranks. To resume\n"
                    "on another number of ranks, convert it once (in one process) with `to-universal`, then load it\n"
                    'with "checkpoint": {"load_universal": true} in the DeepSpeed config.',
        epilog="examples:\n  python -m ds_usp.checkpoint info runs/train_llama/checkpoints\n"
               "  python -m ds_usp.checkpoint to-universal runs/train_llama/checkpoints --tag global_step20")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print what a checkpoint was trained with")
    conv = sub.add_parser("to-universal", help="convert for resuming on another number of ranks")
    for p in (info, conv):
        p.add_argument("load_dir", help="the directory given to engine.save_checkpoint")
        p.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    info.add_argument("--universal", action="store_true", help="read the universal checkpoint ('latest_universal')")
    conv.add_argument("--workers", type=int, default=1, help="processes for extracting/merging shards")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            print(read_checkpoint(args.load_dir, args.tag, universal=args.universal).describe())
        else:
            print(f"universal checkpoint: {convert_to_universal(args.load_dir, args.tag, workers=args.workers)}")
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
