"""The first step of ``ds_usp.initialize``: what the call asks for, read once into :class:`Settings` (the DeepSpeed
config, the validated ``"sequence_parallel"`` keys, the ZeRO stage), with distributed started and every rank shown
to agree before anything is built."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.comm import watched_call
from ds_usp.config import (USPConfig, USPConfigError, load_usp_config, process_group_timeout, ranks_per_node,
                           read_ds_config)
from ds_usp.cost import StepSettings
from ds_usp.integration.engine.preflight import (check_launcher_environment, check_same_everywhere, choose_device,
                                                 degrees_left_out, model_heads, versions)
from ds_usp.upstream.deepspeed import unlink_shm_buffer
from ds_usp.watchdog import GroupInfo


@dataclass(frozen=True)
class Settings:
    """One ``initialize`` call's settings.

    Attributes:
        raw: the parsed DeepSpeed config.
        usp: the validated sequence-parallel config.
        world: the world size.
        kv_heads: the model's key/value heads (None: not an HF model).
    """

    raw: Mapping[str, Any]
    usp: USPConfig
    world: int
    kv_heads: Optional[int] = None

    @property
    def zero(self) -> Mapping[str, Any]:
        """The ``zero_optimization`` block."""
        return self.raw.get("zero_optimization", {})

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage as written (0 when absent)."""
        return self.zero.get("stage", 0)

    @property
    def sharded(self) -> bool:
        """Sequence parallelism is on over more than one rank."""
        return self.usp.enabled and self.usp.sequence_parallel_size > 1

    @property
    def zero3_sp(self) -> bool:
        """ZeRO-3 under sequence parallelism (the model is partitioned over the sequence x data-parallel group)."""
        return self.sharded and self.zero_stage == 3

    @property
    def timeout(self) -> datetime.timedelta:
        """``usp.timeout_seconds`` for the groups."""
        return datetime.timedelta(seconds=self.usp.timeout_seconds)

    @property
    def step(self) -> StepSettings:
        """The layout and ZeRO settings the engine trains with, as the cost model takes them."""
        offload = (self.zero.get("offload_optimizer") or {}).get("device", "none")
        usp = self.usp
        return StepSettings(usp.ulysses_degree, usp.ring_degree, usp.data_parallel_size, self.zero_stage or 1,
                            offload_optimizer=offload in ("cpu", "nvme"))

    def with_usp(self, usp: USPConfig) -> "Settings":
        """The same settings with another sequence-parallel config (the degrees chosen)."""
        return replace(self, usp=usp)


def config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The DeepSpeed config a ``deepspeed.initialize`` call names: ``config``, ``config_params`` (its older name) or
    ``args.deepspeed_config``.

    Raises:
        ValueError: none of them.
    """
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:
        raise ValueError("no DeepSpeed config: pass config=... or args.deepspeed_config")
    return source


def _start_distributed(raw: Mapping[str, Any]) -> None:
    """Initialize distributed when the caller did not (the default group gets ``usp.timeout_seconds`` too).

    On CUDA, with the launcher's variables set, the default group is bound to the device ds-usp chooses
    (:func:`~ds_usp.integration.engine.preflight.choose_device`: the one the user set, else the launcher's local rank)
    before DeepSpeed wraps it: DeepSpeed's own start binds ``cuda:LOCAL_RANK``, which replaced a device the user had
    set and, with one visible GPU per task and ``LOCAL_RANK`` above 0, named a GPU the process cannot see.
    """
    import deepspeed

    if dist.is_initialized():
        return
    check_launcher_environment()
    timeout = process_group_timeout(raw)
    kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if torch.cuda.is_available() and all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                      "MASTER_PORT")) \
            and int(os.environ["WORLD_SIZE"]) > 1:
        device = choose_device()
        torch.cuda.set_device(device)
        world = int(os.environ["WORLD_SIZE"])  # bound to a GPU: NCCL sets up the world's communicator in this call
        info = GroupInfo(("world",), tuple(range(world)), "default_pg", timeout, wait_blocks=False)
        watched_call("start of the default process group", info, "while being created (init_process_group)",
                     int(os.environ["RANK"]), lambda: dist.init_process_group("nccl", device_id=device, **kwargs))
        # DeepSpeed then wraps this group
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", **kwargs)


def resolve_settings(source: Any, model: Any) -> Settings:
    """Read the config, start distributed, check that every rank agrees, and validate the keys.

    Args:
        source: the DeepSpeed config (a path or a mapping).
        model: the model (its head counts are checked and validated against).

    Returns:
        The settings (degrees left out are still the config's rule; the cost model may choose others later).

    Raises:
        ValueError: an invalid config (named key), ranks that disagree (the same error on every rank), or
            ``zero_quantized_gradients`` with ZeRO-3 and sequence parallelism.
        RuntimeError: started without a launcher.
    """
    try:
        raw, unreadable = read_ds_config(source), None
    except USPConfigError as e:  # raised below on every rank, once all ranks know
        raw, unreadable = {}, e
    _start_distributed(raw)
    world = dist.get_world_size()
    heads, kv_heads = model_heads(model)
    check_same_everywhere({
        "config": str(unreadable) if unreadable else {key: raw.get(key) for key in
                                                      ("sequence_parallel", "sequence_parallel_size", "usp")},
        "model heads": [heads, kv_heads],
        # the automatic degree choice reads the ranks per node: nodes of different sizes would choose differently
        "ranks per node": ranks_per_node(world) if degrees_left_out(raw) else "not used",
        "versions": versions(),
    })
    unlink_shm_buffer()  # every rank is past DeepSpeed's communication set-up (the check was a collective over all)
    if unreadable:
        raise unreadable
    settings = Settings(raw, load_usp_config(raw, world, num_heads=heads, num_kv_heads=kv_heads), world, kv_heads)
    if settings.zero3_sp and settings.zero.get("zero_quantized_gradients", False):
        raise ValueError("zero_optimization.zero_quantized_gradients is not supported with ZeRO-3 and "
                         '"sequence_parallel" (its gradient averaging is not verified); turn one of them off')
    return settings
