"""``ds_usp.initialize``: ``deepspeed.initialize`` with Unified Sequence Parallelism.

It reads the ``"sequence_parallel"`` keys from the same JSON DeepSpeed reads, initializes
distributed if needed, builds the :class:`~ds_usp.topology.USPTopology`, attaches it to a
HuggingFace model that uses ``attn_implementation="usp"``, and hands DeepSpeed the topology's
``mpu``, so that ZeRO-1/2/3 partition and reduce over the sequence x data-parallel ranks while the
batch size and the data sampler count replicas only.

Gradient scaling: DeepSpeed sums gradients over the sequence x data-parallel group and divides by
the data-parallel size (``seq_dp_world_size / sequence_parallel_size``). The SP loss
(:func:`ds_usp.integration.data.sp_cross_entropy`, or ``engine(..., shift_labels=...).loss``) is the
whole sequence's token-weighted mean on every rank, and its gradient on each rank is that rank's
tokens' share, so that sum is exactly the gradient of the mean over replicas of each replica's loss:
the same gradient as single-device training on the same global batch. A per-rank *mean* loss (what a
model computes on its own) would instead weight tokens by the rank they landed on; that is the wrong
scaling users report with Ulysses, and the reason the SP loss exists.

"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import inspect
import json
import os
import sys
import warnings
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.config import (USPConfig, USPConfigError, load_usp_config, process_group_timeout, ranks_per_node,
                           read_ds_config)
from ds_usp.integration.hf import USPContext, attach
from ds_usp.integration.step_choices import MemoryContext, MemorySettings
from ds_usp.integration.memory import apply as apply_memory_features
from ds_usp.integration.hybrid import check_hybrid, is_wrapped_mixer, wrap_linear_layers
from ds_usp.integration.models import check_model, default_positions, model_shape, plan_refusal
from ds_usp.comm import group_device
from ds_usp.cost import Hardware, ModelShape, StepSettings, step_time
from ds_usp.log import log_info, log_rank0
from ds_usp.native import resolve_native_op
from ds_usp.topology import USPTopology


@dataclass(frozen=True)
class USPState:
    """What ``ds_usp.initialize`` built, available as ``engine.usp``.

    Attributes:
        config: the validated sequence-parallel config.
        topo: the topology (``None`` when sequence parallelism is off).
        memory: the memory features applied to the model (``None`` when none is); ``memory.choices`` is what
            the last forward call did (see :class:`ds_usp.integration.step_choices.StepChoices`).
    """

    config: USPConfig
    topo: Optional[USPTopology]
    memory: Optional[MemoryContext] = None

    @property
    def layout(self) -> str:
        """The batch sharding layout, ``usp.layout``."""
        return self.config.layout


_ZERO3_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def _fix_zero3_sequence_parallel_scaling(optimizer: Any, sp_size: int) -> None:
    """Make ZeRO-3's reduce-scatter average over replicas only (see the module docstring).

    Args:
        optimizer: the engine's ZeRO-3 optimizer.
        sp_size: the sequence-parallel size.

    Raises:
        RuntimeError: this DeepSpeed has no such method, so the fix cannot be applied.
    """
    scatter = getattr(optimizer, _ZERO3_SCATTER, None)
    if scatter is None:
        raise RuntimeError(f"ds_usp cannot correct ZeRO-3 gradient scaling with this DeepSpeed version "
                           f"({type(optimizer).__name__} has no {_ZERO3_SCATTER}); use ZeRO-1/2 or the "
                           f"DeepSpeed version ds_usp is tested with")

    def scatter_then_rescale(params: Any, communication_data_type: Any) -> Any:
        parts = scatter(params, communication_data_type)
        for part in parts:
            part.mul_(sp_size)  # it divided by sp * dp; the mean over replicas divides by dp
        return parts

    setattr(optimizer, _ZERO3_SCATTER, scatter_then_rescale)


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


def _versions() -> dict[str, str]:
    found = {}
    for pkg in ("ds_usp", "deepspeed", "torch"):
        try:
            found[pkg] = version(pkg.replace("_", "-"))
        except PackageNotFoundError:
            found[pkg] = "not installed as a package"
    return found


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
    mine = {key: json.dumps(val, sort_keys=True, default=str) for key, val in facts.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    diffs = []
    for key in mine:
        holders: dict[str, list[int]] = {}
        for rank, theirs in enumerate(everyone):
            holders.setdefault(theirs.get(key, "<missing>"), []).append(rank)
        if len(holders) > 1:
            diffs.append(f"{key}: " + "; ".join(f"ranks {ranks} have {val}" for val, ranks in holders.items()))
    if diffs:
        raise USPConfigError("the ranks disagree, so they would deadlock or compute different things: "
                             + " | ".join(diffs) + ". Launch every rank with the same DeepSpeed config file, "
                             "model and library versions.")


def _degrees_left_out(raw: Mapping[str, Any]) -> bool:
    """Whether load_usp_config will choose the degrees (and so read the ranks per node)."""
    block = raw.get("usp", {})
    return raw.get("sequence_parallel") == "usp" and isinstance(block, Mapping) and not (
        {"ulysses_degree", "ring_degree"} & set(block))


def _name_step_on_failure(engine: Any) -> None:
    """Add the rank, the engine method and the training step to any error raised by forward/backward/step."""
    for name in ("forward", "backward", "step"):
        method = getattr(engine, name)

        @functools.wraps(method)
        def wrapped(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            try:
                return _method(*args, **kwargs)
            except Exception as e:
                e.add_note(f"ds_usp: raised on rank {dist.get_rank()} in engine.{_name}() during training step "
                           f"{engine.global_steps + 1}")
                raise

        setattr(engine, name, wrapped)


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _check_launcher_environment() -> None:
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


def _quiet_deepspeed_deprecations() -> None:
    """Hide the FutureWarnings that DeepSpeed's ZeRO code triggers in torch.distributed on every step.

    DeepSpeed 0.19 calls ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which torch 2.13 deprecates with
    a warning per call site and rank; the user cannot act on them and they interleave with progress bars. Only
    these two messages are filtered.
    """
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning)


def _unlink_shm_buffer() -> None:
    """Remove this rank's name of DeepSpeed's CPU shared-memory all-reduce buffer (the mapping stays valid).

    On CPU, DeepSpeed's communication backend creates a 66 MB POSIX shared-memory buffer per rank,
    named after ``MASTER_ADDR``/``MASTER_PORT`` (``deepspeed/ops/csrc/cpu/comm/shm.cpp``), and never
    unlinks it: every run leaves them in ``/dev/shm``, which is memory. Peers open the names only
    while they initialize (``deepspeed.init_distributed``), which every rank has finished once a collective
    over all of them has completed, so each rank can then unlink its own: right after the first check of
    :func:`initialize`, so that a run refused for its config leaves nothing behind either.
    """
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:  # none (a GPU run, another platform, or already gone)
        pass


def _shape_of(model: Any) -> Optional[ModelShape]:
    """The cost model's view of an HF causal LM (None for another model, or one it cannot describe)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return None
    try:
        return model_shape(config, model)
    except Exception:  # noqa: BLE001 - the plan is advice: a model the cost model cannot read just goes without
        return None


