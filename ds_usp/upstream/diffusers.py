"""ds-usp's changes to diffusers: its attention backends routed to the USP attention for the attention modules
ds-usp shards, those modules' processors (their own copies, or ds-usp's for the families that call torch's SDPA
directly), and the forward signatures the sharding hooks bind by name.

diffusers' processors hand each attention call to ``dispatch_attention_fn``, which calls the registered backend
function with the processor's ``_parallel_config`` (the slot diffusers' own context parallelism uses to reach its
backends). ds-usp puts a :class:`DispatchRoute` there, on a copy of the processor of each attention module it shards,
and wraps every registered backend so that a call carrying one runs the route instead; every other call (cross
attention, a text refiner, a model ds-usp did not touch) reaches diffusers' backend unchanged.
"""
from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable, Iterable, Optional

from torch import nn

from ds_usp.upstream.registry import Patch, refuse, register, require_parameters

register("diffusers_backends", Patch(
    "diffusers.models.attention_dispatch._AttentionBackendRegistry._backends (every registered backend function "
    "wrapped)",
    "dispatch_attention_fn calling the registered function with keyword arguments only, _parallel_config among them "
    "when the backend takes it (its _supported_arg_names)",
    "the attention modules of a sharded diffusion transformer would each attend over their own rank's tokens only",
    "a documented way to plug a sequence-parallel attention into dispatch_attention_fn (diffusers' own context "
    "parallelism is the only user of _parallel_config)"))
register("diffusers_processors", Patch(
    "the attention processor of each attention module ds-usp shards in a diffusers model: a copy of the family's "
    "processor carrying ds-usp's route as its _parallel_config, or ds-usp's own processor (CogVideoX, SD3 / SD3.5)",
    "the processor class having a _parallel_config slot that its __call__ passes to dispatch_attention_fn; the "
    "module's set_processor",
    "CogVideoX's and SD3's processors call torch's scaled_dot_product_attention directly, the others reach the "
    "backend without knowing which module they serve",
    "processors that dispatch every attention call and name the module's role (self, joint, cross)"))
register("diffusers_signatures", Patch(
    "the forward pre-hooks and forward hooks ds-usp registers on a diffusers model's modules (the sharding of its "
    "token streams, their gather before the final projection)",
    "each hooked module's forward taking the parameters the family's plan names (bound by name: diffusers calls "
    "blocks positionally under gradient checkpointing)",
    "a renamed parameter would leave a tensor unsharded: its tokens would meet the wrong neighbours",
    "a sharding plan per model that names its token streams (diffusers' _cp_plan names split points, not streams)"))


class DispatchRoute:
    """What ds-usp puts in a processor's ``_parallel_config``: a backend call carrying one runs :meth:`run`."""

    def run(self, query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float, is_causal: bool,
            scale: Optional[float], extra: dict) -> Any:
        """The attention of ``(b, s, h, d)`` tensors as diffusers' backends compute it.

        Args:
            query, key, value: as ``dispatch_attention_fn`` passes them.
            attn_mask: its mask (None: none).
            dropout_p: its dropout.
            is_causal: its causality.
            scale: its softmax scale (None: ``1/sqrt(d)``).
            extra: any other keyword the backend received (``enable_gqa``, ``return_lse``...).

        Returns:
            ``(b, s, h, d)``.
        """
        raise NotImplementedError


def _registry() -> Any:
    from diffusers.models import attention_dispatch

    return getattr(attention_dispatch, "_AttentionBackendRegistry", None)


