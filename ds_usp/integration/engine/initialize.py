"""``ds_usp.initialize``: ``deepspeed.initialize`` with Unified Sequence Parallelism.

It reads the ``"sequence_parallel"`` keys from the same JSON DeepSpeed reads, initializes
distributed if needed, builds the :class:`~ds_usp.topology.USPTopology`, attaches it to a
HuggingFace model that uses ``attn_implementation="usp"``, and hands DeepSpeed the topology's
``mpu``, so that ZeRO-1/2/3 partition and reduce over the sequence x data-parallel ranks while the
batch size and the data sampler count replicas only.

Gradient scaling: DeepSpeed sums gradients over the sequence x data-parallel group and divides by
the data-parallel size (``seq_dp_world_size / sequence_parallel_size``). The SP loss
(:func:`ds_usp.integration.step.loss.sp_cross_entropy`, or ``engine(..., shift_labels=...).loss``) is the
whole sequence's token-weighted mean on every rank, and its gradient on each rank is that rank's
tokens' share, so that sum is exactly the gradient of the mean over replicas of each replica's loss:
the same gradient as single-device training on the same global batch. A per-rank *mean* loss (what a
model computes on its own) would instead weight tokens by the rank they landed on; that is the wrong
scaling users report with Ulysses, and the reason the SP loss exists.

"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.comm import barrier, group_device
from ds_usp.config import USPConfig, ranks_per_node, ranks_per_node_and_source
from ds_usp.integration.engine.adapters import adapter_for
from ds_usp.integration.engine.checkpoints import AtomicCheckpoints
from ds_usp.integration.engine.degrees import choose_degrees
from ds_usp.integration.engine.preflight import choose_device, set_local_rank_for_deepspeed
from ds_usp.integration.engine.settings import Settings, config_source, resolve_settings
from ds_usp.integration.models.checks import default_positions
from ds_usp.integration.models.safety import install_safety_net
from ds_usp.integration.step.choices import MemoryContext
from ds_usp.upstream.deepspeed import (EngineArgs, attach_state, check_zero_optimizers_first, deepspeed_initialize,
                                       fix_zero3_sequence_parallel_scaling, note_failures, quiet_deepspeed_deprecations,
                                       replace_checkpointing, unlink_shm_buffer, zero3_on_device)
from ds_usp.log import log_info
from ds_usp.native import resolve_native_op
from ds_usp.splits import degree_split, divisors
from ds_usp.topology import USPTopology
from ds_usp.watchdog import set_step_source


@dataclass(frozen=True)
class USPState:
    """What ``ds_usp.initialize`` built, available as ``engine.usp``.

    Attributes:
        config: the validated sequence-parallel config.
        topo: the topology (``None`` when sequence parallelism is off).
        memory: the memory features applied to the model (``None`` when none is); ``memory.choices`` is what
            the last forward call did (see :class:`ds_usp.integration.step.choices.StepChoices`).
    """

    config: USPConfig
    topo: Optional[USPTopology]
    memory: Optional[MemoryContext] = None

    @property
    def layout(self) -> str:
        """The batch sharding layout, ``usp.layout``."""
        return self.config.layout


def dynamic_degrees(cfg: USPConfig, kv_heads: Optional[int]) -> dict[int, tuple[int, int]]:
    """``{d: (U_d, R_d)}`` for every proper divisor ``d`` of the SP size (:func:`ds_usp.splits.degree_split`).

    Args:
        cfg: the validated config.
        kv_heads: the model's kv heads (None: unknown).

    Returns:
        The degrees and their splits.
    """
    return {d: degree_split(cfg.ulysses_degree, d, kv_heads) for d in divisors(cfg.sequence_parallel_size)[:-1]}


def _partition_for_zero3(model: Any, ds_config: Mapping[str, Any], topo: USPTopology) -> None:
    """Partition ``model`` for ZeRO-3 over the sequence x data-parallel group (see the module docstring).

    Args:
        model: the model (left alone when its parameters are already ZeRO-3 parameters).
        ds_config: the parsed DeepSpeed config (ZeRO stage 3).
        topo: the topology.
    """
    import deepspeed

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return
    deepspeed.zero.Init(module=model, data_parallel_group=topo.sp_dp_group, config_dict_or_path=dict(ds_config),
                        mpu=topo.mpu)


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, config: Any = None, config_params: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Any = None, **kwargs: Any) -> tuple:
    """Drop-in for ``deepspeed.initialize`` that adds USP when the config asks for it: resolve the settings, choose
    the degrees, check the model by its kind's adapter, build the topology, shard and apply memory features,
    ``deepspeed.initialize``, then wrap the engine.

    Args:
        args: as for ``deepspeed.initialize`` (``args.deepspeed_config`` is read when ``config`` is None).
        model: the model.
        optimizer: optional client optimizer.
        model_parameters: parameters to optimize.
        training_data: optional dataset (DeepSpeed's loader splits it over replicas, not SP ranks).
        lr_scheduler: optional scheduler.
        config: DeepSpeed config, a path or a dict (the same file the user passes to ``deepspeed``).
        config_params: alias of ``config`` (DeepSpeed's older name).
        dist_init_required: as for ``deepspeed.initialize``.
        collate_fn: as for ``deepspeed.initialize``.
        **kwargs: passed on to ``deepspeed.initialize`` (``mpu`` may not be given: USP provides it).

    Returns:
        ``deepspeed.initialize``'s ``(engine, optimizer, training_dataloader, lr_scheduler)``;
        ``engine.usp`` is a :class:`USPState` with the topology.

    Raises:
        ValueError: invalid sequence-parallel config (named key), ranks that disagree on the
            config, the model's head counts or the library versions (the same error on every
            rank), a model its adapter refuses, an ``mpu`` was passed with USP on, or an
            ``args.device_rank`` that is not this rank's GPU.
        RuntimeError: started without a launcher (no ``RANK``, ``WORLD_SIZE``, ... and no process group), or this
            rank's GPU cannot be told (:func:`~ds_usp.integration.engine.preflight.choose_device`).

    When it initializes distributed itself, the default process group gets ``usp.timeout_seconds``
    too; the USP groups always do. Errors raised later by ``engine.forward/backward/step`` carry a
    note with the rank and the training step.
    """
    quiet_deepspeed_deprecations()
    check_zero_optimizers_first()
    settings = resolve_settings(config_source(args, config, config_params), model)
    args = tell_deepspeed_the_device(args)
    adapter = adapter_for(model, settings)
    if settings.sharded and settings.usp.degrees_chosen_automatically:  # the cost model's to choose
        settings = _with_chosen_degrees(settings, adapter, model)
    topo, memory = None, None
    if settings.usp.enabled:
        if kwargs.get("mpu") is not None:
            raise ValueError('"sequence_parallel" is set, so ds_usp provides the mpu; do not pass mpu=')
        adapter.check(settings)  # the same answer on every rank, before any group
        topo = build_topology(settings, model)
        kwargs["mpu"] = topo.mpu
        adapter.shard(settings, topo)
        memory = adapter.apply_memory(settings, topo)
        _finish_model(model, settings, topo)
    engine, opt, loader, sched = deepspeed_initialize()(args=args, model=model, optimizer=optimizer,
                                                      model_parameters=model_parameters,
                                                      training_data=training_data, lr_scheduler=lr_scheduler,
                                                      config=config, config_params=config_params,
                                                      dist_init_required=dist_init_required, collate_fn=collate_fn,
                                                      **kwargs)
    wrap_engine(engine, settings, topo, memory)
    return engine, opt, loader, sched


def tell_deepspeed_the_device(args: Any) -> Any:
    """Set this rank's GPU (:func:`~ds_usp.integration.engine.preflight.choose_device`: kept if the user chose one,
    else the launcher's local rank) before anything is built on it, and make DeepSpeed use the same: its engine
    through ``args.device_rank`` (it would set ``cuda:LOCAL_RANK``), ZeRO-3 through
    :func:`~ds_usp.upstream.deepspeed.zero3_on_device` where the GPU is not ``LOCAL_RANK``'s, and ``LOCAL_RANK`` set
    where no launcher set it (:func:`~ds_usp.integration.engine.preflight.set_local_rank_for_deepspeed`).

    Args:
        args: the caller's ``args`` for ``deepspeed.initialize`` (None or any object).

    Returns:
        The ``args`` to give ``deepspeed.initialize``: the caller's behind an
        :class:`~ds_usp.upstream.deepspeed.EngineArgs` (every attribute the caller's; DeepSpeed's writes reach it),
        or ``args`` itself on the CPU when ``LOCAL_RANK`` was set.

    Raises:
        ValueError: ``args.device_rank`` given and not this rank's GPU.
        RuntimeError: this rank's GPU cannot be told (see ``choose_device``).
    """
    device = choose_device()
    local_rank, set_from = set_local_rank_for_deepspeed(device)
    overrides: dict[str, Any] = {}
    if set_from is not None and hasattr(args, "local_rank"):
        overrides["local_rank"] = local_rank  # the launcher passed none: the parser's default, not a local rank
    if device.type == "cuda":
        own = getattr(args, "device_rank", None)
        if own is not None and own != device.index:
            raise ValueError(f"args.device_rank={own} but this rank's GPU is {device} (ds-usp keeps a device you set, "
                             f"else takes the launcher's local rank): call torch.cuda.set_device({own}) before "
                             f"ds_usp.initialize, or leave device_rank out")
        torch.cuda.set_device(device)
        overrides["device_rank"] = device.index
        if device.index != local_rank:
            zero3_on_device(device.index)
    return EngineArgs(args, overrides) if overrides else args


def _with_chosen_degrees(settings: Settings, adapter: Any, model: Any) -> Settings:
    """The settings with the (Ulysses, ring) degrees the cost model chose for the adapter's shape of the model."""
    shape = adapter.shape()
    if shape is None:
        return settings
    return settings.with_usp(choose_degrees(settings.usp, shape, settings.zero_stage or 1,
                                            ranks_per_node(settings.world),
                                            getattr(model.config, "max_position_embeddings", None)))


def build_topology(settings: Settings, model: Any) -> USPTopology:
    """The groups of the chosen degrees (and of every smaller degree under dynamic SP); the native op built now,
    with a progress line, not inside step 1.

    Args:
        settings: the resolved settings.
        model: the model (its default positions travel on the topology).

    Returns:
        The topology.
    """
    usp = settings.usp
    topo = replace(USPTopology.build(usp.ulysses_degree, usp.ring_degree, timeout=settings.timeout),
                   default_positions=default_positions(model))
    if usp.dynamic_sp:
        topo = topo.with_degrees(dynamic_degrees(usp, settings.kv_heads), timeout=settings.timeout)
    if usp.native_op is not False:
        resolve_native_op(usp.native_op, group_device(topo.sp_group))
    return topo


def _finish_model(model: Any, settings: Settings, topo: USPTopology) -> None:
    """The safety net (a training forward that ran no SP layer is refused), ZeRO-3's partitioning over the sequence
    x data-parallel group, and the layout's log line."""
    usp = settings.usp
    if model is not None:
        install_safety_net(model, usp.sequence_parallel_size)
        if settings.zero3_sp:
            _partition_for_zero3(model, settings.raw, topo)
    if topo.rank == 0:
        per_node, said_by = ranks_per_node_and_source(settings.world)
        log_info(f"sequence_parallel={usp.mode}: ulysses_degree={usp.ulysses_degree} x "
                 f"ring_degree={usp.ring_degree}, data_parallel={usp.data_parallel_size}, "
                 f"layout={usp.layout} (world {settings.world}, {per_node} per node from {said_by}"
                 f"{', degrees chosen automatically' if usp.degrees_chosen_automatically else ''})")


def wrap_engine(engine: Any, settings: Settings, topo: Optional[USPTopology], memory: Optional[MemoryContext]) -> None:
    """What ds-usp adds to DeepSpeed's engine: ZeRO-3's gradient scaling under SP, ``engine.usp``, errors noting the
    rank and step, and checkpoints complete or absent (loads verified first).

    Args:
        engine: DeepSpeed's engine.
        settings: the resolved settings.
        topo: the topology (None when sequence parallelism is off).
        memory: the memory context the adapter applied (None: none).
    """
    if settings.zero3_sp and engine.optimizer is not None and \
            type(engine.optimizer).__name__ != "DeepSpeedZeRoOffload":  # not for an inference engine (no grads)
        fix_zero3_sequence_parallel_scaling(engine.optimizer, topo.sp_size)
    barrier(None, "deepspeed.initialize")  # it set DeepSpeed's communication up if distributed was not ours: past it
    unlink_shm_buffer()
    usp = settings.usp
    attach_state(engine, USPState(config=usp, topo=topo, memory=memory))
    note_failures(engine, dist.get_rank())
    name_steps(engine)
    replace_checkpointing(engine, AtomicCheckpoints(engine, usp.async_save, usp.timeout_seconds))


def _step_of(engine_ref: "weakref.ref[Any]") -> Optional[int]:
    """The training step the engine is in (``global_steps + 1``, as its failure notes say), None once it is gone."""
    engine = engine_ref()
    return None if engine is None else engine.global_steps + 1


def name_steps(engine: Any) -> None:
    """Make a training engine's step the one the collectives' watchdog names (:func:`ds_usp.watchdog.set_step_source`):
    read when an error is named, never per step; held weakly. An engine that does not train (no optimizer, or ZeRO-3's
    inference offload) leaves the source to the one that does.

    Args:
        engine: DeepSpeed's engine.
    """
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or type(optimizer).__name__ == "DeepSpeedZeRoOffload":
        return
    set_step_source(functools.partial(_step_of, weakref.ref(engine)))
