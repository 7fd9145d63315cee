"""The MLP of a decoder layer over sequence tiles, recomputed per tile in the backward (:class:`TiledMLP`).

Why not DeepSpeed's ``TiledMLP``: it cuts tiles with ``torch.chunk``, whose tile count depends on the length, so
under ZeRO-3 (a parameter gather per tile) replicas with different lengths would gather a different number of
times and hang. Its ideas are kept: recompute per tile, and ``ds_grad_is_ready`` so that ZeRO reduces a weight's
gradient once, after its last tile.

A gated MLP (``down(act(gate(x)) * up(x))``: Llama, Mistral, Qwen, Gemma...; :func:`gated_parts` checks the block
computes exactly that) is recomputed without ``down_proj``'s forward, which its backward does not need, and each tile's
input gradient is written into its slice of ``dx`` by the matmuls themselves: 11 matmuls per tile instead of 12,
and no copy. Any other feed-forward block (MoE, ungated) runs through autograd per tile.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_usp.upstream.deepspeed import set_grad_ready
from ds_usp.upstream.torch import no_checkpoint_policy

# -------------------------------------------------------------------------------------- tiled MLP


def tile_bounds(length: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` slices of ``[0, length)``, possibly empty at the end: the count never depends on the length."""
    step = max(1, math.ceil(length / tiles))
    return [(min(i * step, length), min((i + 1) * step, length)) for i in range(tiles)]


class GatedParts(NamedTuple):
    """The pieces of a gated MLP block: ``down(act(gate(x)) * up(x))``, no biases."""

    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear
    act: Callable[[Tensor], Tensor]


