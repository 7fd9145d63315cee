"""ds-usp's changes to torch internals: selective checkpointing's recomputation mode."""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator

import torch
import torch.utils.checkpoint

from ds_usp.upstream.registry import Patch, refuse, register

register("tolerant_recompute", Patch(
    "torch.utils.checkpoint._CachedTorchDispatchMode (selective checkpointing's recomputation)",
    "the private class existing with a __torch_dispatch__ that raises 'not found in storage' for an op the "
    "forward did not run",
    "ZeRO-3's parameter fetches inside a checkpointed layer may differ between its forward and its "
    "recomputation (a prefetch from an earlier step or an evaluation forward): torch refuses the recomputation",
    "a public option of create_selective_checkpoint_contexts to run ops the forward did not see"))


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
        refuse("tolerant_recompute", "torch.utils.checkpoint has no _CachedTorchDispatchMode with __torch_dispatch__")
    if type(recompute) is not _CACHED:
        refuse("tolerant_recompute", f"the recomputation context is a {type(recompute).__name__}")
    recompute.__class__ = _TolerantRecompute  # the same state, the tolerant dispatch
    return recompute


register("module_forward", Patch(
    "an nn.Module instance's forward (a causal LM's, its decoder layers', their feed-forward blocks', the sequence "
    "mixers ds-usp shards)",
    "nn.Module.__call__ running the instance's forward attribute, so that one set on the instance replaces the "
    "class's method for that module only (a class's own __call__ is accepted only where it is transformers' "
    "GradientCheckpointingLayer.__call__, transformers < 5.19, whose two paths both end in nn.Module.__call__)",
    "the SP loss, the memory stack and the sharded sequence mixers are applied to the model from outside (as "
    "torchtitan applies parallelisms): without it ds-usp would have to copy each family's forward",
    "module hooks that can replace a module's computation (a forward pre-hook can only change its inputs)"))
register("module_attributes", Patch(
    "attributes ds-usp sets on a model's module instances: its USP context on every module, the marks of what it "
    "wrapped, a sharded vision block's call record, the fused LM head's settings, a Griffin RG-LRU's "
    "recurrent_states (None while training)",
    "nn.Module.__setattr__ storing a plain (non-tensor, non-module) value as an instance attribute, which the "
    "module's own code does not read under ds-usp's names (the RG-LRU reads its recurrent_states, None meaning no "
    "cache)",
    "the model's layers reach the topology through their module, and a module's call records what its hooks need",
    "none needed: this is nn.Module's documented behaviour; listed so that every change to a model's objects is "
    "in one place"))


def replace_forward(module: torch.nn.Module, forward: Any) -> None:
    """Make ``forward`` the forward of this one module (``nn.Module.__call__`` calls it).

    Raises:
        UpstreamChanged: ``module`` is called otherwise than through ``nn.Module.__call__``, or has no forward.
    """
    if not callable(getattr(module, "forward", None)):
        refuse("module_forward", f"{type(module).__name__} has no callable forward")
    call = type(module).__call__
    if call is not torch.nn.Module.__call__ and not _calls_module_call(call):
        refuse("module_forward", f"{type(module).__name__} overrides __call__")
    set_module_attribute(module, "forward", forward)


@functools.cache
def _calls_module_call(call: Any) -> bool:
    """Whether a ``__call__`` override is transformers' ``GradientCheckpointingLayer.__call__`` (transformers before
    5.19: every decoder layer's class has it), which ends in ``nn.Module.__call__`` on both of its paths (the plain
    call, and HF's checkpointing of it), so the instance's forward is what runs."""
    if getattr(call, "__qualname__", "") != "GradientCheckpointingLayer.__call__":
        return False
    try:
        source = inspect.getsource(call)
    except (OSError, TypeError):
        return False
    return source.count("super().__call__") == 2


_OWN_PREFIXES = ("_usp_", "_ds_usp")  # the attributes ds-usp itself names (its context, marks, call records)
_UPSTREAM_ATTRIBUTES = ("forward", "recurrent_states")  # a model's own attributes ds-usp sets (the record says why)


def set_module_attribute(module: torch.nn.Module, name: str, value: Any) -> None:
    """``module.name = value`` on the instance, for the attributes the ``module_attributes`` record lists: ds-usp's
    own names (``_usp_*``, ``_ds_usp*``), which the module's class must not define, and the model's own
    ``forward`` (:func:`replace_forward`) and ``recurrent_states`` (an attribute the instance already has).

    Raises:
        UpstreamChanged: the class defines one of ds-usp's names, or the instance lacks the model's own attribute.
        ValueError: a name the record does not list (a change to a model must be recorded first).
    """
    if name.startswith(_OWN_PREFIXES):
        if hasattr(type(module), name):
            refuse("module_attributes", f"{type(module).__name__} defines {name} itself")
    elif name not in _UPSTREAM_ATTRIBUTES:
        raise ValueError(f"set_module_attribute: {name!r} is not an attribute the module_attributes record lists")
    elif name != "forward" and not hasattr(module, name):
        refuse("module_attributes", f"{type(module).__name__} has no {name} of its own")
    setattr(module, name, value)


def restore_forward(module: torch.nn.Module) -> None:
    """Undo :func:`replace_forward`: the class's forward again."""
    module.__dict__.pop("forward", None)


register("no_checkpoint_policy", Patch(
    "torch.utils.checkpoint's selective-checkpointing dispatch modes (_CachingTorchDispatchMode, "
    "_CachedTorchDispatchMode), popped while a tiled MLP's tiles run",
    "those private classes, and torch.utils._python_dispatch's _get_current_dispatch_mode and _pop_mode_temporarily "
    "(the modes a checkpointed layer pushes sit on top of any the caller pushed, a counting meter's included)",
    "selective checkpointing runs two Python dispatch modes over every aten op of a checkpointed layer: a tiled MLP's "
    "ops (none of which the policy keeps) would each pay that Python cost",
    "a public way to exclude a region from a checkpoint policy (or policies that see a Function as one op)"))


@contextlib.contextmanager
def no_checkpoint_policy() -> Iterator[None]:
    """While it lasts, selective checkpointing's dispatch modes do not see the ops run (any other mode still does).

    Raises:
        UpstreamChanged: torch's private mode stack functions or checkpoint mode classes are gone.
    """
    from torch.utils import _python_dispatch as dispatch

    modes = tuple(c for c in (getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None), _CACHED) if c)
    current = getattr(dispatch, "_get_current_dispatch_mode", None)
    pop = getattr(dispatch, "_pop_mode_temporarily", None)
    if len(modes) != 2 or current is None or pop is None:
        refuse("no_checkpoint_policy", "torch's selective-checkpointing modes or its dispatch-mode stack functions "
                                       "are not what they were")
    with contextlib.ExitStack() as stack:
        while isinstance(current(), modes):
            stack.enter_context(pop())
        yield
