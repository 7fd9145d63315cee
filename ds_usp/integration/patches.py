"""Every place ds-usp changes someone else's code: DeepSpeed's, transformers', accelerate's and torch's internals.

Each patch is a function here, and each first checks the exact upstream signature or behaviour it relies on. When
that changed, the patch refuses with :class:`UpstreamChanged`, naming the patched object, what it relied on, what
was found and the upstream fix that would make it unnecessary, instead of silently patching something else. The
table :data:`PATCHES` is the list docs/architecture.md shows ("Patches of third-party code").

What the replacements compute stays with the code that owns it (the family functions of a Mamba-1 mixer are
:mod:`ds_usp.integration.hybrid`'s); what is patched, how and on which checked assumption is here.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from ds_usp.config import USPConfigError, read_ds_config
from ds_usp.topology import USPMpu


class UpstreamChanged(RuntimeError):
    """A third-party internal ds-usp patches is not what the patch was written for."""


@dataclass(frozen=True)
class Patch:
    """One patch of third-party code.

    Attributes:
        target: the patched object.
        relies_on: the upstream signature or behaviour checked before patching.
        why: what would go wrong without it.
        upstream_fix: the upstream change that would make it unnecessary.
    """

    target: str
    relies_on: str
    why: str
    upstream_fix: str


PATCHES: dict[str, Patch] = {
    "deepspeed_initialize": Patch(
        "deepspeed.initialize",
        "its keyword parameters (args, model, ..., mpu, config, config_params) and accelerate's "
        "Accelerator._prepare_deepspeed reading deepspeed.initialize when it runs",
        "DeepSpeed ignores the \"sequence_parallel\" key: a plain deepspeed.initialize (or the HF Trainer through "
        "accelerate) given a USP config would silently train plain data parallelism",
        "a DeepSpeed extension point for config keys it does not know (or DeepSpeed refusing unknown top-level keys)"),
    "zero3_sp_scaling": Patch(
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads",
        "the name-mangled method with parameters (params_to_reduce, communication_data_type), returning the "
        "averaged gradient partitions, and not already dividing by sequence_parallel_size",
        "under ZeRO-3 with sequence parallelism its reduce-scatter divides the gradients by sp x dp instead of dp: "
        "the gradients are sp times too small",
        "divide by _gradient_averaging_world_size(...) / self.sequence_parallel_size there, as "
        "__avg_scatter_contiguous_grads already does (docs/upstream/zero3_sequence_parallel_scaling.patch)"),
    "shm_buffer_name": Patch(
        "DeepSpeed's CPU shared-memory all-reduce buffer (deepspeed/ops/csrc/cpu/comm/shm.cpp)",
        "its POSIX name deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (SHM_BUFFER_NAME)",
        "DeepSpeed never unlinks the 66 MB buffer per rank: every CPU run leaves them in /dev/shm, which is memory",
        "shm.cpp unlinking the name once every rank has opened it"),
    "attn_implementation_check": Patch(
        "transformers.PreTrainedModel._check_and_adjust_attn_implementation",
        "the method taking (self, attn_implementation, ...) when a model is built",
        "a family that computes attention in its own code would fail with KeyError: 'usp' deep inside it, or for "
        "some families silently run its own attention on each shard",
        "transformers refusing a registered attention implementation for a class whose _can_set_attn_implementation() "
        "is false, naming the class"),
    "trainer_batch_size": Patch(
        "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process",
        "the method taking (self, args, auto_find_batch_size) and filling an \"auto\" train_batch_size as "
        "world x micro x accumulation",
        "with sequence parallelism DeepSpeed counts world / sequence_parallel_size replicas and refuses HF's value",
        "HF dividing the world size by sequence_parallel_size, as DeepSpeed's own config does"),
    "tolerant_recompute": Patch(
        "torch.utils.checkpoint._CachedTorchDispatchMode (selective checkpointing's recomputation)",
        "the private class existing with a __torch_dispatch__ that raises 'not found in storage' for an op the "
        "forward did not run",
        "ZeRO-3's parameter fetches inside a checkpointed layer may differ between its forward and its "
        "recomputation (a prefetch from an earlier step or an evaluation forward): torch refuses the recomputation",
        "a public option of create_selective_checkpoint_contexts to run ops the forward did not see"),
    "family_functions": Patch(
        "a transformers family module's functions (Mamba-1 families: causal_conv1d_fn, mamba_selective_scan, "
        "mamba_inner_fn)",
        "each function existing in the family's module with the parameters the replacement passes on",
        "the family's forward calls its module's functions directly: the only way to run them on the sharded "
        "sequence without copying the family's forward",
        "the family's kernels as a module attribute of the mixer (as its Mamba-2 kin take them), or a kernel hook"),
    "replicas_view": Patch(
        "accelerate's Accelerator (num_processes, process_index, gather, gather_for_metrics, reduce, "
        "pad_across_processes) and the gather / gather_object names TRL's GRPO and RLOO trainer modules import, while "
        "a ds-usp RL trainer's rollout, loss and logging code runs",
        "those attributes existing with accelerate's parameters, and the trainer modules importing gather and "
        "gather_object from accelerate.utils",
        "accelerate counts every rank as a process, but the ranks of a sequence-parallel group hold the same samples: "
        "TRL's reward gathers, advantage groups, per-process slices and metrics would count each sample "
        "sequence_parallel_size times (and the unbiased reward std would change)",
        "accelerate taking a data-parallel process group (its ParallelismConfig knows sp_size but TRL refuses it in "
        "GRPO and RLOO)"),
}


def _refuse(key: str, found: str) -> None:
    patch = PATCHES[key]
    raise UpstreamChanged(f"ds-usp patches {patch.target}, relying on {patch.relies_on}; but {found}. It would "
                          f"otherwise go wrong as follows: {patch.why}. Use the versions setup.py's dev extra pins, or "
                          f"report it; the upstream fix that makes the patch unnecessary: {patch.upstream_fix}")


def _innermost(fn: Any) -> Any:
    """``fn`` under its decorators: ``functools.wraps``' ``__wrapped__``, or the ``func`` a closure wraps (DeepSpeed's
    ``instrument_w_nvtx`` keeps no ``__wrapped__``)."""
    fn = getattr(fn, "__func__", fn)  # a bound method
    while True:
        inner = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        if inner is None and code is not None and "func" in code.co_freevars and fn.__closure__:
            inner = fn.__closure__[code.co_freevars.index("func")].cell_contents
        if not callable(inner):
            return fn
        fn = inner


def _require_parameters(key: str, fn: Any, params: tuple[str, ...]) -> None:
    """Refuse (:func:`_refuse`) unless ``fn`` is callable and takes every one of ``params`` (under its decorators)."""
    if not callable(fn):
        _refuse(key, "it does not exist in the installed version")
    lacking = [p for p in params if p not in inspect.signature(_innermost(fn)).parameters]
    if lacking:
        _refuse(key, f"it takes no {', '.join(lacking)} in the installed version")


# ------------------------------------------------------------------------------ deepspeed.initialize


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
    _require_parameters("deepspeed_initialize", original, ("args", "model", "optimizer", "model_parameters",
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


def check_accelerate_reads_deepspeed_initialize() -> None:
    """The HF Trainer route: accelerate must look ``deepspeed.initialize`` up when it prepares the engine (so that the
    hook above is what it calls).

    Raises:
        UpstreamChanged: it does not.
    """
    from accelerate import Accelerator

    prepare = getattr(Accelerator, "_prepare_deepspeed", None)
    if prepare is None or "deepspeed.initialize" not in inspect.getsource(prepare):
        _refuse("deepspeed_initialize", "accelerate's Accelerator._prepare_deepspeed does not read "
                "deepspeed.initialize in the installed version")


def quiet_deepspeed_deprecations() -> None:
    """Hide the FutureWarnings that DeepSpeed's ZeRO code triggers in torch.distributed on every step.

    DeepSpeed 0.19 calls ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which torch 2.13 deprecates with
    a warning per call site and rank; the user cannot act on them and they interleave with progress bars. Only
    these two messages are filtered (a filter, not a patch: nothing is changed if they stop being raised).
    """
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning)


# ------------------------------------------------------------------------------ ZeRO-3 gradient scaling


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
    _require_parameters("zero3_sp_scaling", scatter, ("params_to_reduce", "communication_data_type"))
    if "sequence_parallel_size" in inspect.getsource(_innermost(scatter)):
        return  # fixed upstream: correcting again would multiply the gradients by sp

    def scatter_then_rescale(params: Any, communication_data_type: Any) -> Any:
        parts = scatter(params, communication_data_type)
        for part in parts:
            part.mul_(sp_size)  # it divided by sp * dp; the mean over replicas divides by dp
        return parts

    setattr(optimizer, _ZERO3_SCATTER, scatter_then_rescale)


# ------------------------------------------------------------------------------ DeepSpeed's /dev/shm buffer


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


# ------------------------------------------------------------------------------ transformers


def wrap_attn_implementation_check(refuse: Callable[[type], None], name: str) -> None:
    """Make building a model with ``attn_implementation=name`` call ``refuse(model_class)`` first (idempotent).

    Args:
        refuse: raises for a class ds-usp cannot shard.
        name: the attention implementation's name (``"usp"``).

    Raises:
        UpstreamChanged: transformers has no such method, or it takes no ``attn_implementation``.
    """
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if getattr(check, "_ds_usp", False):
        return
    _require_parameters("attn_implementation_check", check, ("attn_implementation",))

    @functools.wraps(check)
    def check_usp_is_possible(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        if attn_implementation == name:
            refuse(type(self))
        return check(self, attn_implementation, *args, **kwargs)

    check_usp_is_possible._ds_usp = True
    PreTrainedModel._check_and_adjust_attn_implementation = check_usp_is_possible


def fix_trainer_batch_size(replicas_batch: Callable[[Mapping[str, Any], Any], Optional[int]]) -> None:
    """Make HF fill an ``"auto"`` ``train_batch_size`` with ``replicas_batch(config, args)`` when that is not None
    (idempotent). ``trainer_config_process`` runs when ``TrainingArguments`` is created, before any trainer exists.

    Args:
        replicas_batch: the batch size over replicas (None: keep HF's).

    Raises:
        UpstreamChanged: the method is gone or takes other parameters.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    cls = hf_deepspeed.HfTrainerDeepSpeedConfig
    original = getattr(cls, "trainer_config_process", None)
    if getattr(original, "_ds_usp", False):
        return
    _require_parameters("trainer_batch_size", original, ("args", "auto_find_batch_size"))

    @functools.wraps(original)
    def trainer_config_process(self: Any, args: Any, auto_find_batch_size: bool = False) -> None:
        was_auto = self.config.get("train_batch_size") == "auto"
        original(self, args, auto_find_batch_size)
        fixed = replicas_batch(self.config, args) if was_auto else None
        if fixed is not None:
            self.config["train_batch_size"] = fixed

    trainer_config_process._ds_usp = True
    cls.trainer_config_process = trainer_config_process


def replace_family_functions(family: Any, replacements: Mapping[str, Callable[[Callable], Callable]],
                             params: Mapping[str, tuple[str, ...]], optional: tuple[str, ...] = ()) -> None:
    """Swap functions of a transformers family module for ``replacements[name](original)`` (idempotent per module).

    Args:
        family: the module that defines the family's classes.
        replacements: ``name -> factory`` of the replacement from the family's own function.
        params: ``name -> parameters`` the replacement passes on, checked on the family's function.
        optional: names the family may lack (left alone then).

    Raises:
        UpstreamChanged: a function is missing or takes other parameters.
    """
    if getattr(family, "_ds_usp_sharded", False):
        return
    for name, make in replacements.items():
        original = getattr(family, name, None)
        if original is None and name in optional:
            continue
        _require_parameters("family_functions", original, params.get(name, ()))
        setattr(family, name, functools.wraps(original)(make(original)))
    family._ds_usp_sharded = True


# ------------------------------------------------------------------------------ torch's recomputation


_CACHED = getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None)  # torch's (private) recomputation mode


