"""ds-usp's changes to DeepSpeed: ``deepspeed.initialize`` honouring ``"sequence_parallel"``, ZeRO-3's gradient
scaling under sequence parallelism, its CPU shared-memory buffer's name, its deprecation warnings, and the engine
``ds_usp.initialize`` returns (``engine.usp``, errors noting the rank and step, checkpoints complete or absent, the
asynchronous save's per-rank state without DeepSpeed's collectives, ZeRO-3's start-of-forward hook paused while a
rollout generates with the parameters gathered)."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.upstream.registry import (Patch, innermost, lacking_parameters, refuse, register,
                                                  require_parameters)
from ds_usp.topology import USPMpu

register("deepspeed_initialize", Patch(
    "deepspeed.initialize (wrapped once, by the gate _ds_usp_auto installs when deepspeed is imported)",
    "its keyword parameters (args, model, ..., mpu, config, config_params) and accelerate's "
    "Accelerator._prepare_deepspeed reading deepspeed.initialize when it runs",
    "DeepSpeed ignores the \"sequence_parallel\" key: a plain deepspeed.initialize (or the HF Trainer through "
    "accelerate) given a USP config would silently train plain data parallelism, or fail in DeepSpeed's batch-size "
    "assertion",
    "a DeepSpeed extension point for config keys it does not know (or DeepSpeed refusing unknown top-level keys)"))


register("zero3_sp_scaling", Patch(
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads",
    "the name-mangled method with parameters (params_to_reduce, communication_data_type), returning the "
    "averaged gradient partitions, and not already dividing by sequence_parallel_size",
    "under ZeRO-3 with sequence parallelism its reduce-scatter divides the gradients by sp x dp instead of dp: "
    "the gradients are sp times too small",
    "divide by _gradient_averaging_world_size(...) / self.sequence_parallel_size there, as "
    "__avg_scatter_contiguous_grads already does (docs/upstream/zero3_sequence_parallel_scaling.patch)"))


register("shm_buffer_name", Patch(
    "DeepSpeed's CPU shared-memory all-reduce buffer (deepspeed/ops/csrc/cpu/comm/shm.cpp)",
    "its POSIX name deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (SHM_BUFFER_NAME)",
    "DeepSpeed never unlinks the 66 MB buffer per rank: every CPU run leaves them in /dev/shm, which is memory",
    "shm.cpp unlinking the name once every rank has opened it"))


register("engine_state", Patch(
    "DeepSpeedEngine.usp (an attribute of the engine ds_usp.initialize returns)",
    "the engine having no attribute of its own named usp",
    "ds_usp.initialize returns DeepSpeed's own engine, so what it built (the config, the topology, the memory "
    "features) travels on it: the trainers, the dynamic-SP step and users read engine.usp",
    "DeepSpeed keeping an extension's state on the engine (a mapping of extensions), or initialize returning it"))


register("engine_failure_notes", Patch(
    "DeepSpeedEngine.forward / backward / step (the instance's, wrapped)",
    "the three being methods of the engine, and global_steps counting the finished steps",
    "an error raised inside one rank's step (a collective that timed out, an out-of-memory) names neither the rank "
    "nor the step, and every rank logs its own",
    "DeepSpeed adding the rank and the training step to errors raised in its engine (an exception note)"))


register("atomic_checkpoints", Patch(
    "DeepSpeedEngine.save_checkpoint / load_checkpoint (the instance's, replaced) and a new wait_for_checkpoint",
    "save_checkpoint taking (save_dir, tag, client_state, save_latest) and moving latest only when save_latest, "
    "load_checkpoint taking (load_dir, tag), and no wait_for_checkpoint of DeepSpeed's own",
    "DeepSpeed moves latest as soon as its own files are written, with no record of what a complete checkpoint "
    "holds: a crash during a save, or a damaged file, is found only when a load fails (or loads garbage)",
    "DeepSpeed writing a manifest last and moving latest after it, and verifying the files before it loads"))


register("async_save_state", Patch(
    "DeepSpeedEngine's private per-rank checkpoint builders (_create_checkpoint_file, _save_checkpoint, "
    "_create_zero_checkpoint_files, _save_zero_checkpoint, _optimizer_has_ckpt_event_prologue, called), its "
    "checkpoint_engine (swapped while a save builds its state) and module_state_dict (the instance's, while they run)",
    "the builders taking (save_dir, tag, zero_checkpoint), (save_dir, tag, client_state, exclude_frozen_parameters), "
    "(save_dir, tag), (save_path, tag) and () and writing through checkpoint_engine.save(state_dict, path), "
    "module_state_dict taking keep_vars; where a builder is missing or takes other parameters, DeepSpeed's whole "
    "save_checkpoint runs instead (the same files, a longer pause)",
    "an asynchronous save must pause the step only while each rank copies its state: DeepSpeed's save_checkpoint "
    "adds two barriers, a tag check (two all-reduces) and, under ZeRO-3, a re-partitioning and re-gathering of "
    "every persistent parameter around its builders",
    "a DeepSpeed save that snapshots each rank's state on the training thread and leaves the collectives and the "
    "writes to its decoupled checkpoint engine"))


register("deepspeed_config_batch", Patch(
    "deepspeed.runtime.config.DeepSpeedConfig.__init__ (wrapped once, by the gate _ds_usp_auto installs when "
    "deepspeed.runtime.config is imported; ds-usp's part runs when the config sets \"sequence_parallel\")",
    "its parameters (config, mpu, ...), and its batch check train_batch_size == micro x accumulation x world, the "
    "world being the mpu's data-parallel size, or the ranks over sequence_parallel_size without one (zero.Init)",
    "a framework that fills the batch size itself from WORLD_SIZE before the Trainer exists (axolotl's "
    "train_batch_size: \"auto\") counts every rank, and DeepSpeed's assertion fires while the model loads, in a message "
    "that never mentions sequence parallelism",
    "DeepSpeed counting the batch over the data-parallel replicas wherever it reads sequence_parallel_size"))


def count_batch_over_replicas(original: Callable[..., Any], config_object: Any, config: Any, args: tuple,
                              kwargs: Mapping[str, Any]) -> Any:
    """``DeepSpeedConfig(config, ...)`` for a config that sets ``"sequence_parallel"`` (the gate found the key): a
    ``train_batch_size`` counted over every rank (``world x micro x accumulation``) is counted over the replicas, and
    ``sequence_parallel_size`` is written where the key left it to ds-usp, so that ``zero.Init`` (no ``mpu``) counts
    the same replicas as the engine. The caller's config is not changed (DeepSpeed reads a copy).

    Args:
        original: DeepSpeed's ``DeepSpeedConfig.__init__``.
        config_object: the config being built.
        config: its config (a path or a mapping).
        args: the call's other positional arguments (``mpu``, ``mesh_device``).
        kwargs: its keyword arguments.

    Returns:
        What DeepSpeed's ``__init__`` returns.

    Raises:
        UpstreamChanged: ``DeepSpeedConfig.__init__`` takes other parameters.
    """
    from ds_usp.config import load_usp_config, read_ds_config

    require_parameters("deepspeed_config_batch", innermost(original), ("config", "mpu"))
    mpu = kwargs.get("mpu", args[0] if args else None)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        parsed = dict(read_ds_config(config))
        sp = (mpu.get_sequence_parallel_world_size() if isinstance(mpu, USPMpu) else
              load_usp_config(parsed, world).sequence_parallel_size)
    except ValueError:  # USPConfigError is one: ds_usp.initialize names what is wrong
        return original(config_object, config, *args, **kwargs)
    micro, steps, batch = (parsed.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                   "train_batch_size"))
    if sp > 1 and all(isinstance(v, int) and not isinstance(v, bool) for v in (micro, steps, batch)) \
            and batch == world * micro * steps:
        parsed["train_batch_size"] = world // sp * micro * steps
    if sp > 1 and mpu is None:
        parsed["sequence_parallel_size"] = sp
        _deepspeed_sees_the_world()
    return original(config_object, parsed, *args, **kwargs)


def _deepspeed_sees_the_world() -> None:
    """DeepSpeed's communication set up over torch's process group when only torch's is (accelerate's CPU state, as
    under ``use_cpu``): without it DeepSpeed's config counts one rank (its world size falls back to 1 when its
    communication is not up), and zero.Init's batch check refuses a batch of several replicas."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if dist.is_available() and dist.is_initialized() and not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())


