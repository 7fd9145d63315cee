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

import datetime
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.attention import AttentionRun
from ds_usp.comm import barrier, group_device
from ds_usp.cost import StepSettings
from ds_usp.config import (USPConfig, USPConfigError, load_usp_config, process_group_timeout, ranks_per_node,
                           ranks_per_node_and_source, read_ds_config)
from ds_usp.integration.engine.checkpoints import AtomicCheckpoints
from ds_usp.integration.engine.degrees import choose_degrees
from ds_usp.integration.engine.preflight import (check_launcher_environment, check_same_everywhere, degrees_left_out,
                                                 model_heads, versions)
from ds_usp.integration.models.attention import USPContext, attach
from ds_usp.integration.models.checks import check_model, default_positions
from ds_usp.integration.models.diffusion import check_diffusion_model, is_diffusers_model, shard_diffusion_model
from ds_usp.integration.models.diffusion.shape import dit_shape
from ds_usp.integration.models.hybrid import check_hybrid, is_wrapped_mixer, wrap_linear_layers
from ds_usp.integration.models.multimodal import refuse_cross_attention
from ds_usp.integration.models.safety import install_safety_net
from ds_usp.integration.models.shape import shape_of
from ds_usp.integration.models.vision import prepare_vision_towers
from ds_usp.integration.step.choices import MemoryContext
from ds_usp.integration.step.dit import apply_dit_memory
from ds_usp.integration.step.forward import apply as apply_memory_features
from ds_usp.upstream.deepspeed import (attach_state, check_zero_optimizers_first, deepspeed_initialize,
                                                   fix_zero3_sequence_parallel_scaling, note_failures,
                                                   quiet_deepspeed_deprecations, replace_checkpointing,
                                                   unlink_shm_buffer)