class _TolerantRecompute(_CACHED or object):  # type: ignore[misc]
    """torch's recomputation mode of selective checkpointing, running the ops the forward did not run.

    torch refuses any op its recomputation did not see in the forward. ZeRO-3's hooks run inside the checkpointed
    layer and need not repeat themselves: a parameter the forward found prefetched (its trace from an earlier step,
    or an earlier forward under ``no_grad`` such as an evaluation) is fetched in the recomputation, allocating and
    gathering, and torch would raise "encountered during backward but not found in storage". Such ops are run; every
    op the forward ran is replayed as torch does (the ring attention's kept outputs included).
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as e:
            if "not found in storage" not in str(e):
                raise
            return func(*args, **(kwargs or {}))


def tolerant_recompute(recompute: Any) -> Any:
    """``recompute`` (the second context of ``create_selective_checkpoint_contexts``) with the tolerant dispatch.

    Raises:
        UpstreamChanged: the context is not torch's ``_CachedTorchDispatchMode``, or that class has no
            ``__torch_dispatch__``.
    """
    if _CACHED is None or not callable(getattr(_CACHED, "__torch_dispatch__", None)):
        _refuse("tolerant_recompute", "torch.utils.checkpoint has no _CachedTorchDispatchMode with __torch_dispatch__")
    if type(recompute) is not _CACHED:
        _refuse("tolerant_recompute", f"the recomputation context is a {type(recompute).__name__}")
    recompute.__class__ = _TolerantRecompute  # the same state, the tolerant dispatch
    return recompute


# ------------------------------------------------------------------------------ accelerate seen by the replicas only

_ACCELERATOR_VIEW = {"gather": ("tensor",), "gather_for_metrics": ("input_data", "use_gather_object"),
                     "reduce": ("tensor", "reduction", "scale"), "pad_across_processes": ("tensor", "dim", "pad_index",
                                                                                          "pad_first")}


def _gather_rows(data: Any, group: Any, size: int) -> Any:
    """accelerate's ``gather`` over ``group``: tensors (0-d ones as one row) concatenated on dim 0, nested in lists,
    tuples and dicts."""
    if isinstance(data, (list, tuple)):
        return type(data)(_gather_rows(x, group, size) for x in data)
    if isinstance(data, Mapping):
        return type(data)({k: _gather_rows(v, group, size) for k, v in data.items()})
    if not isinstance(data, torch.Tensor):
        return data
    data = data[None] if data.dim() == 0 else data.contiguous()
    if size == 1:
        return data
    from ds_usp.comm import all_gather_rows

    return torch.cat(all_gather_rows(data, group, "gather over replicas"))


def _gather_objects(obj: Any, group: Any, size: int) -> list:
    """accelerate's ``gather_object`` over ``group`` (each rank gives a list; the lists are concatenated)."""
    if size == 1:
        return list(obj)
    from ds_usp.comm import all_gather_objects

    return [x for part in all_gather_objects(obj, group, "gather_object over replicas") for x in part]