TRAINER_ROUTE: contextvars.ContextVar[bool] = contextvars.ContextVar("ds_usp_trainer_route", default=False)


def deepspeed_initialize() -> Any:
    """DeepSpeed's own ``deepspeed.initialize`` (the one the gate of ``_ds_usp_auto`` wraps)."""
    import deepspeed

    fn = deepspeed.initialize
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_ds_usp", False) else fn


def _called_from_accelerate() -> bool:
    """Whether accelerate (an HF Trainer) is the caller: the only way to tell that the installed hook has."""
    return any(frame.frame.f_globals.get("__name__", "").startswith("accelerate.") for frame in inspect.stack()[2:])


_PARAMETERS = ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "mpu", "config",
               "config_params", "dist_init_required", "collate_fn")


def route_initialize(original: Callable[..., Any], call: Mapping[str, Any], initialize: Callable[..., Any]) -> Any:
    """A ``deepspeed.initialize`` call whose config sets ``"sequence_parallel"`` (the gate found the key):
    ``initialize`` (:func:`ds_usp.initialize`, same arguments, same engine), or refused before anything is built.

    A call that carries a ds-usp ``mpu`` (a topology the caller built with ``USPTopology.build``) reaches DeepSpeed
    unchanged.

    Args:
        original: DeepSpeed's ``deepspeed.initialize``.
        call: the call's arguments by name.
        initialize: :func:`ds_usp.initialize`.

    Returns:
        What ``initialize`` (or DeepSpeed) returns.

    Raises:
        ValueError: another ``mpu`` (accelerate's ``parallelism_config`` setting up DeepSpeed's own Ulysses, or the
            caller's), or an HF Trainer / accelerate loop that is not ds-usp's (it would feed every rank whole
            sequences).
        UpstreamChanged: ``deepspeed.initialize`` lost a parameter the route relies on.
    """
    require_parameters("deepspeed_initialize", original, _PARAMETERS)
    mpu = call.get("mpu")
    if isinstance(mpu, USPMpu):
        return original(**call)
    if mpu is not None:
        alst = type(mpu).__module__.startswith("deepspeed.runtime.sequence_parallel")
        raise ValueError('the DeepSpeed config sets "sequence_parallel" (ds-usp) and the call brings an mpu of '
                         + ("DeepSpeed's own Ulysses (ALST), which accelerate's parallelism_config (sp_backend "
                            "deepspeed) set up: one sequence parallelism at a time. The HF Trainer and TRL's trainers "
                            "take the parallelism config's sp_size for ds-usp by themselves; in an accelerate loop of "
                            "your own, remove parallelism_config's sp settings to use ds-usp, or remove "
                            '"sequence_parallel" from the DeepSpeed config to use ALST' if alst else
                            f"its own ({type(mpu).__name__}): ds-usp provides the mpu; do not pass mpu="))
    if _called_from_accelerate() and not TRAINER_ROUTE.get():
        raise ValueError('the DeepSpeed config sets "sequence_parallel", but accelerate is creating this engine '
                         "outside a ds-usp trainer (an accelerate loop of your own, or a Trainer subclass whose "
                         "create_accelerator_and_postprocess does not call the Trainer's): it would give every rank "
                         "whole sequences. Use ds_usp.USPTrainer (or ds_usp.USPSFTTrainer for TRL's SFTTrainer), or "
                         "ds_usp.initialize with ds_usp.shard_batch in a loop of your own")
    return initialize(**call)


