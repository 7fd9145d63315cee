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

import functools
import inspect
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from ds_usp.integration.step.choices import MemoryContext, trim_host_heap
from ds_usp.upstream.torch import tolerant_recompute

# ---------------------------------------------------------------------- activation checkpointing


def _keep_ring_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: keep the ring's (out, lse); recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.ds_usp.ring_attention.default \
        else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    """torch's selective-checkpointing contexts keeping the ring attention, the recomputation tolerant of ops the forward
    did not run (:func:`ds_usp.upstream.torch.tolerant_recompute`)."""
    forward, recompute = create_selective_checkpoint_contexts(_keep_ring_attention)
    return forward, tolerant_recompute(recompute)


class Offload:
    """Checkpointed layer inputs kept in pinned host memory, copied on a side stream (CUDA only).

    The forward's copy to the host runs on the side stream after the compute stream has produced the input
    (``record_stream`` keeps the input's memory until the copy is done), so it overlaps the next layers. In the
    backward, when layer ``i``'s recomputation starts, the input of layer ``i - 1`` (recomputed next) is already sent
    back on the side stream: its copy overlaps layer ``i``'s recomputation and backward, and the compute stream waits
    only for what is not there yet.
    """

    def __init__(self) -> None:
        self.stream: Any = None
        self.host: dict[int, Tensor] = {}  # layer -> its input on the host
        self.back: dict[int, tuple[Tensor, Any]] = {}  # layer -> (its input on the device, the copy's event)

    def _side(self) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    def store(self, layer: int, x: Tensor) -> Tensor:
        """Layer ``layer``'s input ``x`` sent to the host on the side stream: the host tensor, which autograd
        differentiates through (:class:`_ToHost`)."""
        return _ToHost.apply(x, self, layer)

    def send(self, layer: int, x: Tensor) -> Tensor:
        """The host copy of ``x`` (made on the side stream once the compute stream has produced ``x``)."""
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(x.device))
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
        x.record_stream(side)  # x's memory is not reused before the copy has read it
        self.host[layer] = host
        self.back.pop(layer, None)
        return host

    def prefetch(self, layer: int, device: torch.device) -> None:
        """Start sending layer ``layer``'s input back to ``device`` on the side stream (nothing when absent)."""
        host = self.host.get(layer)
        if host is None or layer in self.back:
            return
        side = self._side()
        with torch.cuda.stream(side):
            x = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        self.back[layer] = (x, event)

    def fetch(self, layer: int, host: Tensor, device: torch.device) -> Tensor:
        """Layer ``layer``'s input on ``device`` for its recomputation: the prefetched copy (the compute stream waits
        for it), else a copy now."""
        self.prefetch(layer, device)
        x, event = self.back.pop(layer, (None, None))
        self.host.pop(layer, None)
        if x is None:
            return host.to(device, non_blocking=True)
        torch.cuda.current_stream(device).wait_event(event)
        x.record_stream(torch.cuda.current_stream(device))
        return x


class _ToHost(torch.autograd.Function):
    """The host copy of ``x`` (:meth:`Offload.send`), whose gradient goes back to ``x``'s device."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, offload: Offload, layer: int) -> Tensor:
        ctx.device = x.device
        return offload.send(layer, x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad.to(ctx.device, non_blocking=True), None, None


def _trim_after(grad: Tensor) -> Tensor:
    trim_host_heap()
    return grad


def checkpointed_layer_forward(original: Callable, ctx: MemoryContext, layer: int) -> Callable:
    """The forward of decoder layer number ``layer``, checkpointed when the call's choices checkpoint it
    (:attr:`~ds_usp.integration.step.choices.StepChoices.checkpoint_layers`: the first ones), its input offloaded when
    they say so."""
    try:  # where a layer takes use_cache / past_key_values positionally (RecurrentGemma), they are replaced there
        names = [n for n in inspect.signature(original).parameters][1:]  # after hidden_states
    except (TypeError, ValueError):
        names = []

    @functools.wraps(original)
    def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        choices = ctx.choices
        if choices is None or not choices.checkpoint or layer >= choices.checkpoint_layers or \
                not torch.is_grad_enabled():
            return original(hidden_states, *args, **kwargs)

        first = [hidden_states]
        device = hidden_states.device
        offload = choices.offload and device.type == "cuda"

        def run(hidden: Tensor, *rest: Any, **kw: Any) -> Any:  # also the recomputation: the same choices
            ctx.use(choices)
            if device.type == "cpu":
                trim_host_heap()
            if first:  # the forward runs on the input it was given
                x = first.pop()
            elif offload:  # the recomputation: the input back from the host (sent ahead), the next one's sent now
                x = ctx.offload.fetch(layer, hidden, device)
                ctx.offload.prefetch(layer - 1, device)
            else:
                x = hidden
            return original(x, *rest, **kw)

        # a KV cache would be filled twice (forward and recomputation); training does not read it anyway
        args = list(args)
        for key, value in (("use_cache", False), ("past_key_values", None)):
            if key in names and names.index(key) < len(args):
                args[names.index(key)] = value
            else:
                kwargs[key] = value
        stored = ctx.offload.store(layer, hidden_states) if offload else hidden_states
        if device.type == "cpu" and hidden_states.requires_grad:  # and once the layer's backward is done
            hidden_states.register_hook(_trim_after)
        return checkpoint(run, stored, *args, use_reentrant=False,
                          context_fn=_selective_contexts if choices.checkpoint == "selective" else noop_context_fn,
                          **kwargs)
    return forward