def _replicas_class(cls: type, group: Any, size: int, index: int) -> type:
    """A subclass of the accelerator's class whose processes are the data-parallel replicas of ``group``."""

    def gather_for_metrics(self: Any, input_data: Any, use_gather_object: bool = False) -> Any:
        data = (_gather_objects(input_data, group, size) if use_gather_object or not isinstance(input_data, torch.Tensor)
                else _gather_rows(input_data, group, size))
        state = self.gradient_state
        return data[:state.remainder] if state.end_of_dataloader and state.remainder > 0 else data

    def reduce(self: Any, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        out = tensor.clone() * scale
        if size > 1:
            dist.all_reduce(out, group=group)
        return out / size if reduction == "mean" else out

    def pad_across_processes(self: Any, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        longest = torch.tensor(tensor.shape[dim])
        if size > 1:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        missing = int(longest) - tensor.shape[dim]
        if missing <= 0:
            return tensor
        pad = tensor.new_full((*tensor.shape[:dim], missing, *tensor.shape[dim + 1:]), pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)

    return type(f"{cls.__name__}OverReplicas", (cls,), {
        "num_processes": property(lambda self: size), "process_index": property(lambda self: index),
        "gather": lambda self, tensor: _gather_rows(tensor, group, size), "gather_for_metrics": gather_for_metrics,
        "reduce": reduce, "pad_across_processes": pad_across_processes})


@contextlib.contextmanager
def replicas_view(accelerator: Any, modules: tuple, group: Any, size: int, index: int) -> Any:
    """While the block runs, ``accelerator`` and the ``gather`` / ``gather_object`` of ``modules`` (TRL trainer
    modules) see the data-parallel replicas as the processes: ``group`` (this rank's replicas: one rank of each
    sequence-parallel group), ``size`` of them, this one ``index``. ``is_main_process`` is unchanged (global rank 0).

    Raises:
        UpstreamChanged: an attribute it replaces is not what it was written for.
    """
    cls = type(accelerator)
    for name, params in _ACCELERATOR_VIEW.items():
        _require_parameters("replicas_view", getattr(cls, name, None), params)
    for name in ("num_processes", "process_index"):
        if not isinstance(getattr(cls, name, None), property):
            _refuse("replicas_view", f"Accelerator.{name} is not a property")
    for module in modules:
        for name in ("gather", "gather_object"):
            if getattr(getattr(module, name, None), "__module__", "").split(".")[0] != "accelerate":
                _refuse("replicas_view", f"{module.__name__}.{name} is not accelerate's")
    saved = [(module, name, getattr(module, name)) for module in modules for name in ("gather", "gather_object")]
    accelerator.__class__ = _replicas_class(cls, group, size, index)
    for module, _, _ in saved:
        module.gather = lambda tensor: _gather_rows(tensor, group, size)
        module.gather_object = lambda obj: _gather_objects(obj, group, size)
    try:
        yield
    finally:
        accelerator.__class__ = cls
        for module, name, fn in saved:
            setattr(module, name, fn)