class EngineArgs:
    """The ``args`` of a ``deepspeed.initialize`` call as DeepSpeed's engine reads them, with values of ds-usp's in
    front: ``device_rank`` (the GPU ``DeepSpeedEngine._set_distributed_vars`` sets, instead of ``LOCAL_RANK``'s) and,
    where ds-usp set ``LOCAL_RANK`` itself, ``local_rank`` (which the engine checks against it and then overwrites).

    Every other attribute is the caller's object's (``None`` has none), and whatever DeepSpeed writes (``local_rank``,
    ``deepspeed_config``) is written to the caller's object, as without ds-usp.

    Args:
        args: the caller's ``args`` (an ``argparse.Namespace``, any object, or None).
        overrides: the attributes ds-usp gives, by name.
    """

    def __init__(self, args: Any, overrides: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name: str) -> Any:  # only for names the instance lacks: all but the two above
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_args"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._overrides:
            self._overrides[name] = value
        if self._args is not None:
            setattr(self._args, name, value)

    def __repr__(self) -> str:
        return f"EngineArgs({self._args!r}, {self._overrides!r})"


register("zero3_local_device", Patch(
    "deepspeed.runtime.zero.partition_parameters.Init.__init__, and deepspeed.runtime.zero.utils' get_lst_from_rank0 "
    "and assert_lst_len_same_as_other_ranks (wrapped, only in a process whose GPU is not cuda:LOCAL_RANK)",
    "each reading its GPU as os.environ[\"LOCAL_RANK\"] (Init's local_device, which it also makes the current device; "
    "the tensor each check broadcasts over the ranks), and the two functions taking (lst)",
    "with one GPU per task (LOCAL_RANK 3, only cuda:0 visible) ZeRO-3 fails with 'invalid device ordinal'; with a GPU "
    "the user set that is not LOCAL_RANK's, ZeRO-3 moves the rank to LOCAL_RANK's GPU (another rank's) and gathers "
    "the parameters there, while the engine computes on the one set",
    "ZeRO-3 taking the engine's device (args.device_rank) or the current device, not LOCAL_RANK, as its GPU"))

