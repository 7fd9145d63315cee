"""Activation checkpointing of decoder layers, selective or full, with the kept layer inputs optionally offloaded.

``"selective"`` keeps the ring attention's output and LSE (a custom op, kept by torch's selective checkpointing
policy) so the backward recomputes only the projections, norms and the cheap all-to-alls, never the attention
itself; ``"full"`` recomputes everything (ALST's way, the least memory). Offload: the checkpointed hidden states
(each layer's input) wait for the backward in host memory (a copy to ``cpu`` and back, so a no-op on CPU).

On CPU each checkpointed layer's forward, recomputation and the end of its backward hand the C heap's free pages
back to the operating system (:func:`trim_host_heap`): glibc keeps a freed tensor's pages resident, so without it
a step's resident set grows by whatever the previous layers freed (issue 26: 457 -> 355 MiB per rank at S = 8K,
no slower).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import inspect
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from ds_usp.integration.step.choices import MemoryContext
from ds_usp.integration.upstream.torch import tolerant_recompute

# ---------------------------------------------------------------------- activation checkpointing


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_host_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim(0)``; a no-op elsewhere).

    Tensors on CPU come from malloc: a freed block below glibc's mmap threshold (up to 32 MiB) stays resident,
    so layer after layer the resident set grows with what was freed. Trimming costs a walk over the free lists
    and a page fault when a page is reused.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _keep_ring_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: keep the ring's (out, lse); recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.ds_usp.ring_attention.default \
        else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    """torch's selective-checkpointing contexts keeping the ring attention, the recomputation tolerant of ops the forward
    did not run (:func:`ds_usp.integration.upstream.torch.tolerant_recompute`)."""
    forward, recompute = create_selective_checkpoint_contexts(_keep_ring_attention)
    return forward, tolerant_recompute(recompute)


class _ToHost(torch.autograd.Function):
    """A copy to pinned host memory whose gradient goes back to the device (offload of a checkpointed input)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.device = x.device
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return host.copy_(x, non_blocking=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.to(ctx.device, non_blocking=True)


def to_host(x: Tensor) -> Tensor:
    """``x`` in host memory, differentiably (``x`` itself when it is there already: the CPU no-op)."""
    return x if x.device.type == "cpu" else _ToHost.apply(x)


def _trim_after(grad: Tensor) -> Tensor:
    trim_host_heap()
    return grad


def checkpointed_layer_forward(original: Callable, ctx: MemoryContext) -> Callable:
    try:  # where a layer takes use_cache / past_key_values positionally (RecurrentGemma), they are replaced there
        names = [n for n in inspect.signature(original).parameters][1:]  # after hidden_states
    except (TypeError, ValueError):
        names = []

    @functools.wraps(original)
    def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        choices = ctx.choices
        if choices is None or not choices.checkpoint or not torch.is_grad_enabled():
            return original(hidden_states, *args, **kwargs)

        first = [hidden_states]

        def run(hidden: Tensor, *rest: Any, **kw: Any) -> Any:  # also the recomputation: the same choices
            ctx.use(choices)
            if device.type == "cpu":
                trim_host_heap()
            # the forward runs on the input it was given; only the recomputation reads the (offloaded) stored copy,
            # so an offloaded input is not copied to the host and straight back in the forward
            x = first.pop() if first else hidden.to(device, non_blocking=True)
            return original(x, *rest, **kw)

        device = hidden_states.device
        # a KV cache would be filled twice (forward and recomputation); training does not read it anyway
        args = list(args)
        for key, value in (("use_cache", False), ("past_key_values", None)):
            if key in names and names.index(key) < len(args):
                args[names.index(key)] = value
            else:
                kwargs[key] = value
        stored = to_host(hidden_states) if choices.offload else hidden_states
        if device.type == "cpu" and hidden_states.requires_grad:  # and once the layer's backward is done
            hidden_states.register_hook(_trim_after)
        return checkpoint(run, stored, *args, use_reentrant=False,
                          context_fn=_selective_contexts if choices.checkpoint == "selective" else noop_context_fn, **kwargs)
    return forward
