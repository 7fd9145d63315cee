"""What ``ds_usp.initialize`` checks before it builds anything: the launcher's environment, this rank's device
(:func:`choose_device`), and that every rank read the same config, model and library versions (one small collective,
the same error on every rank)."""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.comm import disagreements
from ds_usp.config import USPConfigError, ranks_per_node_and_source
from ds_usp.log import log_rank0, log_warning, say_once


def installed_version(package: str) -> Optional[str]:
    """The installed version of ``package`` (its distribution name), None when it is not installed as a package."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    """The installed versions of ds-usp, DeepSpeed and torch, compared across ranks."""
    return {pkg: installed_version(pkg.replace("_", "-")) or "not installed as a package"
            for pkg in ("ds_usp", "deepspeed", "torch")}


# Where launchers say which of this node's ranks a process is, the first one set wins (the order of
# ds_usp.config.LOCAL_SIZE_VARIABLES): deepspeed's and torchrun's LOCAL_RANK, MPI launchers' own, SLURM's last (a
# launcher that srun starts once per node sets LOCAL_RANK for the ranks it starts).
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def launcher_local_rank() -> tuple[Optional[int], str]:
    """This process's rank on its node and the launcher variable that said so (:data:`LOCAL_RANK_VARIABLES`).

    Returns:
        ``(local rank, variable)``, or ``(None, "no launcher variable")`` when no launcher set one.
    """
    for var in LOCAL_RANK_VARIABLES:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value), var
    return None, "no launcher variable"


def _bound_device() -> Optional[torch.device]:
    """The GPU the default process group was bound to (``init_process_group(device_id=...)``, as DeepSpeed's
    ``init_distributed`` does), None when it was not."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if not (isinstance(bound, torch.device) and bound.type == "cuda"):
        return None
    return bound if bound.index is not None else torch.device("cuda", torch.cuda.current_device())


def _world_size() -> int:
    """The world size: the default group's, or the launcher's ``WORLD_SIZE`` before distributed is started."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() else 1


def choose_device() -> torch.device:
    """The device this rank computes and communicates on: the one the user chose, else the launcher's local rank.

    In order: the CPU without CUDA; the only GPU of a process that sees one (one GPU per task: whatever the local
    rank); the GPU the default process group is bound to (``init_process_group(device_id=...)``); the current GPU once
    CUDA is initialized (the user called ``torch.cuda.set_device`` or made CUDA tensors); else the GPU of the local
    rank. A bound or current GPU that is not the launcher's local rank is kept with a warning (once a process) that
    names both and what to call; ``ds_usp.initialize`` asks before it builds any group. The local rank is the
    launcher's (:func:`launcher_local_rank`: ``LOCAL_RANK``, an MPI launcher's, ``SLURM_LOCALID``).

    Returns:
        The device; nothing is set (callers pass it to ``torch.cuda.set_device``).

    Raises:
        RuntimeError: several ranks on this node and no launcher variable that says which one this is (every rank
            would take GPU 0), or a local rank beyond the GPUs this process sees (``CUDA_VISIBLE_DEVICES``).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    bound = _bound_device()
    count = torch.cuda.device_count()
    if count == 1:  # one GPU per task: its index says nothing of the local rank
        return bound if bound is not None else torch.device("cuda", 0)
    local, said_by = launcher_local_rank()
    if bound is not None:
        if local is not None and bound.index != local:
            say_once(("a GPU kept against the local rank", bound.index, local),
                     f"ds_usp: the default process group is bound to {bound} (init_process_group(device_id=...)) but "
                     f"the launcher says local rank {local} ({said_by}); ds-usp keeps {bound}, the GPU NCCL uses for "
                     f"that group. If you did not choose it, bind this rank's own GPU, init_process_group(..., "
                     f"device_id=torch.device('cuda', {local})), or leave device_id out and set no device (ds-usp "
                     f"then takes cuda:{local}): two ranks on one GPU fail in NCCL", log_warning)
        return bound
    if torch.cuda.is_initialized():
        current = torch.cuda.current_device()
        if local is not None and current != local:
            say_once(("a GPU kept against the local rank", current, local),
                     f"ds_usp: this rank's current CUDA device is cuda:{current} but the launcher says local rank "
                     f"{local} ({said_by}); ds-usp keeps cuda:{current}, the device set. If you did not choose it "
                     f"(a CUDA tensor made before torch.cuda.set_device), call torch.cuda.set_device({local}) "
                     f"first: two ranks on one GPU fail in NCCL", log_warning)
        return torch.device("cuda", current)
    if local is None:
        world = _world_size()
        per_node, per_node_from = ranks_per_node_and_source(world)
        if world > 1 and per_node > 1:
            raise RuntimeError(f"ds_usp: this process sees {count} GPUs and {per_node} ranks run on its node "
                               f"({per_node_from}), but no launcher variable says which rank of the node it is "
                               f"(none of {', '.join(LOCAL_RANK_VARIABLES)} is set), so every rank would take GPU 0: "
                               f"start it with deepspeed, torchrun or srun, or call torch.cuda.set_device(<this "
                               f"rank's GPU>) before ds_usp.initialize")
        return torch.device("cuda", 0)
    if local >= count:
        raise RuntimeError(f"ds_usp: {said_by}={local} but this process sees {count} GPUs (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<not set>')}): start at most {count} ranks on "
                           f"this node, let every rank see the node's GPUs, or give each rank one GPU "
                           f"(CUDA_VISIBLE_DEVICES of one device, as srun --gpus-per-task=1 does)")
    return torch.device("cuda", local)


