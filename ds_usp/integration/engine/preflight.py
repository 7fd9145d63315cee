"""What ``ds_usp.initialize`` checks before it builds anything: the launcher's environment, and that every rank
read the same config, model and library versions (one small collective, the same error on every rank)."""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.comm import disagreements
from ds_usp.config import USPConfigError


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


def check_same_everywhere(facts: Mapping[str, Any]) -> None:
    """Compare ``facts`` across every rank (one small collective) and raise the same error everywhere if they differ.

    Two ranks that read different configs or run different library versions would otherwise build
    different groups or shapes and deadlock later, far from the cause.

    Args:
        facts: JSON-serializable values that must be equal on every rank (config keys, versions, ...).

    Raises:
        USPConfigError: on every rank, naming each differing fact and which ranks hold which value.
    """
    if dist.get_world_size() == 1:
        return
    if dist.get_backend() == "nccl":  # all_gather_object sends through this rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
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
