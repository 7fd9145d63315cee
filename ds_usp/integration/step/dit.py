"""The memory stack of a sharded diffusion transformer, applied from outside (:func:`apply_dit_memory`).

The same features and the same choice as a causal LM's step (:mod:`.choices`: the fastest that fit the rank's
budget, by the one cost model), on a DiT's blocks:

* per-block activation checkpointing: ``"selective"`` keeps the ring attention's output and LSE (the policy of
  :mod:`.recompute`) and recomputes the projections, norms and feed-forward; ``"full"`` recomputes the block. The
  checkpoint wraps the block's ``forward``, inside the block's call, so the sharding hooks have already cut its inputs
  (the checkpoint keeps the rank's part) and its recomputation runs with the forward's streams and masks;
* each feed-forward block (diffusers' ``FeedForward``) over sequence tiles, recomputed per tile (:mod:`.tiling`);
* no chunked loss (the model has no vocabulary head: the user's loss is on the whole output) and no offload of
  block inputs (a DiT block takes two streams; refused when forced).

The choice is made once per forward, at its first block, from the tokens each rank holds over all streams.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from ds_usp.cost import ModelShape
from ds_usp.integration.models.diffusion import DiTContext, FamilyPlan
from ds_usp.integration.models.diffusion.shape import dit_shape, feed_forward_modules
from ds_usp.integration.step.choices import MemoryContext, MemorySettings, trim_host_heap
from ds_usp.integration.step.recompute import Offload, _selective_contexts
from ds_usp.integration.step.tiling import tiled_mlp
from ds_usp.upstream.torch import replace_forward
from ds_usp.log import log_rank0
from ds_usp.topology import USPTopology


def apply_dit_memory(model: nn.Module, plan: FamilyPlan, dit: DiTContext, settings: MemorySettings,
                     topo: USPTopology, zero3: bool) -> MemoryContext:
    """Wrap a sharded DiT's blocks with per-block checkpointing and its feed-forward blocks with tiling, chosen per
    forward by the cost model.

    Args:
        model: the diffusers model, sharded by :func:`ds_usp.integration.models.diffusion.shard_diffusion_model`.
        plan: its family's plan (its block lists).
        dit: its context.
        settings: the ``usp`` memory keys.
        topo: the topology.
        zero3: ZeRO-3 is on (the choice is agreed over the ranks; tiled feed-forward blocks become ZeRO-3 leaves).

    Returns:
        The memory context (``engine.usp.memory``; its ``choices`` are the last forward's).

    Raises:
        ValueError: ``usp.chunked_loss`` or ``usp.offload_activations`` set to true (a DiT has no loss head, and its
            block inputs are not offloaded).
    """
    why = {"chunked_loss": "it has no vocabulary head to chunk", "offload_activations": "its block inputs are not "
           "offloaded (a block takes two streams)"}
    for key, reason in why.items():
        if getattr(settings, key) is True:
            raise ValueError(f"usp.{key} is true, but {type(model).__name__} is a diffusion transformer: {reason}; "
                             f"set it to 'auto' or false")
    settings = settings.model_copy(update={"chunked_loss": False, "offload_activations": False})
    shape: ModelShape = dit_shape(model, plan)
    ctx = MemoryContext(settings=settings, fallback_topo=topo, layout="contiguous", hidden=shape.hidden,
                        intermediate=shape.mlp_width, vocab=shape.vocab, layers=shape.attention_layers, zero3=zero3,
                        usp=None, shape=shape, offload=Offload())
    if getattr(model, "gradient_checkpointing", False) and settings.activation_checkpointing is not False:
        model.disable_gradient_checkpointing()  # ours keeps the attention's output; two nested would recompute twice
        log_rank0("diffusers gradient checkpointing is replaced by usp.activation_checkpointing (set it to false to "
                  "keep diffusers')")
    index = 0
    for name in plan.blocks:
        for block in getattr(model, name):
            replace_forward(block, checkpointed_block_forward(block.forward, ctx, dit, index))
            index += 1
            for ff in feed_forward_modules(block):
                replace_forward(ff, _tiled_forward(ff.forward, tuple(ff.parameters()), ctx))
                if zero3 and settings.tiled_mlp is not False:
                    from deepspeed.utils import set_z3_leaf_module

                    set_z3_leaf_module(ff, True)  # gathered once per call, not at every tile
    return ctx


def _first_tensor(args: tuple, kwargs: dict) -> Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.is_floating_point():
            return value
    raise ValueError("a diffusion transformer block was called without a floating-point tensor")


def checkpointed_block_forward(original: Callable, ctx: MemoryContext, dit: DiTContext, index: int) -> Callable:
    """The forward of block number ``index`` (over all block lists, in call order): the forward's memory features are
    chosen at its first block; the block is checkpointed when they checkpoint it (the first ones)."""
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = dit.call
        if call.memory is None:
            x = _first_tensor(args, kwargs)
            tokens = x.shape[0] * sum(stream.chunk for stream in call.streams.values())
            call.set_memory(ctx.choose(tokens, x.device, x.dtype))
        choices = call.memory
        ctx.use(choices)  # the tiled feed-forward blocks read them
        if not choices.checkpoint or index >= choices.checkpoint_layers or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        device = _first_tensor(args, kwargs).device

        def run(*a: Any, **kw: Any) -> Any:  # also the recomputation: this forward's streams and choices
            dit.use(call)
            ctx.use(choices)
            if device.type == "cpu":
                trim_host_heap()
            return original(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False,
                          context_fn=_selective_contexts if choices.checkpoint == "selective" else noop_context_fn,
                          **kwargs)
    return forward


def _tiled_forward(original: Callable[..., Tensor], params: tuple, ctx: MemoryContext) -> Callable:
    @functools.wraps(original)
    def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        tiles = ctx.choices.mlp_tiles if ctx.choices is not None else 0
        if not tiles or args or kwargs or hidden_states.dim() != 3:
            return original(hidden_states, *args, **kwargs)
        return tiled_mlp(hidden_states, original, tiles, params)
    return forward


def memory_summary(ctx: Optional[MemoryContext]) -> str:
    """The last forward's features in words (the example's log line)."""
    if ctx is None or ctx.choices is None:
        return "no memory features chosen yet"
    return ctx.choices.describe(ctx.layers)