_READS_LOCAL_RANK = ('os.environ["LOCAL_RANK"]', "os.environ['LOCAL_RANK']")


def _reading_local_rank_as(fn: Callable[..., Any], index: int) -> Callable[..., Any]:
    """``fn`` run with ``LOCAL_RANK`` reading ``index`` (put back as it was after each call)."""

    @functools.wraps(fn)
    def on_this_gpu(*args: Any, **kwargs: Any) -> Any:
        saved = os.environ.get("LOCAL_RANK")
        os.environ["LOCAL_RANK"] = str(index)
        try:
            return fn(*args, **kwargs)
        finally:
            if saved is None:
                os.environ.pop("LOCAL_RANK", None)
            else:
                os.environ["LOCAL_RANK"] = saved

    on_this_gpu._ds_usp_original = fn
    return on_this_gpu


def zero3_on_device(index: int) -> None:
    """Make ZeRO-3's reads of ``LOCAL_RANK`` as its GPU (``zero.Init``'s device, its checks across ranks) read
    ``cuda:index``, this rank's GPU, for the rest of the process. ``LOCAL_RANK`` stays the local rank for everything
    else (the engine's ``local_rank``, node-local checkpoints). Called again, the wrapping is replaced, not stacked.

    Args:
        index: the CUDA index of this rank's GPU.

    Raises:
        UpstreamChanged: one of the three no longer reads ``os.environ["LOCAL_RANK"]``, or a check takes no ``lst``.
    """
    from deepspeed.runtime.zero import partition_parameters, utils

    places = ((partition_parameters.Init, "__init__"), (utils, "get_lst_from_rank0"),
              (utils, "assert_lst_len_same_as_other_ranks"))
    for owner, name in places:
        current = getattr(owner, name, None)
        original = getattr(current, "_ds_usp_original", current)
        if name != "__init__":
            require_parameters("zero3_local_device", original, ("lst",))
        source = inspect.getsource(innermost(original)) if callable(original) else ""
        if not any(read in source for read in _READS_LOCAL_RANK):
            refuse("zero3_local_device", f"{getattr(owner, '__name__', owner)}.{name} does not read "
                                         f"os.environ[\"LOCAL_RANK\"]")
    for owner, name in places:
        current = getattr(owner, name)
        setattr(owner, name, _reading_local_rank_as(getattr(current, "_ds_usp_original", current), index))


