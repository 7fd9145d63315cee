"""ds-usp's changes to accelerate (and the accelerate functions TRL's trainer modules import): the Trainer route's
``deepspeed.initialize`` lookup and its marked ``prepare``, the prepared loaders split over the data-parallel replicas,
the gradient boundary of a dynamic-SP step, accelerate's processes seen as the data-parallel replicas, and the
sequence-parallel part of accelerate's ``parallelism_config`` taken by ds-usp."""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import os
from typing import Any, Iterator, Mapping

import torch

from ds_usp.upstream.deepspeed import TRAINER_ROUTE
from ds_usp.upstream.registry import Patch, refuse, register, require_parameters

register("replicas_view", Patch(
    "accelerate's Accelerator (num_processes, process_index, gather, gather_for_metrics, reduce, "
    "pad_across_processes) and the gather / gather_object names TRL's GRPO and RLOO trainer modules import, while "
    "a ds-usp RL trainer's rollout, loss and logging code runs",
    "those attributes existing with accelerate's parameters, and the trainer modules importing gather and "
    "gather_object from accelerate.utils",
    "accelerate counts every rank as a process, but the ranks of a sequence-parallel group hold the same samples: "
    "TRL's reward gathers, advantage groups, per-process slices and metrics would count each sample "
    "sequence_parallel_size times (and the unbiased reward std would change)",
    "accelerate taking a data-parallel process group (its ParallelismConfig knows sp_size but TRL refuses it in "
    "GRPO and RLOO)"))


register("trainer_route", Patch(
    "a ds-usp trainer's Accelerator.prepare (the instance's, wrapped)",
    "Accelerator.prepare creating the DeepSpeed engine through _prepare_deepspeed, which calls deepspeed.initialize",
    "the deepspeed.initialize hook must tell a ds-usp trainer's call (built by ds_usp.initialize) from a plain HF "
    "Trainer's (refused: it would feed every rank whole sequences), and accelerate passes nothing that tells them "
    "apart",
    "accelerate passing an mpu (or other arguments) from its DeepSpeed plugin to deepspeed.initialize"))


register("replicas_sampler", Patch(
    "accelerate's BatchSamplerShard.num_processes / process_index (of a ds-usp trainer's prepared loaders)",
    "BatchSamplerShard taking (num_processes, process_index) and reading them as it iterates and counts its "
    "batches (transformers' own Trainer sets them the same way for its BatchRebalanceSampler)",
    "accelerate splits the batches over every rank, but the ranks of a sequence-parallel group must train the same "
    "batch: each would otherwise hold the shard of a different sequence",
    "accelerate's prepare taking the data-parallel size and index (its ParallelismConfig knows sp_size, but only "
    "for its own context parallelism)"))


register("sync_gradients", Patch(
    "accelerate's Accelerator.sync_gradients (set per micro batch of a dynamic-SP step)",
    "the property having a setter, and Accelerator.backward passing sync_gradients=self.sync_gradients to the "
    "DeepSpeed engine (its gradient accumulation boundary)",
    "a dynamic-SP step runs all its micro batches inside one Trainer step: DeepSpeed must reach its accumulation "
    "boundary (and step its optimizer) on the last one only",
    "the Trainer running several micro batches per training_step, or accelerate's backward taking the boundary"))


def check_accelerate_reads_deepspeed_initialize() -> None:
    """The HF Trainer route: accelerate must look ``deepspeed.initialize`` up when it prepares the engine (so that the
    hook above is what it calls).

    Raises:
        UpstreamChanged: it does not.
    """
    from accelerate import Accelerator

    prepare = getattr(Accelerator, "_prepare_deepspeed", None)
    if prepare is None or "deepspeed.initialize" not in inspect.getsource(prepare):
        refuse("deepspeed_initialize", "accelerate's Accelerator._prepare_deepspeed does not read "
                "deepspeed.initialize in the installed version")




_OPERATIONS_COLLECTIVES = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                                     "broadcast_object_list", "all_reduce"})
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


