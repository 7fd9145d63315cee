"""ds-usp's changes to DeepSpeed: ``deepspeed.initialize`` honouring ``"sequence_parallel"``, ZeRO-3's gradient
scaling under sequence parallelism, its CPU shared-memory buffer's name, its deprecation warnings."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import sys
import warnings
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist

from ds_usp.config import USPConfigError, read_ds_config
from ds_usp.integration.upstream.registry import Patch, innermost, register, require_parameters
from ds_usp.topology import USPMpu

register("deepspeed_initialize", Patch(
    "deepspeed.initialize",
    "its keyword parameters (args, model, ..., mpu, config, config_params) and accelerate's "
    "Accelerator._prepare_deepspeed reading deepspeed.initialize when it runs",
    "DeepSpeed ignores the \"sequence_parallel\" key: a plain deepspeed.initialize (or the HF Trainer through "
    "accelerate) given a USP config would silently train plain data parallelism",
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
    """Whether accelerate (an HF Trainer) is the caller: the only way to tell that the installed hook has."""
    return any(frame.frame.f_globals.get("__name__", "").startswith("accelerate.") for frame in inspect.stack()[2:])


def install_deepspeed_hook(initialize: Callable[..., Any]) -> None:
    """Make ``deepspeed.initialize`` honour ``"sequence_parallel"`` (idempotent).

    A call whose config sets the key is ``initialize`` (ds-usp's, same arguments, same engine), except under an HF
    Trainer that is not ds-usp's (the Trainer would feed every rank whole sequences), which is refused before
    anything is built. Calls without the key, or with a ds-usp ``mpu`` built by the caller, reach DeepSpeed unchanged.

    Args:
        initialize: :func:`ds_usp.initialize`.

    Raises:
        UpstreamChanged: ``deepspeed.initialize`` lost a parameter the hook relies on.
    """
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time notices: never on a program's stdout
        import deepspeed

    if getattr(deepspeed.initialize, "_ds_usp", False):
        return
    original = deepspeed.initialize
    require_parameters("deepspeed_initialize", original, ("args", "model", "optimizer", "model_parameters",
                                                           "training_data", "lr_scheduler", "mpu", "config",
                                                           "config_params", "dist_init_required", "collate_fn"))

    @functools.wraps(original)
    def initialize_with_usp(args: Any = None, **kwargs: Any) -> Any:
        config = _config_of_call(args, kwargs)
        if config is None or config.get("sequence_parallel") is None or isinstance(kwargs.get("mpu"), USPMpu):
            return original(args=args, **kwargs)
        if _called_from_accelerate() and not TRAINER_ROUTE.get():
            raise ValueError('the DeepSpeed config sets "sequence_parallel", but this HF Trainer is not ds-usp\'s: '
                             "it would give every rank whole sequences. Use ds_usp.USPTrainer (or ds_usp.USPSFTTrainer "
                             "for TRL's SFTTrainer) instead of Trainer")
        return initialize(args=args, **kwargs)

    initialize_with_usp._ds_usp = True
    deepspeed.initialize = initialize_with_usp




def quiet_deepspeed_deprecations() -> None:
    """Hide the FutureWarnings that DeepSpeed's ZeRO code triggers in torch.distributed on every step.

    DeepSpeed 0.19 calls ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which torch 2.13 deprecates with
    a warning per call site and rank; the user cannot act on them and they interleave with progress bars. Only
    these two messages are filtered (a filter, not a patch: nothing is changed if they stop being raised).
    """
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning)




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
