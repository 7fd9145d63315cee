"""Activation checkpointing of decoder layers, selective or full, with the kept layer inputs optionally offloaded.

``"selective"`` keeps the ring attention's output and LSE (a custom op, kept by torch's selective checkpointing
policy) so the backward recomputes only the projections, norms and the cheap all-to-alls, never the attention
itself; ``"full"`` recomputes everything (ALST's way, the least memory). Offload: the checkpointed hidden states
(each layer's input) wait for the backward in host memory (a copy to ``cpu`` and back, so a no-op on CPU).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

from ds_usp.integration.step_plan import MemoryContext

# ---------------------------------------------------------------------- activation checkpointing


def _keep_ring_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: keep the ring's (out, lse); recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.ds_usp.ring_attention.default \
        else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _keep_ring_attention)


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


def checkpointed_layer_forward(original: Callable, ctx: MemoryContext) -> Callable:
    @functools.wraps(original)
    def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        plan = ctx.plan
        if plan is None or not plan.checkpoint or not torch.is_grad_enabled():
            return original(hidden_states, *args, **kwargs)

        def run(hidden: Tensor, *rest: Any, **kw: Any) -> Any:  # also the recomputation: the same plan
            ctx.plan = plan
            return original(hidden.to(device), *rest, **kw)

        device = hidden_states.device
        # a KV cache would be filled twice (forward and recomputation); training does not read it anyway
        kwargs.update(use_cache=False, past_key_values=None)
        stored = to_host(hidden_states) if plan.offload else hidden_states
        return checkpoint(run, stored, *args, use_reentrant=False,
                          context_fn=_SELECTIVE if plan.checkpoint == "selective" else noop_context_fn, **kwargs)
    return forward