def quiet_deepspeed_deprecations() -> None:
    """Hide the FutureWarnings that DeepSpeed's ZeRO code triggers in torch.distributed on every step.

    DeepSpeed 0.19 calls ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which torch 2.13 deprecates with
    a warning per call site and rank; the user cannot act on them and they interleave with progress bars. Only
    these two messages are filtered (a filter, not a patch: nothing is changed if they stop being raised).
    """
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated",
                                category=FutureWarning)




register("zero_optimizer_check", Patch(
    "deepspeed.runtime.engine.is_zero_supported_optimizer (the name DeepSpeedEngine's optimizer check calls, wrapped "
    "once)",
    "deepspeed.runtime.zero.utils.is_zero_supported_optimizer(optimizer) answering type(optimizer) in its list "
    "ZERO_SUPPORTED_OPTIMIZERS after importing DeepSpeed's Muon optimizer (which it then adds to the list)",
    "importing the Muon module compiles its kernels with torch.compile: every ZeRO engine's start imported torch's "
    "inductor to check an optimizer the list holds without it (6 s of CPU a rank on a 2-core machine, in each "
    "launched rank)",
    "is_zero_supported_optimizer looking in its list before importing Muon"))


def check_zero_optimizers_first() -> None:
    """Make DeepSpeed's check that ZeRO supports the optimizer look in its list before importing Muon (the same
    answers; Muon is still imported for an optimizer the list does not hold). Idempotent.

    Raises:
        UpstreamChanged: the engine's check is not the one in ``deepspeed.runtime.zero.utils``, or that module has no
            list ``ZERO_SUPPORTED_OPTIMIZERS``.
    """
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import utils

    current = getattr(engine_module, "is_zero_supported_optimizer", None)
    if getattr(current, "_ds_usp_listed_first", False):
        return
    listed = getattr(utils, "ZERO_SUPPORTED_OPTIMIZERS", None)
    if current is None or current is not getattr(utils, "is_zero_supported_optimizer", None) \
            or not isinstance(listed, list) or lacking_parameters(current, ("optimizer",)):
        refuse("zero_optimizer_check", "deepspeed.runtime.engine's is_zero_supported_optimizer is not "
                                       "deepspeed.runtime.zero.utils' taking (optimizer), or that module has no list "
                                       "ZERO_SUPPORTED_OPTIMIZERS")

    @functools.wraps(current)
    def listed_first(optimizer: Any) -> bool:
        return type(optimizer) in listed or current(optimizer)

    listed_first._ds_usp_listed_first = True
    engine_module.is_zero_supported_optimizer = listed_first


_ZERO3_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def fix_zero3_sequence_parallel_scaling(optimizer: Any, sp_size: int) -> None:
    """Make ZeRO-3's reduce-scatter average over replicas only (``__avg_scatter_grads`` divides by ``sp * dp``).

    Args:
        optimizer: the engine's ZeRO-3 optimizer.
        sp_size: the sequence-parallel size.

    Raises:
        UpstreamChanged: the method is gone or takes other parameters. Nothing is patched when its source already
            divides by ``sequence_parallel_size`` (the upstream fix).
    """
    scatter = getattr(optimizer, _ZERO3_SCATTER, None)
    require_parameters("zero3_sp_scaling", scatter, ("params_to_reduce", "communication_data_type"))
    if "sequence_parallel_size" in inspect.getsource(innermost(scatter)):
        return  # fixed upstream: correcting again would multiply the gradients by sp

    def scatter_then_rescale(params: Any, communication_data_type: Any) -> Any:
        parts = scatter(params, communication_data_type)
        for part in parts:
            part.mul_(sp_size)  # it divided by sp * dp; the mean over replicas divides by dp
        return parts

    setattr(optimizer, _ZERO3_SCATTER, scatter_then_rescale)




def _shm_buffer_prefix() -> Optional[str]:
    """``SHM_BUFFER_NAME`` as the installed DeepSpeed's shm.cpp defines it (None when the source is not shipped)."""
    import deepspeed

    source = os.path.join(os.path.dirname(deepspeed.__file__), "ops", "csrc", "cpu", "comm", "shm.cpp")
    try:
        with open(source) as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("#define SHM_BUFFER_NAME"):
            return line.split('"')[1] if '"' in line else None
    return None