NOMINAL_TOKENS_PER_RANK = 16384  # the length "auto" degrees are priced at (the length is not known yet)


def _ask_the_cost_model(cfg: USPConfig, shape: ModelShape, zero: int, per_node: int,
                        max_positions: Optional[int] = None) -> USPConfig:
    """Degrees left out: the paper's rule (Ulysses inside a node) unless the cost model prices another split of the
    sequence-parallel ranks, whose all-to-alls stay inside a node, at least 10% faster; the choice is logged.

    The length is not known yet: it is priced at :data:`NOMINAL_TOKENS_PER_RANK` per rank, or at the model's
    ``max_position_embeddings`` when that is shorter (a model is not trained beyond the length it declares)."""
    sp, dp = cfg.sequence_parallel_size, cfg.data_parallel_size
    hw = Hardware(nodes=max(1, cfg.world_size // per_node), gpus_per_node=per_node)
    seq = NOMINAL_TOKENS_PER_RANK * sp
    if isinstance(max_positions, int) and not isinstance(max_positions, bool) and 2 * sp <= max_positions < seq:
        seq = max_positions

    prices = {u: step_time(shape, StepSettings(u, sp // u, dp, zero), seq, hw).total for u in range(1, sp + 1)
              if sp % u == 0 and per_node % u == 0 and plan_refusal(shape, u, sp // u, seq) is None}
    rule = cfg.ulysses_degree
    best = min(prices, key=prices.get, default=rule)
    pick = best if rule not in prices or prices[best] < 0.9 * prices[rule] else rule
    log_rank0(f"usp degrees: ulysses_degree={pick} x ring_degree={sp // pick} (the cost model at S={seq}: "
              + ", ".join(f"{u}x{sp // u} {t:.3g} s" for u, t in prices.items()) + "; see python -m ds_usp.plan)")
    return replace(cfg, ulysses_degree=pick, ring_degree=sp // pick)


def _model_heads(model: Any) -> tuple[Optional[int], Optional[int]]:
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv


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

    _quiet_deepspeed_deprecations()
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
        _check_launcher_environment()
        timeout = process_group_timeout(raw)
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   **({} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}))
    world = dist.get_world_size()
    heads, kv_heads = _model_heads(model)
    check_same_everywhere({
        "config": str(unreadable) if unreadable else {key: raw.get(key) for key in
                                                      ("sequence_parallel", "sequence_parallel_size", "usp")},
        "model heads": [heads, kv_heads],
        # the automatic degree choice reads the ranks per node: nodes of different sizes would choose differently
        "ranks per node": ranks_per_node(world) if _degrees_left_out(raw) else "not used",
        "versions": _versions(),
    })
    _unlink_shm_buffer()  # every rank is past DeepSpeed's communication set-up (the check was a collective over all)
    if unreadable:
        raise unreadable
    usp_cfg = load_usp_config(raw, world, num_heads=heads, num_kv_heads=kv_heads)
    zero = raw.get("zero_optimization", {})
    auto = usp_cfg.enabled and usp_cfg.sequence_parallel_size > 1 and usp_cfg.degrees_chosen_automatically
    shape = _shape_of(model) if auto else None  # read only when the degrees are the cost model's to choose
    if shape is not None:
        usp_cfg = _ask_the_cost_model(usp_cfg, shape, zero.get("stage", 0) or 1, ranks_per_node(world),
                                      getattr(model.config, "max_position_embeddings", None))
    zero3_sp = usp_cfg.enabled and usp_cfg.sequence_parallel_size > 1 and zero.get("stage", 0) == 3
    if zero3_sp and zero.get("zero_quantized_gradients", False):
        raise ValueError("zero_optimization.zero_quantized_gradients is not supported with ZeRO-3 and "
                         '"sequence_parallel" (its gradient averaging is not verified); turn one of them off')

    topo, memory = None, None
    if usp_cfg.enabled:
        if kwargs.get("mpu") is not None:
            raise ValueError('"sequence_parallel" is set, so ds_usp provides the mpu; do not pass mpu=')
        if model is not None and usp_cfg.sequence_parallel_size > 1:  # the same answer on every rank, before any group
            check_model(model, handled=is_wrapped_mixer)
            check_hybrid(model, usp_cfg.ulysses_degree)
        topo = replace(USPTopology.build(usp_cfg.ulysses_degree, usp_cfg.ring_degree,
                                         timeout=datetime.timedelta(seconds=usp_cfg.timeout_seconds)),
                       default_positions=default_positions(model))
        kwargs["mpu"] = topo.mpu
        if usp_cfg.native_op is not False:  # built (or loaded) now, with a progress line, not inside step 1
            resolve_native_op(usp_cfg.native_op, group_device(topo.sp_group))
        if model is not None:
            attach(model, USPContext(topo=topo, layout=usp_cfg.layout, attn_backend=usp_cfg.attn_backend,
                                     native_op=usp_cfg.native_op, comm_dtype=usp_cfg.comm_dtype))
            wrap_linear_layers(model)
            memory = apply_memory_features(model, MemorySettings(
                chunked_loss=usp_cfg.chunked_loss, tiled_mlp=usp_cfg.tiled_mlp,
                activation_checkpointing=usp_cfg.activation_checkpointing,
                offload_activations=usp_cfg.offload_activations, tile_mib=usp_cfg.tile_mib),
                topo, usp_cfg.layout, zero3=zero.get("stage", 0) == 3)
            if zero3_sp:
                _partition_for_zero3(model, raw, topo)
        if topo.rank == 0:
            log_info(f"sequence_parallel={usp_cfg.mode}: ulysses_degree={usp_cfg.ulysses_degree} x "
                     f"ring_degree={usp_cfg.ring_degree}, data_parallel={usp_cfg.data_parallel_size}, "
                     f"layout={usp_cfg.layout} (world {world}, {ranks_per_node(world)} per node)")
    engine, opt, loader, sched = deepspeed_initialize()(args=args, model=model, optimizer=optimizer,
                                                      model_parameters=model_parameters,
                                                      training_data=training_data, lr_scheduler=lr_scheduler,
                                                      config=config, config_params=config_params,
                                                      dist_init_required=dist_init_required, collate_fn=collate_fn,
                                                      **kwargs)
    if zero3_sp:
        _fix_zero3_sequence_parallel_scaling(engine.optimizer, topo.sp_size)
    dist.barrier()  # deepspeed.initialize set DeepSpeed's communication up if distributed was not ours: past it
    _unlink_shm_buffer()
    engine.usp = USPState(config=usp_cfg, topo=topo, memory=memory)
    _name_step_on_failure(engine)
    return engine, opt, loader, sched


# ------------------------------------------------------------------- the plain deepspeed.initialize path

TRAINER_ROUTE: contextvars.ContextVar[bool] = contextvars.ContextVar("ds_usp_trainer_route", default=False)


def deepspeed_initialize() -> Any:
    """DeepSpeed's own ``deepspeed.initialize`` (the one :func:`install_deepspeed_hook` wraps)."""
    import deepspeed

    fn = deepspeed.initialize
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_ds_usp", False) else fn


def _config_of_call(args: Any, kwargs: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The DeepSpeed config a ``deepspeed.initialize`` call was given (None when it cannot be read here)."""
    source = kwargs.get("config") if kwargs.get("config") is not None else kwargs.get("config_params")
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    try:
        return read_ds_config(source) if source is not None else None
    except USPConfigError:
        return None  # deepspeed.initialize reports its own config errors


def _called_from_accelerate() -> bool:
    return any(frame.frame.f_globals.get("__name__", "").startswith("accelerate.") for frame in inspect.stack()[2:])


def install_deepspeed_hook() -> None:
    """Make ``deepspeed.initialize`` honour ``"sequence_parallel"`` (idempotent; ``import ds_usp`` calls it).

    DeepSpeed ignores the key, so without this a plain ``deepspeed.initialize`` given a USP config would silently
    train plain data parallelism. With it, such a call is :func:`initialize` (same arguments, same engine), except
    under an HF Trainer that is not ``ds_usp.USPTrainer`` (the Trainer would feed every rank whole sequences),
    which is refused before anything is built. Calls without the key, or with a ds-usp ``mpu`` built by the
    caller, reach DeepSpeed unchanged.
    """
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time notices: never on a program's stdout
        import deepspeed

    if getattr(deepspeed.initialize, "_ds_usp", False):
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize_with_usp(args: Any = None, **kwargs: Any) -> Any:
        config = _config_of_call(args, kwargs)
        from ds_usp.topology import USPMpu

        if config is None or config.get("sequence_parallel") is None or isinstance(kwargs.get("mpu"), USPMpu):
            return original(args=args, **kwargs)
        if _called_from_accelerate() and not TRAINER_ROUTE.get():
            raise ValueError('the DeepSpeed config sets "sequence_parallel", but this HF Trainer is not ds-usp\'s: '
                             "it would give every rank whole sequences. Use ds_usp.USPTrainer (or ds_usp.USPSFTTrainer "
                             "for TRL's SFTTrainer) instead of Trainer")
        return initialize(args=args, **kwargs)

    initialize_with_usp._ds_usp = True
    deepspeed.initialize = initialize_with_usp