from ds_usp.log import log_info
from ds_usp.native import resolve_native_op
from ds_usp.splits import degree_split, divisors
from ds_usp.topology import USPTopology


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
    """Drop-in for ``deepspeed.initialize`` that adds USP when the config asks for it.

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
            rank), or an ``mpu`` was passed with USP on.
        RuntimeError: started without a launcher (no ``RANK``, ``WORLD_SIZE``, ... and no process group).

    When it initializes distributed itself, the default process group gets ``usp.timeout_seconds``
    too; the USP groups always do. Errors raised later by ``engine.forward/backward/step`` carry a
    note with the rank and the training step.
    """
    import deepspeed

    quiet_deepspeed_deprecations()
    check_zero_optimizers_first()
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:
        raise ValueError("no DeepSpeed config: pass config=... or args.deepspeed_config")
    try:
        raw, unreadable = read_ds_config(source), None
    except USPConfigError as e:  # raised below on every rank, once all ranks know
        raw, unreadable = {}, e
    if not dist.is_initialized():
        check_launcher_environment()
        timeout = process_group_timeout(raw)
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   **({} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}))
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
    usp_cfg = load_usp_config(raw, world, num_heads=heads, num_kv_heads=kv_heads)
    zero = raw.get("zero_optimization", {})
    auto = usp_cfg.enabled and usp_cfg.sequence_parallel_size > 1 and usp_cfg.degrees_chosen_automatically
    # a diffusion transformer: its family's plan shards it (models/diffusion), or it is refused by name
    diffusion = is_diffusers_model(model) and usp_cfg.enabled and usp_cfg.sequence_parallel_size > 1
    shape = None
    if auto:  # read only when the degrees are the cost model's to choose
        shape = dit_shape(model, check_diffusion_model(model)) if diffusion else shape_of(model)
    if shape is not None:
        usp_cfg = choose_degrees(usp_cfg, shape, zero.get("stage", 0) or 1, ranks_per_node(world),
                                      getattr(model.config, "max_position_embeddings", None))
    zero3_sp = usp_cfg.enabled and usp_cfg.sequence_parallel_size > 1 and zero.get("stage", 0) == 3
    if zero3_sp and zero.get("zero_quantized_gradients", False):
        raise ValueError("zero_optimization.zero_quantized_gradients is not supported with ZeRO-3 and "
                         '"sequence_parallel" (its gradient averaging is not verified); turn one of them off')

    topo, memory = None, None
    if usp_cfg.enabled:
        if kwargs.get("mpu") is not None:
            raise ValueError('"sequence_parallel" is set, so ds_usp provides the mpu; do not pass mpu=')
        if model is not None and diffusion:  # refused by name, or sharded by its family's plan
            check_diffusion_model(model)
            if usp_cfg.dynamic_sp:
                raise ValueError("usp.dynamic_sp is for packed documents of language models; a diffusion transformer's "
                                 "sample is one sequence: set it to false")
        elif model is not None and usp_cfg.sequence_parallel_size > 1:  # the same answer on every rank, before any group
            refuse_cross_attention(model)
            prepare_vision_towers(model, usp_cfg.vision_tower)
            check_model(model, handled=is_wrapped_mixer)
            check_hybrid(model, usp_cfg.ulysses_degree)
        topo = replace(USPTopology.build(usp_cfg.ulysses_degree, usp_cfg.ring_degree,
                                         timeout=datetime.timedelta(seconds=usp_cfg.timeout_seconds)),
                       default_positions=default_positions(model))
        if usp_cfg.dynamic_sp:
            topo = topo.with_degrees(dynamic_degrees(usp_cfg, kv_heads),
                                     timeout=datetime.timedelta(seconds=usp_cfg.timeout_seconds))
        kwargs["mpu"] = topo.mpu
        if usp_cfg.native_op is not False:  # built (or loaded) now, with a progress line, not inside step 1
            resolve_native_op(usp_cfg.native_op, group_device(topo.sp_group))
        settings = usp_cfg.settings  # the memory keys ("auto": the fastest features that fit usp.memory_gib)
        offload_device = (zero.get("offload_optimizer") or {}).get("device", "none")
        step = StepSettings(usp_cfg.ulysses_degree, usp_cfg.ring_degree, usp_cfg.data_parallel_size,
                            zero.get("stage", 0) or 1, offload_optimizer=offload_device in ("cpu", "nvme"))
        if model is not None and diffusion:
            dit = shard_diffusion_model(model, topo, AttentionRun("contiguous", usp_cfg.attn_backend,
                                                                  usp_cfg.native_op, usp_cfg.comm_dtype))
            memory = apply_dit_memory(model, check_diffusion_model(model), dit, settings, topo,
                                      zero3=zero.get("stage", 0) == 3)
        elif model is not None:
            attach(model, USPContext(topo=topo, layout=usp_cfg.layout, attn_backend=usp_cfg.attn_backend,
                                     native_op=usp_cfg.native_op, comm_dtype=usp_cfg.comm_dtype))
            wrap_linear_layers(model)
            memory = apply_memory_features(model, settings, topo, usp_cfg.layout, zero3=zero.get("stage", 0) == 3,
                                           step=step)
        if model is not None:
            install_safety_net(model, usp_cfg.sequence_parallel_size)  # no SP layer in a training forward: refused
            if zero3_sp:
                _partition_for_zero3(model, raw, topo)
        if topo.rank == 0:
            per_node, said_by = ranks_per_node_and_source(world)
            log_info(f"sequence_parallel={usp_cfg.mode}: ulysses_degree={usp_cfg.ulysses_degree} x "
                     f"ring_degree={usp_cfg.ring_degree}, data_parallel={usp_cfg.data_parallel_size}, "
                     f"layout={usp_cfg.layout} (world {world}, {per_node} per node from {said_by}"
                     f"{', degrees chosen automatically' if usp_cfg.degrees_chosen_automatically else ''})")
    engine, opt, loader, sched = deepspeed_initialize()(args=args, model=model, optimizer=optimizer,
                                                      model_parameters=model_parameters,
                                                      training_data=training_data, lr_scheduler=lr_scheduler,
                                                      config=config, config_params=config_params,
                                                      dist_init_required=dist_init_required, collate_fn=collate_fn,
                                                      **kwargs)
    if zero3_sp and engine.optimizer is not None and type(engine.optimizer).__name__ != "DeepSpeedZeRoOffload":
        fix_zero3_sequence_parallel_scaling(engine.optimizer, topo.sp_size)  # not for an inference engine (no grads)
    barrier(None, "deepspeed.initialize")  # it set DeepSpeed's communication up if distributed was not ours: past it
    unlink_shm_buffer()
    attach_state(engine, USPState(config=usp_cfg, topo=topo, memory=memory))
    note_failures(engine, dist.get_rank())
    # checkpoints complete or absent, loads verified first (ds_usp.integration.engine.checkpoints)
    replace_checkpointing(engine, AtomicCheckpoints(engine, usp_cfg.async_save, usp_cfg.timeout_seconds))
    return engine, opt, loader, sched