def unlink_shm_buffer() -> None:
    """Remove this rank's name of DeepSpeed's CPU shared-memory all-reduce buffer (the mapping stays valid).

    Peers open the names only while they initialize (``deepspeed.init_distributed``), which every rank has finished
    once a collective over all of them has completed, so each rank can then unlink its own. A cleanup, not a
    correction: when the installed DeepSpeed names the buffer otherwise (or does not ship shm.cpp), nothing is removed.
    """
    prefix = _shm_buffer_prefix()
    if prefix != "deepspeed_allreduce_buffer":
        return  # another naming: ds-usp would guess the name, so it leaves the buffer alone
    name = f"{prefix}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_" \
           f"{dist.get_rank()}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:  # none (a GPU run, another platform, or already gone)
        pass


def attach_state(engine: Any, state: Any) -> None:
    """``engine.usp = state``: what ``ds_usp.initialize`` built, on the engine it returns.

    Raises:
        UpstreamChanged: the engine has a ``usp`` of DeepSpeed's own.
    """
    if hasattr(type(engine), "usp"):
        refuse("engine_state", f"{type(engine).__name__} has an attribute usp of its own")
    engine.usp = state


def note_failures(engine: Any, rank: int) -> None:
    """Add the rank, the engine method and the training step to any error raised by ``engine.forward``,
    ``engine.backward`` or ``engine.step``.

    Args:
        engine: the engine.
        rank: this process's global rank.

    Raises:
        UpstreamChanged: one of them is not a method of the engine, or it keeps no ``global_steps``.
    """
    if not isinstance(getattr(engine, "global_steps", None), int):
        refuse("engine_failure_notes", f"{type(engine).__name__} keeps no global_steps")
    for name in ("forward", "backward", "step"):
        method = getattr(engine, name, None)
        if not callable(method):
            refuse("engine_failure_notes", f"{type(engine).__name__} has no method {name}")

        @functools.wraps(method)
        def noted(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            try:
                return _method(*args, **kwargs)
            except Exception as e:
                e.add_note(f"ds_usp: raised on rank {rank} in engine.{_name}() during training step "
                           f"{engine.global_steps + 1}")
                raise

        setattr(engine, name, noted)


def replace_checkpointing(engine: Any, checkpoints: Any) -> None:
    """Make ``engine.save_checkpoint``, ``engine.load_checkpoint`` and ``engine.wait_for_checkpoint`` those of
    ``checkpoints`` (:class:`ds_usp.integration.engine.checkpoints.AtomicCheckpoints`, which holds DeepSpeed's own).

    Raises:
        UpstreamChanged: DeepSpeed's methods take other parameters, or the engine has a ``wait_for_checkpoint``.
    """
    require_parameters("atomic_checkpoints", getattr(engine, "save_checkpoint", None),
                       ("save_dir", "tag", "client_state", "save_latest"))
    require_parameters("atomic_checkpoints", getattr(engine, "load_checkpoint", None), ("load_dir", "tag"))
    if hasattr(type(engine), "wait_for_checkpoint"):
        refuse("atomic_checkpoints", f"{type(engine).__name__} has a wait_for_checkpoint of its own")
    engine.save_checkpoint = checkpoints.save_checkpoint
    engine.load_checkpoint = checkpoints.load_checkpoint
    engine.wait_for_checkpoint = checkpoints.wait_for_checkpoint


@contextlib.contextmanager
def checkpoint_engine_as(engine: Any, make: Callable[[Any], Any]) -> Iterator[Any]:
    """While the block runs, the engine's saves write through ``make(its checkpoint engine)`` instead.

    Yields:
        The checkpoint engine ``make`` returned.

    Raises:
        UpstreamChanged: the engine has no checkpoint engine with ``save(state_dict, path)``.
    """
    inner = getattr(engine, "checkpoint_engine", None)
    require_parameters("async_save_state", getattr(inner, "save", None), ("state_dict", "path"))
    engine.checkpoint_engine = writer = make(inner)
    try:
        yield writer
    finally:
        engine.checkpoint_engine = inner


_BUILDERS = {"_create_checkpoint_file": ("save_dir", "tag", "zero_checkpoint"),
             "_save_checkpoint": ("save_dir", "tag", "client_state", "exclude_frozen_parameters"),
             "_create_zero_checkpoint_files": ("save_dir", "tag"), "_save_zero_checkpoint": ("save_path", "tag"),
             "_optimizer_has_ckpt_event_prologue": (), "module_state_dict": ("keep_vars",)}


def state_only_save(engine: Any, save_dir: str, tag: str, client_state: dict, **kwargs: Any) -> bool:
    """DeepSpeed's ``save_checkpoint`` without its collectives: the same files from the same per-rank builders
    (``_save_checkpoint``, ``_save_zero_checkpoint``), for a caller that has checked the tag across ranks itself.

    What DeepSpeed's save adds around them is collective: two barriers, the tag check (two all-reduces) and, under
    ZeRO-3, a prologue that partitions every parameter and an epilogue that all-gathers the persistent ones again.
    The prologue only shapes the model-states file (a partitioned parameter is saved as an empty tensor), so the
    module's state dict is given that form directly (:func:`_as_partitioned`) and the live parameters are left alone.

    Returns:
        False (nothing done) where the engine is one this does not cover (MoE layers, NVMe-offloaded optimizer
        state, pipeline modules, an optimizer with a checkpoint prologue other than ZeRO-3's, a DeepSpeed whose
        builders are missing or take other parameters): the caller runs DeepSpeed's whole save instead.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    builders = {name: getattr(engine, name, None) for name in _BUILDERS}
    if (not all(callable(fn) and not lacking_parameters(fn, _BUILDERS[name]) for name, fn in builders.items())
            or set(kwargs) - {"exclude_frozen_parameters"}
            or getattr(engine, "has_moe_layers", True) or engine.zero_nvme_offload_optimizer()
            or type(engine.module).__name__ == "PipelineModule"
            or (builders["_optimizer_has_ckpt_event_prologue"]()
                and not isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3))):
        return False
    builders["_create_checkpoint_file"](save_dir, tag, False)  # the tag's folder, through the checkpoint engine
    with _as_partitioned(engine):
        builders["_save_checkpoint"](save_dir, tag, client_state=client_state, **kwargs)
    if engine.save_zero_checkpoint:
        builders["_create_zero_checkpoint_files"](save_dir, tag)
        builders["_save_zero_checkpoint"](save_dir, tag)
    return True


@contextlib.contextmanager
def _as_partitioned(engine: Any) -> Iterator[None]:
    """While it lasts, ``engine.module_state_dict`` gives every ZeRO-3 parameter as DeepSpeed's save would after its
    prologue has partitioned it: an empty tensor of the parameter's dtype (``free_param``'s form). Other engines'
    state dicts are unchanged."""
    whole = engine.module_state_dict

    def module_state_dict(*args: Any, **kwargs: Any) -> Any:
        kwargs["keep_vars"] = True
        state = whole(*args, **kwargs)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = (torch.empty(0, dtype=value.dtype, device=value.device) if hasattr(value, "ds_id")
                              else value.detach())
        return state

    engine.module_state_dict = module_state_dict
    try:
        yield
    finally:
        del engine.module_state_dict  # the class's method again


register("grad_is_ready", Patch(
    "a ZeRO parameter's ds_grad_is_ready flag (set by the tiled MLP's backward)",
    "ZeRO-2/3's gradient hooks skipping the reduction of a parameter whose ds_grad_is_ready is False (DeepSpeed's own "
    "TiledMLP relies on it the same way)",
    "a tiled MLP's weights receive one gradient per tile: ZeRO would reduce each partial sum instead of the whole",
    "a public way to defer a parameter's gradient reduction until several backward contributions are in"))


def set_grad_ready(params: tuple, ready: bool) -> None:
    """Let ZeRO reduce ``params``' gradients after this backward contribution (``ready``) or not yet."""
    for p in params:
        p.ds_grad_is_ready = ready


