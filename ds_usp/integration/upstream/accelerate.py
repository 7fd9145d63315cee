"""ds-usp's changes to accelerate (and the accelerate functions TRL's trainer modules import): the Trainer route's
``deepspeed.initialize`` lookup, and accelerate's processes seen as the data-parallel replicas."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ds_usp.integration.upstream.registry import Patch, refuse, register, require_parameters

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
        yield
    finally:
        accelerator.__class__ = cls
        for module, name, fn in saved:
            setattr(module, name, fn)