def route_attention_backends() -> None:
    """Wrap every registered diffusers attention backend so that a call whose ``_parallel_config`` is a
    :class:`DispatchRoute` runs the route (idempotent; other calls reach the backend unchanged).

    Raises:
        UpstreamChanged: diffusers has no backend registry with ``_backends`` and ``_supported_arg_names``, or
            ``dispatch_attention_fn`` takes no ``parallel_config``.
    """
    from diffusers.models import attention_dispatch

    registry = _registry()
    backends = getattr(registry, "_backends", None)
    if not isinstance(backends, dict) or not isinstance(getattr(registry, "_supported_arg_names", None), dict):
        refuse("diffusers_backends", "attention_dispatch has no _AttentionBackendRegistry with _backends and "
                                     "_supported_arg_names dicts")
    require_parameters("diffusers_backends", getattr(attention_dispatch, "dispatch_attention_fn", None),
                       ("parallel_config", "backend", "attn_mask", "scale"))
    for name, fn in list(backends.items()):
        if getattr(fn, "_ds_usp_route", False):
            continue

        @functools.wraps(fn)
        def routed(*args: Any, _fn: Callable = fn, **kwargs: Any) -> Any:
            route = kwargs.get("_parallel_config")
            if not isinstance(route, DispatchRoute):
                return _fn(*args, **kwargs)
            if args:
                raise TypeError("diffusers called an attention backend positionally; ds-usp's route expects "
                                "dispatch_attention_fn's keyword call")
            kwargs.pop("_parallel_config")
            query, key, value = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
            return route.run(query, key, value, kwargs.pop("attn_mask", None), kwargs.pop("dropout_p", 0.0),
                             kwargs.pop("is_causal", False), kwargs.pop("scale", None), kwargs)

        routed._ds_usp_route = True
        backends[name] = routed


def backend_takes_route(processor: Any) -> Optional[str]:
    """Why the backend ``processor`` dispatches to cannot receive a route (None: it can): the backend diffusers would
    run drops ``_parallel_config`` (its function does not take it), so the call would bypass ds-usp."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    registry = _registry()
    name = getattr(processor, "_attention_backend", None)
    if name is None:
        name = getattr(registry, "_active_backend", None)
    if isinstance(name, str):
        name = AttentionBackendName(name)
    supported = getattr(registry, "_supported_arg_names", {}).get(name)
    if supported is None:
        return f"its attention backend {name!r} is not registered with diffusers"
    if "_parallel_config" not in supported:
        return (f"its attention backend {getattr(name, 'value', name)!r} takes no _parallel_config, so diffusers "
                f"would drop ds-usp's route: set model.set_attention_backend('native') (or another that diffusers' "
                f"context parallelism supports)")
    return None


def give_route(module: nn.Module, route: DispatchRoute) -> None:
    """Give attention ``module`` its own copy of its processor, carrying ``route`` as its ``_parallel_config`` (the
    processor objects the model shares are left as they were).

    Raises:
        UpstreamChanged: the processor has no ``_parallel_config`` slot, its ``__call__`` does not pass it to
            ``dispatch_attention_fn``, or the module has no ``set_processor``.
    """
    processor = getattr(module, "processor", None)
    if not hasattr(type(processor), "_parallel_config"):
        refuse("diffusers_processors", f"{type(processor).__name__} has no _parallel_config slot")
    try:
        source = inspect.getsource(type(processor).__call__)
    except (OSError, TypeError):
        source = ""
    if "dispatch_attention_fn" not in source or "self._parallel_config" not in source:
        refuse("diffusers_processors", f"{type(processor).__name__}.__call__ does not pass self._parallel_config to "
                                       f"dispatch_attention_fn")
    own = copy.copy(processor)
    own._parallel_config = route
    set_processor(module, own)


def set_processor(module: nn.Module, processor: Any) -> None:
    """``module.set_processor(processor)`` (diffusers' own method).

    Raises:
        UpstreamChanged: the module has no ``set_processor`` taking ``processor``.
    """
    require_parameters("diffusers_processors", getattr(module, "set_processor", None), ("processor",))
    module.set_processor(processor)


def check_forward_parameters(module: nn.Module, names: Iterable[str]) -> inspect.Signature:
    """The signature of ``module``'s class forward, after checking it takes every one of ``names``.

    Returns:
        The signature (``self`` first), which the hooks bind the module's calls with.

    Raises:
        UpstreamChanged: a parameter the plan names is gone.
    """
    forward = type(module).forward
    require_parameters("diffusers_signatures", forward, tuple(names))
    return inspect.signature(forward)