register("start_of_forward_hook_off", Patch(
    "a ZeRO-3 engine's module's forward pre-hooks (DeepSpeed's start-of-forward hook taken out while a rollout "
    "generates with the parameters gathered, and put back in its place)",
    "DeepSpeedZeRoOffload keeping the hook's handle as fwd_pre_hook, registered on the engine's module, and "
    "calling the parameter coordinator's reset_step, which checks the recorded trace over every rank "
    "(assert_ints_same_as_other_ranks) while the trace is not complete",
    "TRL's add_hooks invalidates the trace after each generation, so each rank's first two forwards of a generation "
    "are collectives over every rank: ranks that generate a different share (or none) would wait forever",
    "DeepSpeed leaving the trace alone while hooks are removed (or a public way to pause the coordinator)"))


def _parameter_offload(engine: Any) -> Any:
    optimizer = getattr(engine, "optimizer", None)
    return getattr(optimizer, "parameter_offload", optimizer)


@contextlib.contextmanager
def start_of_forward_hook_off(engine: Any) -> Iterator[None]:
    """While the block runs, a ZeRO-3 engine's module runs without DeepSpeed's start-of-forward hook (its
    ``reset_step``); the hook is put back where it was among the module's pre-hooks. Without an optimizer yet (TRL's
    ``remove_hooks`` does nothing then either) the block runs as it is.

    Raises:
        UpstreamChanged: the offload keeps no ``fwd_pre_hook`` registered on its module.
    """
    offload = _parameter_offload(engine)
    if offload is None:
        yield
        return
    handle, module = getattr(offload, "fwd_pre_hook", None), getattr(offload, "module", None)
    hooks = getattr(module, "_forward_pre_hooks", None)
    if handle is None or hooks is None or getattr(handle, "id", None) not in hooks:
        refuse("start_of_forward_hook_off", "the ZeRO-3 offload keeps no fwd_pre_hook registered on its module")
    order = list(hooks)
    hook = hooks.pop(handle.id)
    try:
        yield
    finally:
        hooks[handle.id] = hook
        for key in [k for k in order if k in hooks] + [k for k in list(hooks) if k not in order]:
            hooks.move_to_end(key)  # the original order, any hook added meanwhile last