def set_local_rank_for_deepspeed(device: torch.device) -> tuple[int, Optional[str]]:
    """``LOCAL_RANK`` as DeepSpeed reads it (ZeRO-3 reads no other variable, its engine only Open MPI's besides), set
    where no launcher set it: from the launcher's own variable (:func:`launcher_local_rank`: an MPI launcher's, ``SLURM_LOCALID``), else,
    as DeepSpeed's convention has it (local rank = GPU index), the index of this rank's GPU (0 on the CPU).

    Args:
        device: this rank's device (:func:`choose_device`).

    Returns:
        ``(local rank, where it came from)``; the source is None when the launcher had set ``LOCAL_RANK``.
    """
    given = os.environ.get("LOCAL_RANK", "")
    if given.isdigit():
        return int(given), None
    local, said_by = launcher_local_rank()
    if local is None:
        local, said_by = (device.index or 0, f"this rank's GPU, {device}") if device.type == "cuda" else (0, "the CPU")
    os.environ["LOCAL_RANK"] = str(local)
    log_rank0(f"ds_usp: LOCAL_RANK was not set; set from {said_by} (DeepSpeed's engine and ZeRO-3 read it)")
    return local, said_by


def check_same_everywhere(facts: Mapping[str, Any]) -> None:
    """Compare ``facts`` across every rank (one small collective) and raise the same error everywhere if they differ.

    Two ranks that read different configs or run different library versions would otherwise build
    different groups or shapes and deadlock later, far from the cause.

    Args:
        facts: JSON-serializable values that must be equal on every rank (config keys, versions, ...).

    Raises:
        USPConfigError: on every rank, naming each differing fact and which ranks hold which value.
        RuntimeError: this rank's GPU cannot be told (see :func:`choose_device`), before the collective.
    """
    if dist.get_world_size() == 1:
        return
    if dist.get_backend() == "nccl":  # all_gather_object sends through this rank's GPU
        torch.cuda.set_device(choose_device())
    differ = disagreements(facts, None, "check that every rank read the same config")
    if differ:
        raise USPConfigError("the ranks disagree, so they would deadlock or compute different things: "
                             + " | ".join(f"{key}: " + "; ".join(f"ranks {ranks} have {val}"
                                                                 for val, ranks in holders.items())
                                          for key, holders in differ.items())
                             + ". Launch every rank with the same DeepSpeed config file, model and library versions.")


def degrees_left_out(raw: Mapping[str, Any]) -> bool:
    """Whether load_usp_config will choose the degrees (and so read the ranks per node)."""
    block = raw.get("usp", {})
    return raw.get("sequence_parallel") == "usp" and isinstance(block, Mapping) and not (
        {"ulysses_degree", "ring_degree"} & set(block))



_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def check_launcher_environment() -> None:
    """Refuse a program started without a launcher (plain ``python``), which DeepSpeed would answer with an MPI
    discovery error (``No module named 'mpi4py'``) that says nothing about the cause.

    Raises:
        RuntimeError: naming the missing variables and the commands that set them.
    """
    missing = [v for v in _LAUNCHER_ENV if v not in os.environ]
    if missing:
        raise RuntimeError(f"ds_usp.initialize: torch.distributed is not initialized and the launcher's environment "
                           f"is missing ({', '.join(missing)} not set): start the program with the deepspeed launcher, "
                           f"`deepspeed --num_gpus N prog.py ...`, or with `torchrun --nproc_per_node N prog.py ...` "
                           f"(N = 1 for a single process), or call torch.distributed.init_process_group first")


def model_heads(model: Any) -> tuple[Optional[int], Optional[int]]:
    """``(attention heads, key/value heads)`` of an HF model's config (None: not an HF model)."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv
