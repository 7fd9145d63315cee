"""Attention over a band ``lo <= k - q <= hi`` of a rectangle, for kernels that only know full and causal blocks.

The rectangle's queries are cut in tiles of ``TILE`` rows; for each tile the keys split into a middle
every query of the tile sees (one full call of the backend's fused kernel), the causal diagonal when
the band's upper edge is it (one causal call), and the edges, where the band cuts through: those
are at most ``TILE x TILE`` and go through :func:`masked_forward` / :func:`masked_backward`, exact
fp32 math on a mask built from the indices. Keys no query of a tile sees are never touched. The
``(out, lse)`` of the pieces of one tile are merged by the caller's LSE merge, exactly as ring blocks
are; rows that see no key of a piece get ``lse = -inf`` and zero output.

:func:`math_forward` / :func:`math_backward` compute a whole band in exact fp32 math tile by tile, for what the
fused kernels cannot do (attention logit soft-capping); v may have its own head dim (MLA) everywhere here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ds_usp.native.twins import TorchOps

_MERGE = TorchOps()  # the one LSE merge rule (stateless)

TILE = 512  # query rows per band tile: the masked edges are at most TILE x TILE


@dataclass(frozen=True)
class Piece:
    """A sub-rectangle of a band part, in the part's local rows: how to compute it."""

    q: slice
    k: slice
    kind: str  # "full", "causal" or "mask" (then ``lo <= k - q <= hi`` in the piece's own local rows)
    lo: Optional[int] = None
    hi: Optional[int] = None


def band_pieces(nq: int, nk: int, lo: Optional[int], hi: Optional[int], tile: int = TILE) -> list[Piece]:
    """Cut a band rectangle into full, causal and small masked pieces that hold exactly its allowed pairs.

    Args:
        nq: query rows.
        nk: key rows.
        lo: ``k - q >= lo`` (None: no bound).
        hi: ``k - q <= hi`` (None: no bound).
        tile: query rows per tile.

    Returns:
        The pieces (none for rows that see nothing).
    """
    pieces = []
    for a in range(0, nq, tile):
        b = min(a + tile, nq)
        k0 = 0 if lo is None else max(0, a + lo)  # keys some query of [a, b) sees
        k1 = nk if hi is None else min(nk, b - 1 + hi + 1)
        if k0 >= k1:
            continue
        m0 = k0 if lo is None else max(k0, b - 1 + lo)  # keys every query of [a, b) sees
        m1 = k1 if hi is None else min(k1, a + hi + 1)
        diagonal = hi is not None and 0 <= a + hi and b + hi <= nk and (lo is None or lo <= hi - (b - a - 1)) \
            and a + hi >= m0
        if diagonal:  # the band's upper edge is a causal square: keys [a + hi, b + hi)
            m1 = a + hi
        if m0 >= m1 and not diagonal:  # no key all of them see: one masked piece (at most tile x (tile + window))
            pieces.append(_edge(a, b, k0, k1, lo, hi))
            continue
        if k0 < min(m0, m1):
            pieces.append(_edge(a, b, k0, min(m0, m1), lo, hi))
        if m0 < m1:
            pieces.append(Piece(slice(a, b), slice(m0, m1), "full"))
        if diagonal:
            pieces.append(Piece(slice(a, b), slice(a + hi, b + hi), "causal"))
        elif m1 < k1:
            pieces.append(_edge(a, b, m1, k1, lo, hi))
    return pieces


def _edge(a: int, b: int, k0: int, k1: int, lo: Optional[int], hi: Optional[int]) -> Piece:
    """A masked piece of rows ``[a, b)`` x keys ``[k0, k1)``; the causal diagonal becomes a causal piece."""
    new_lo = None if lo is None else lo - (k0 - a)  # k - q in the piece's own rows
    new_hi = None if hi is None else hi - (k0 - a)
    if new_hi == 0 and b - a == k1 - k0 and (new_lo is None or new_lo <= -(b - a - 1)):
        return Piece(slice(a, b), slice(k0, k1), "causal")
    return Piece(slice(a, b), slice(k0, k1), "mask", new_lo, new_hi)


def band_mask(nq: int, nk: int, lo: Optional[int], hi: Optional[int], device: torch.device) -> Tensor:
    """``(nq, nk)`` bool: True where ``lo <= k - q <= hi``."""
    diff = torch.arange(nk, device=device).unsqueeze(0) - torch.arange(nq, device=device).unsqueeze(1)
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if lo is not None:
        keep &= diff >= lo
    if hi is not None:
        keep &= diff <= hi
    return keep


def _scores(q: Tensor, k: Tensor, keep: Tensor, scale: float, softcap: float = 0.0) -> tuple[Tensor, Optional[Tensor]]:
    """fp32 masked scores ``(b, hq, sq, sk)`` and, with a soft-cap ``c``, ``t = tanh(scale q.k / c)`` (the scores are
    then ``c t``); kv heads are repeated for GQA."""
    groups = q.shape[2] // k.shape[2]
    qh = q.float().transpose(1, 2)  # (b, sq, hq, d) -> (b, hq, sq, d)
    kh = k.float().repeat_interleave(groups, dim=2).transpose(1, 2)  # (b, sk, hkv, d) -> (b, hq, sk, d)
    s = qh @ kh.transpose(-2, -1) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    return s.masked_fill(~keep, float("-inf")), t


def masked_forward(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float,
                   softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention with an explicit ``(sq, sk)`` mask: ``out (b, sq, hq, dv)`` in q's dtype, ``lse (b, hq, sq)`` fp32.

    Rows with no allowed key get ``lse = -inf`` and zero output. ``softcap`` > 0 caps the scores at
    ``softcap * tanh(scores / softcap)`` (Gemma 2); ``v`` may have its own head dim (MLA).
    """
    groups = q.shape[2] // k.shape[2]
    s, _ = _scores(q, k, keep, scale, softcap)
    lse = torch.logsumexp(s, dim=-1)  # (b, hq, sq); -inf on empty rows
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    vh = v.float().repeat_interleave(groups, dim=2).transpose(1, 2)  # (b, sk, hkv, dv) -> (b, hq, sk, dv)
    return (p @ vh).transpose(1, 2).to(q.dtype), lse  # (b, hq, sq, dv) -> (b, sq, hq, dv)


def masked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, keep: Tensor,
                    scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`masked_forward` given the final (merged) ``out`` and ``lse`` of the rows.

    Returns:
        dq, dk, dv in the inputs' dtypes (dk, dv summed over each q-head group).
    """
    dq, dk, dv = _masked_grads(dout, q, k, v, out, lse, keep, scale, softcap)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _masked_grads(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, keep: Tensor,
                  scale: float, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``dq, dk, dv`` of one masked tile (dk, dv summed over each q-head group)."""
    groups = q.shape[2] // k.shape[2]
    s, t = _scores(q, k, keep, scale, softcap)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), float("inf")).unsqueeze(-1))  # (b, hq, sq, sk)
    do = dout.float().transpose(1, 2)  # (b, sq, hq, dv) -> (b, hq, sq, dv)
    vh = v.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    kh = k.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    dv = p.transpose(-2, -1) @ do  # (b, hq, sk, dv)
    delta = (do * out.float().transpose(1, 2)).sum(-1, keepdim=True)  # (b, hq, sq, 1)
    ds = p * (do @ vh.transpose(-2, -1) - delta) * scale
    if t is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2
        ds = ds * (1.0 - t * t)
    dq = (ds @ kh).transpose(1, 2)  # (b, hq, sq, d) -> (b, sq, hq, d)
    dk = (ds.transpose(-2, -1) @ q.float().transpose(1, 2)).transpose(1, 2)  # -> (b, sk, hq, d)

    def fold(x: Tensor) -> Tensor:  # (b, sk, hq, d) -> (b, sk, hkv, d): sum each q-head group
        b, sk, hq, d = x.shape
        return x.reshape(b, sk, hq // groups, groups, d).sum(3)

    return dq, fold(dk), fold(dv.transpose(1, 2))


# -------------------------------------------------- a whole band in tiles (kernels without a soft-cap)

MATH_TILE_Q, MATH_TILE_K = 256, 512  # one tile's fp32 scores: b x hq x 256 x 512


def _math_tiles(nq: int, nk: int, lo: Optional[int], hi: Optional[int]) -> list[tuple[slice, slice, Optional[int],
                                                                                      Optional[int]]]:
    """``(query rows, key rows, lo, hi)`` of every tile some pair of the band ``lo <= k - q <= hi`` falls in; the
    band edges in the tile's own rows (None where the whole tile is inside that edge)."""
    tiles = []
    for a in range(0, nq, MATH_TILE_Q):
        b = min(a + MATH_TILE_Q, nq)
        k0 = 0 if lo is None else max(0, a + lo)
        k1 = nk if hi is None else min(nk, b - 1 + hi + 1)
        for c in range((k0 // MATH_TILE_K) * MATH_TILE_K, k1, MATH_TILE_K):
            d = min(c + MATH_TILE_K, nk)
            t_lo = None if lo is None or c - (b - 1) >= lo else lo - (c - a)  # k - q in the tile's rows
            t_hi = None if hi is None or (d - 1) - a <= hi else hi - (c - a)
            tiles.append((slice(a, b), slice(c, d), t_lo, t_hi))
    return tiles


def math_forward(q: Tensor, k: Tensor, v: Tensor, lo: Optional[int], hi: Optional[int], scale: float,
                 softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """The band ``lo <= k - q <= hi`` of a rectangle in exact fp32 math, tile by tile (never ``sq x sk`` at once).

    For what the fused kernels cannot do (a soft-cap). Causal is ``(None, 0)``, full ``(None, None)``.

    Returns:
        out ``(b, sq, hq, dv)`` in q's dtype and lse ``(b, hq, sq)`` fp32 (``-inf`` and zeros on rows seeing nothing).
    """
    b, nq, hq, _ = q.shape
    out = torch.zeros(b, nq, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, nq), float("-inf"), dtype=torch.float32, device=q.device)
    for qs, ks, t_lo, t_hi in _math_tiles(nq, k.shape[1], lo, hi):
        keep = band_mask(qs.stop - qs.start, ks.stop - ks.start, t_lo, t_hi, q.device)
        tile_out, tile_lse = masked_forward(q[:, qs], k[:, ks], v[:, ks], keep, scale, softcap)
        _MERGE.merge_block_(out[:, qs], lse[:, :, qs], tile_out, tile_lse)
    return out.to(q.dtype), lse


def math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lo: Optional[int],
                  hi: Optional[int], scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`math_forward` given the final ``out``/``lse``, tile by tile.

    Returns:
        dq, dk, dv in the inputs' dtypes.
    """
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for qs, ks, t_lo, t_hi in _math_tiles(q.shape[1], k.shape[1], lo, hi):
        keep = band_mask(qs.stop - qs.start, ks.stop - ks.start, t_lo, t_hi, q.device)
        gq, gk, gv = _masked_grads(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs], keep, scale,
                                   softcap)
        dq[:, qs] += gq
        dk[:, ks] += gk
        dv[:, ks] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