register("torch_linear_in_rollouts", Patch(
    "torch.nn.functional.linear while a ds-usp rollout generates under ZeRO-3 (torch's own in place of DeepSpeed's "
    "zero3_linear_wrap, put back after)",
    "ZeRO-3's initialization replacing torch.nn.functional.linear by deepspeed.runtime.zero.linear.zero3_linear_wrap "
    "for the rest of the process and keeping torch's as InsertPostInitMethodToModuleSubClasses.linear_bk",
    "every linear call of a generation (no gradient, parameters gathered) went through DeepSpeed's autograd Function, "
    "whose apply binds its arguments by signature: 0.3 s of CPU a rank for a 64-token rollout of a 4-layer Llama "
    "(1856 calls), a third of what ZeRO-3 added to generation over ZeRO-2",
    "DeepSpeed putting torch's linear back after initialization, or calling it directly when no gradient is needed"))


@contextlib.contextmanager
def torch_linear() -> Iterator[None]:
    """While the block runs, ``torch.nn.functional.linear`` is torch's own where ZeRO-3 left DeepSpeed's
    ``zero3_linear_wrap`` (the same product; the wrapper exists to gather a partitioned weight again in backward); as
    it was otherwise.

    Raises:
        UpstreamChanged: DeepSpeed's wrapper is in place but torch's linear is not kept where DeepSpeed keeps it.
    """
    import torch.nn.functional as F
    from deepspeed.runtime.zero import linear as zero_linear
    from deepspeed.runtime.zero import partition_parameters

    current = F.linear
    if current is not getattr(zero_linear, "zero3_linear_wrap", None):
        yield
        return
    original = getattr(getattr(partition_parameters, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if not callable(original) or original is current:
        refuse("torch_linear_in_rollouts", "DeepSpeed keeps torch's linear in no "
                                           "InsertPostInitMethodToModuleSubClasses.linear_bk")
    F.linear = original
    try:
        yield
    finally:
        F.linear = current