def gated_parts(block: nn.Module, forward: Callable[[Tensor], Tensor]) -> Optional[GatedParts]:
    """The block's gated-MLP pieces when ``forward`` computes exactly ``down(act(gate(x)) * up(x))`` (checked on a
    small random input, in fp32), else None.

    Args:
        block: a feed-forward block (its ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` are looked for).
        forward: its forward (before ds-usp wraps it).
    """
    parts = [getattr(block, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(block, "act_fn", None)
    if not all(isinstance(p, nn.Linear) and p.bias is None and p.weight.numel() for p in parts) or not callable(act):
        return None
    gate, up, down = parts
    try:
        with torch.no_grad():
            x = torch.randn(1, 3, gate.in_features, generator=torch.Generator().manual_seed(0)).to(gate.weight)
            want = forward(x)
            got = down(act(gate(x)) * up(x))
    except Exception:  # noqa: BLE001 - a block that cannot be probed this way takes the generic path
        return None
    same = isinstance(want, Tensor) and want.shape == got.shape and bool(torch.allclose(want, got, rtol=1e-3,
                                                                                        atol=1e-5))
    return GatedParts(gate, up, down, act) if same else None


class _KeepInput(torch.autograd.Function):
    """Saves the MLP's input and returns it (a view): its own Function so that the save is packed before the MLP
    runs. A checkpointed layer's recomputation stops once every saved tensor is back, and tensors saved by a
    Function are packed only when its ``forward`` returns: saved by :class:`TiledMLP` itself, ``x`` would come back
    only after every tile had run again, for nothing (the MLP's output is not saved)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _WeightGrad(torch.autograd.Function):
    """``x @ weight^T`` for autograd's sake only: its forward computes nothing (the caller has the product), its
    backward gives the weight its gradient ``grad^T x`` through autograd, so that ZeRO's gradient hooks see it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])  # no memory, no compute

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        (x,) = ctx.saved_tensors
        # (..., out) x (..., in) -> (out, in)
        return None, grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


def tiled_mlp(x: Tensor, mlp: Callable[[Tensor], Tensor], tiles: int, params: tuple,
              gated: Optional[GatedParts] = None) -> Tensor:
    """``mlp(x)`` over ``tiles`` sequence tiles (:class:`TiledMLP`), its input saved before the tiles run."""
    kept = torch.is_grad_enabled() and x.requires_grad
    return TiledMLP.apply(_KeepInput.apply(x) if kept else x, mlp, tiles, params, kept, gated)


class TiledMLP(torch.autograd.Function):
    """``mlp(x)`` over ``tiles`` sequence tiles; the backward recomputes one tile at a time.

    With ``kept``, ``x`` is the output of :class:`_KeepInput` (see :func:`tiled_mlp`), whose saved copy the backward
    reads, so a checkpointed layer's recomputation ends before the MLP runs again where nothing after it saves a
    tensor (a Llama layer); any other ``x`` is saved here. Under ZeRO every parameter of ``mlp`` is marked not ready
    (``ds_grad_is_ready``) until its last tile's gradient is in, so its gradient is reduced once. The tiles run
    outside selective checkpointing's dispatch modes (its policy would otherwise see each of their ops in Python).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, mlp: Callable[[Tensor], Tensor], tiles: int, params: tuple,
                kept: bool = False, gated: Optional[GatedParts] = None) -> Tensor:
        ctx.kept = x.grad_fn if kept else None  # _KeepInput's node, which holds x
        if ctx.kept is None:
            ctx.save_for_backward(x)
        ctx.mlp, ctx.tiles, ctx.params, ctx.gated = mlp, tiles, params, gated
        with no_checkpoint_policy():
            outs = [mlp(x[:, a:b]) for a, b in tile_bounds(x.shape[1], tiles)]
        if not isinstance(outs[0], Tensor):
            raise TypeError(f"usp.tiled_mlp: {getattr(mlp, '__qualname__', mlp)} returns a {type(outs[0]).__name__}, "
                            f"not a tensor, so its tiles cannot be joined; set usp.tiled_mlp to false")
        return torch.cat(outs, dim=1)  # (b, s, H)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        (x,) = ctx.kept.saved_tensors if ctx.kept is not None else ctx.saved_tensors
        ctx.kept = None
        dx = torch.empty_like(x)
        bounds = tile_bounds(x.shape[1], ctx.tiles)
        for i, (a, b) in enumerate(bounds):
            set_grad_ready(ctx.params, i == len(bounds) - 1)
            if a == b:
                continue
            if ctx.gated is not None:
                _gated_tile_backward(ctx.gated, x[:, a:b], grad[:, a:b], dx[:, a:b])
            else:
                xt = x[:, a:b].detach().requires_grad_(True)
                with torch.enable_grad():
                    yt = ctx.mlp(xt)
                torch.autograd.backward(yt, grad[:, a:b])
                dx[:, a:b] = xt.grad
        return dx, None, None, None, None, None


def _gated_tile_backward(parts: GatedParts, x: Tensor, grad: Tensor, dx: Tensor) -> None:
    """One tile of a gated MLP's backward: ``gate`` and ``up`` recomputed (not ``down``), the input gradient written
    into ``dx`` (the tile's slice) by two matmuls, the three weight gradients through autograd (:class:`_WeightGrad`).

    Args:
        parts: the block's pieces.
        x: ``(b, t, H)`` the tile's input.
        grad: ``(b, t, H)`` the gradient of the tile's output.
        dx: ``(b, t, H)`` where the tile's input gradient goes.
    """
    gate_w, up_w, down_w = parts.gate.weight, parts.up.weight, parts.down.weight
    x = x.detach()
    g = F.linear(x, gate_w).requires_grad_(True)  # (b, t, I)
    u = F.linear(x, up_w).requires_grad_(True)
    with torch.enable_grad():
        h = parts.act(g) * u  # (b, t, I)
    dh = F.linear(grad, down_w.t())  # (b, t, H) x (H, I) -> (b, t, I)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    # dx = dg W_gate + du W_up, straight into the tile's slice: (b*t, I) x (I, H)
    out = dx.view(-1, dx.shape[-1]) if dx.is_contiguous() else None
    if out is not None:
        torch.mm(dg.reshape(-1, dg.shape[-1]), gate_w, out=out)
        out.addmm_(du.reshape(-1, du.shape[-1]), up_w)
    else:  # a batch of several rows: the tile's slice is strided
        dx.copy_(torch.addmm(dg.reshape(-1, dg.shape[-1]).mm(gate_w), du.reshape(-1, du.shape[-1]), up_w)
                 .view_as(dx))
    with torch.enable_grad():
        outs = [_WeightGrad.apply(x, gate_w), _WeightGrad.apply(x, up_w), _WeightGrad.apply(h.detach(), down_w)]
    torch.autograd.backward(outs, [dg, du, grad])