def gather_for_metrics(accelerator: Any, data: Any, group: Any, size: int, use_gather_object: bool = False) -> Any:
    """accelerate's ``gather_for_metrics`` over ``group`` (``size`` ranks): the rows of every rank (or, for objects,
    their lists) concatenated, less the samples that accelerate repeated to even out the last batch.

    Args:
        accelerator: the accelerator (its ``gradient_state`` says whether the last batch was evened out).
        data: tensors (nested in lists, tuples and dicts) or, with ``use_gather_object``, a list of objects.
        group: the process group of the replicas.
        size: its ranks.
        use_gather_object: gather ``data`` as objects (as accelerate does for anything that is not a tensor).

    Returns:
        The gathered data.
    """
    data = (_gather_objects(data, group, size) if use_gather_object or not isinstance(data, torch.Tensor)
            else _gather_rows(data, group, size))
    state = accelerator.gradient_state
    return data[:state.remainder] if state.end_of_dataloader and state.remainder > 0 else data


def _replicas_class(cls: type, group: Any, size: int, index: int) -> type:
    """A subclass of the accelerator's class whose processes are the data-parallel replicas of ``group``."""
    from ds_usp.comm import all_reduce_max_int, all_reduce_sum_

    def reduce(self: Any, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        out = tensor.clone() * scale
        if size > 1:
            all_reduce_sum_(out, group, "reduce over replicas")
        return out / size if reduction == "mean" else out

    def pad_across_processes(self: Any, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        longest = tensor.shape[dim]
        if size > 1:
            longest = all_reduce_max_int(longest, group, "pad_across_processes over replicas")
        missing = longest - tensor.shape[dim]
        if missing <= 0:
            return tensor
        pad = tensor.new_full((*tensor.shape[:dim], missing, *tensor.shape[dim + 1:]), pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)

    return type(f"{cls.__name__}OverReplicas", (cls,), {
        "num_processes": property(lambda self: size), "process_index": property(lambda self: index),
        "gather": lambda self, tensor: _gather_rows(tensor, group, size),
        "gather_for_metrics": lambda self, input_data, use_gather_object=False: gather_for_metrics(
            self, input_data, group, size, use_gather_object),
        "reduce": reduce, "pad_across_processes": pad_across_processes})


register("replicas_operations", Patch(
    "accelerate.utils.operations' module globals PartialState and torch while a ds-usp trainer's replicas view lasts "
    "(what accelerate's free functions gather, gather_object, broadcast, broadcast_object_list, reduce and "
    "pad_across_processes read, however they were imported)",
    "the module's functions reading the process count and index from PartialState() and communicating only through "
    "torch.distributed's all_gather, all_gather_into_tensor, all_gather_object, broadcast, broadcast_object_list and "
    "all_reduce, called on the module's torch without a group argument",
    "code that runs in the view and calls accelerate's free functions (a GRPO rollout_func, which runs on each "
    "sequence-parallel group's first rank only; TRL's server idiom gather_object / broadcast_object_list; a reward "
    "function) would communicate over every rank: the group's other ranks, not in the call, never join (a hang), and "
    "where every rank calls, each sample is counted sequence_parallel_size times",
    "accelerate's operations taking a process group (or the data-parallel group of its ParallelismConfig)"))


class _StateOverReplicas:
    """accelerate's ``PartialState()`` as the operations module sees it in the view: ``num_processes`` and
    ``process_index`` are the replicas'; everything else is the state's own."""

    def __init__(self, state: Any, size: int, index: int) -> None:
        self._state, self.num_processes, self.process_index = state, size, index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class _DistributedOverReplicas:
    """``torch.distributed`` as the operations module sees it in the view: its collectives run over the replicas'
    group through :mod:`ds_usp.comm` (``src`` is a replica's index, as accelerate passes ``from_process``)."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    def all_gather(self, tensor_list: list, tensor: Any, *args: Any, **kwargs: Any) -> None:
        from ds_usp.comm import all_gather_rows

        for out, part in zip(tensor_list, all_gather_rows(tensor.contiguous(), self._group, "gather over replicas")):
            out.copy_(part)

    def all_gather_into_tensor(self, output: Any, tensor: Any, *args: Any, **kwargs: Any) -> None:
        from ds_usp.comm import all_gather_rows

        parts = all_gather_rows(tensor.contiguous(), self._group, "gather over replicas")
        output.view(-1).copy_(torch.cat([p.reshape(-1) for p in parts]))  # (replicas * numel,)

    def all_gather_object(self, object_list: list, obj: Any, *args: Any, **kwargs: Any) -> None:
        from ds_usp.comm import all_gather_objects

        object_list[:] = all_gather_objects(obj, self._group, "gather_object over replicas")

    def broadcast(self, tensor: Any, src: int, *args: Any, **kwargs: Any) -> None:
        from ds_usp.comm import all_gather_rows

        tensor.copy_(all_gather_rows(tensor.contiguous(), self._group, "broadcast over replicas")[src])

    def broadcast_object_list(self, object_list: list, src: int = 0, *args: Any, **kwargs: Any) -> None:
        from ds_usp.comm import all_gather_objects

        object_list[:] = all_gather_objects(list(object_list), self._group, "broadcast_object_list over replicas")[src]

    def all_reduce(self, tensor: Any, op: Any = None, *args: Any, **kwargs: Any) -> None:
        from ds_usp.comm import all_reduce_max_, all_reduce_sum_

        ops = torch.distributed.ReduceOp
        if op is not None and op not in (ops.SUM, ops.MAX):
            refuse("replicas_operations", f"accelerate's operations all-reduce with {op}")
        (all_reduce_max_ if op == ops.MAX else all_reduce_sum_)(tensor, self._group, "reduce over replicas")


class _TorchOverReplicas:
    """``torch`` as the operations module sees it in the view: :class:`_DistributedOverReplicas` as ``distributed``."""

    def __init__(self, group: Any) -> None:
        self.distributed = _DistributedOverReplicas(group)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _checked_operations() -> Any:
    """accelerate's ``accelerate.utils.operations``, after checking what the patch ``replicas_operations`` relies on.

    Raises:
        UpstreamChanged: it communicates otherwise.
    """
    import accelerate.utils.operations as operations

    names = vars(operations)
    if names.get("torch") is not torch or not isinstance(names.get("PartialState"), type):
        refuse("replicas_operations", "accelerate.utils.operations has no module-level torch and PartialState")
    calls = _operations_calls(operations)
    unknown = sorted({name for name, _ in calls} - _OPERATIONS_COLLECTIVES)
    grouped = sorted({name for name, arguments in calls if "group" in arguments})
    if unknown or grouped:
        refuse("replicas_operations", f"accelerate.utils.operations calls torch.distributed."
                                      f"{', '.join(unknown or grouped)} ({'unknown' if unknown else 'with a group'})")
    return operations


@functools.cache
def _operations_calls(operations: Any) -> frozenset:
    """``(name, its arguments when called)`` of every ``torch.distributed.<name>`` the module's source reads."""
    calls = set()
    for node in ast.walk(ast.parse(inspect.getsource(operations))):
        attribute = node.func if isinstance(node, ast.Call) else node
        if (isinstance(attribute, ast.Attribute) and isinstance(attribute.value, ast.Attribute) and
                attribute.value.attr == "distributed" and isinstance(attribute.value.value, ast.Name) and
                attribute.value.value.id == "torch"):
            arguments = [ast.unparse(a) for a in node.args] + [f"{k.arg}=" for k in node.keywords] \
                if isinstance(node, ast.Call) else []
            calls.add((attribute.attr, " ".join(arguments)))
    return frozenset(calls)


@contextlib.contextmanager
def operations_over_replicas(group: Any, size: int, index: int) -> Iterator[None]:
    """While the block runs, accelerate's free operations (``accelerate.utils.gather``, ``gather_object``,
    ``broadcast``, ``broadcast_object_list``, ``reduce``, ``pad_across_processes``, however imported) see the
    data-parallel replicas as the processes and communicate over ``group`` (``size`` replicas, this one ``index``).

    Raises:
        UpstreamChanged: accelerate's operations module communicates otherwise.
    """
    operations = _checked_operations()
    saved = {name: vars(operations)[name] for name in ("PartialState", "torch")}
    operations.PartialState = lambda *args, **kwargs: _StateOverReplicas(saved["PartialState"](*args, **kwargs),
                                                                         size, index)
    operations.torch = _TorchOverReplicas(group)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(operations, name, value)


@contextlib.contextmanager
def replicas_view(accelerator: Any, modules: tuple, group: Any, size: int, index: int) -> Any:
    """While the block runs, ``accelerator``, the ``gather`` / ``gather_object`` of ``modules`` (TRL trainer
    modules) and accelerate's free operations (:func:`operations_over_replicas`) see the data-parallel replicas as the
    processes: ``group`` (this rank's replicas: one rank of each sequence-parallel group), ``size`` of them, this one
    ``index``. ``is_main_process`` is unchanged (global rank 0).

    Raises:
        UpstreamChanged: an attribute it replaces is not what it was written for.
    """
    cls = type(accelerator)
    for name, params in _ACCELERATOR_VIEW.items():
        require_parameters("replicas_view", getattr(cls, name, None), params)
    for name in ("num_processes", "process_index"):
        if not isinstance(getattr(cls, name, None), property):
            refuse("replicas_view", f"Accelerator.{name} is not a property")
    for module in modules:
        for name in ("gather", "gather_object"):
            if getattr(getattr(module, name, None), "__module__", "").split(".")[0] != "accelerate":
                refuse("replicas_view", f"{module.__name__}.{name} is not accelerate's")
    saved = [(module, name, getattr(module, name)) for module in modules for name in ("gather", "gather_object")]
    accelerator.__class__ = _replicas_class(cls, group, size, index)
    for module, _, _ in saved:
        module.gather = lambda tensor: _gather_rows(tensor, group, size)
        module.gather_object = lambda obj: _gather_objects(obj, group, size)
    try:
        with operations_over_replicas(group, size, index):
            yield
    finally:
        accelerator.__class__ = cls
        for module, name, fn in saved:
            setattr(module, name, fn)


def route_prepare(accelerator: Any) -> None:
    """Make ``accelerator.prepare`` mark the ``deepspeed.initialize`` it calls as a ds-usp trainer's
    (:data:`ds_usp.upstream.deepspeed.TRAINER_ROUTE`), so that the hook builds the engine with
    ``ds_usp.initialize`` instead of refusing a plain Trainer.

    Raises:
        UpstreamChanged: accelerate's ``_prepare_deepspeed`` does not read ``deepspeed.initialize``.
    """
    check_accelerate_reads_deepspeed_initialize()
    prepare = accelerator.prepare

    @functools.wraps(prepare)
    def prepare_with_usp(*args: Any, **kwargs: Any) -> Any:
        token = TRAINER_ROUTE.set(True)
        try:
            return prepare(*args, **kwargs)
        finally:
            TRAINER_ROUTE.reset(token)

    accelerator.prepare = prepare_with_usp


def shard_over_replicas(loader: Any, size: int, index: int) -> Any:
    """Make an accelerate-prepared ``loader`` split its batches over ``size`` replicas, this rank being ``index``.

    Args:
        loader: a loader from ``Accelerator.prepare`` (its ``batch_sampler`` a ``BatchSamplerShard``, or, for one
            replica, a loader accelerate prepared for one process: ``accelerate launch`` with DeepSpeed on a host
            without accelerators and without ``use_cpu``, where accelerate counts one process).
        size: the data-parallel replicas.
        index: this rank's replica.

    Returns:
        ``loader``.

    Raises:
        ValueError: ``loader`` has no accelerate batch sampler and there is more than one replica.
        UpstreamChanged: ``BatchSamplerShard`` takes no ``num_processes`` / ``process_index``.
    """
    from accelerate.data_loader import BatchSamplerShard

    require_parameters("replicas_sampler", BatchSamplerShard.__init__, ("num_processes", "process_index"))
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, BatchSamplerShard):
        if size == 1 and type(loader).__module__.startswith("accelerate."):
            return loader  # prepared for one process (not split): every rank gets every batch, as one replica needs
        raise ValueError(f"unexpected data loader {type(loader).__name__} (no accelerate batch sampler to split over "
                         f"the {size} data-parallel replicas)")
    sampler.num_processes, sampler.process_index = size, index
    return loader


def set_sync_gradients(accelerator: Any, sync: bool) -> None:
    """Whether the next ``accelerator.backward`` ends DeepSpeed's gradient accumulation (and so steps its optimizer).

    Raises:
        UpstreamChanged: ``Accelerator.sync_gradients`` has no setter, or its ``backward`` does not pass it on.
    """
    prop = getattr(type(accelerator), "sync_gradients", None)
    if not isinstance(prop, property) or prop.fset is None:
        refuse("sync_gradients", "Accelerator.sync_gradients is not a property with a setter")
    if "sync_gradients=self.sync_gradients" not in _source(type(accelerator).backward):
        refuse("sync_gradients", "Accelerator.backward does not pass sync_gradients to DeepSpeed")
    accelerator.sync_gradients = sync


@functools.cache
def _source(fn: Any) -> str:
    return inspect.getsource(fn)


register("parallelism_config_sp", Patch(
    "the ParallelismConfig a ds-usp trainer's Accelerator is given (TrainingArguments.parallelism_config, or the one "
    "accelerate builds from an accelerate YAML's parallelism_config): its sequence-parallel part taken by ds-usp",
    "Accelerator building a ParallelismConfig from the PARALLELISM_CONFIG_* variables when "
    "ACCELERATE_USE_PARALLELISM_CONFIG is true and none is passed, and setting up DeepSpeed's own Ulysses (ALST) when "
    "its sp_size is above 1",
    "accelerate and the Trainer would run DeepSpeed's ALST beside ds-usp: its attention wrapper and loader adapter, "
    "and transformers' deepspeed_sp_compute_loss, which takes ds-usp's loss (already the group's token-weighted mean, "
    "each rank's gradient its tokens' share) for a per-rank mean and would rescale each rank's gradient by sp times "
    "its share of the tokens",
    "accelerate taking other sequence-parallel backends (its ParallelismConfig accepts only sp_backend deepspeed)"))


def parallelism_config_for_usp(given: Any, sp_size: int) -> Any:
    """The ParallelismConfig a ds-usp trainer's Accelerator gets when the DeepSpeed config sets
    ``"sequence_parallel"``: ``given`` (TrainingArguments'), else the one accelerate would build from an accelerate
    YAML's ``parallelism_config``; when that asks for sequence parallelism, the same without it (ds-usp's instead).

    Args:
        given: ``TrainingArguments.parallelism_config`` (None: read accelerate's variables as it would).
        sp_size: ds-usp's sequence-parallel size (the DeepSpeed config's ``sequence_parallel_size``).

    Returns:
        The config to give the Accelerator; None when there is none.

    Raises:
        ValueError: its ``sp_size`` is not ``sp_size``, or it also asks for tensor, context or sharded data
            parallelism (each named).
        UpstreamChanged: accelerate no longer builds it from its variables, or it has no such sizes.
    """
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig

    if given is None:
        if "ACCELERATE_USE_PARALLELISM_CONFIG" not in _source(Accelerator.__init__):
            refuse("parallelism_config_sp", "Accelerator.__init__ does not read ACCELERATE_USE_PARALLELISM_CONFIG")
        if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
            return None
        given = ParallelismConfig()
    sizes = {name: getattr(given, name, None) for name in ("sp_size", "tp_size", "cp_size", "dp_shard_size")}
    if not all(isinstance(v, int) for v in sizes.values()):
        refuse("parallelism_config_sp", f"ParallelismConfig holds {sizes}")
    if sizes["sp_size"] <= 1:
        return given
    others = [f"{name}={size}" for name, size in sizes.items() if name != "sp_size" and size > 1]
    if others:
        raise ValueError(f"accelerate's parallelism_config asks for {', '.join(others)} beside sp_size="
                         f"{sizes['sp_size']}: ds-usp's sequence parallelism under DeepSpeed does not combine with "
                         f"them; leave them out")
    if sizes["sp_size"] != sp_size:
        raise ValueError(f"accelerate's parallelism_config sets sp_size={sizes['sp_size']}, but the DeepSpeed config's "
                         f"sequence_parallel_size is {sp_size} (the world size where it is left out): ds-usp runs the "
                         f"sequence parallelism and takes its size from the DeepSpeed config; make them equal")
    return ParallelismConfig(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1)
