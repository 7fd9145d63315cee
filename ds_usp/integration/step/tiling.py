"""The MLP of a decoder layer over sequence tiles, recomputed per tile in the backward (:class:`TiledMLP`).

Why not DeepSpeed's ``TiledMLP``: it cuts tiles with ``torch.chunk``, whose tile count depends on the length, so
under ZeRO-3 (a parameter gather per tile) replicas with different lengths would gather a different number of
times and hang. Its ideas are kept: recompute per tile, and ``ds_grad_is_ready`` so that ZeRO reduces a weight's
gradient once, after its last tile.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

# -------------------------------------------------------------------------------------- tiled MLP


def tile_bounds(length: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` slices of ``[0, length)``, possibly empty at the end: the count never depends on the length."""
    step = max(1, math.ceil(length / tiles))
    return [(min(i * step, length), min((i + 1) * step, length)) for i in range(tiles)]


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


def tiled_mlp(x: Tensor, mlp: Callable[[Tensor], Tensor], tiles: int, params: tuple) -> Tensor:
    """``mlp(x)`` over ``tiles`` sequence tiles (:class:`TiledMLP`), its input saved before the tiles run."""
    kept = torch.is_grad_enabled() and x.requires_grad
    return TiledMLP.apply(_KeepInput.apply(x) if kept else x, mlp, tiles, params, kept)


class TiledMLP(torch.autograd.Function):
    """``mlp(x)`` over ``tiles`` sequence tiles; the backward recomputes one tile at a time.

    With ``kept``, ``x`` is the output of :class:`_KeepInput` (see :func:`tiled_mlp`), whose saved copy the backward
    reads, so a checkpointed layer's recomputation ends before the MLP runs again where nothing after it saves a
    tensor (a Llama layer); any other ``x`` is saved here. Under ZeRO every parameter of ``mlp`` is marked not ready
    (``ds_grad_is_ready``) until its last tile's gradient is in, so its gradient is reduced once.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, mlp: Callable[[Tensor], Tensor], tiles: int, params: tuple,
                kept: bool = False) -> Tensor:
        ctx.kept = x.grad_fn if kept else None  # _KeepInput's node, which holds x
        if ctx.kept is None:
            ctx.save_for_backward(x)
        ctx.mlp, ctx.tiles, ctx.params = mlp, tiles, params
        outs = [mlp(x[:, a:b]) for a, b in tile_bounds(x.shape[1], tiles)]
        if not isinstance(outs[0], Tensor):
            raise TypeError(f"usp.tiled_mlp: {getattr(mlp, '__qualname__', mlp)} returns a {type(outs[0]).__name__}, "
                            f"not a tensor, so its tiles cannot be joined; set usp.tiled_mlp to false")
        return torch.cat(outs, dim=1)  # (b, s, H)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        (x,) = ctx.kept.saved_tensors if ctx.kept is not None else ctx.saved_tensors
        ctx.kept = None
        dx = torch.zeros_like(x)
        bounds = tile_bounds(x.shape[1], ctx.tiles)
        for i, (a, b) in enumerate(bounds):
            for p in ctx.params:
                p.ds_grad_is_ready = i == len(bounds) - 1
            xt = x[:, a:b].detach().requires_grad_(True)
            with torch.enable_grad():
                yt = ctx.mlp(xt)
            torch.autograd.backward(yt, grad[:, a:b])
            dx[:, a:b] = xt.grad
        return dx, None, None, None, None
