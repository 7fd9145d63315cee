"""Mamba-1's selective scan over a sequence sharded across a USP topology (Mamba, Falcon-Mamba, Jamba).

    y = sharded_selective_scan(scan, u, dt, A, B, C, D, z, delta_bias, True, topo, layout="zigzag", seq_len=s)

Per channel ``d`` and state index ``n`` the scan is ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t`` (``dt`` after its
bias and softplus), ``y_t = C_t . h_t + D x_t``, gated by ``silu(z_t)``. Every channel is its own recurrence and
``B``, ``C`` are per token, so nothing needs an all-to-all: each rank scans its own tokens with every channel. The
transition is diagonal, so a segment started from ``h0`` ends in ``P * h0 + F`` and outputs
``y_t + C_t . (exp(A S_t) * h0)`` (``S_t`` the running sum of ``dt`` in the segment, ``P = exp(A S_end)``,
``F`` and ``y`` what the segment computes from zero). So

1. every rank runs the family's own scan (``scan``: transformers' torch loop on CPU, mamba_ssm's kernel on GPUs)
   on each of its segments (runs of its positions cut at document starts) from zero;
2. computes each segment's ``(P, F)`` in token chunks (stable: every exponent is <= 0) and all-gathers them over
   the sequence-parallel group (the gradient of the gathered ones summed back over the group);
3. combines, in global order, the initial state of each of its segments and adds ``C_t . (exp(A S_t) * h0)``
   (times ``silu(z_t)``) to the segment's outputs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_usp.attention.counter import count_sp_layer
from ds_usp.linear.conv import exchange
from ds_usp.linear.delta import Segment, row_groups, segments
from ds_usp.sharding import layout_bounds, normalize_docs, resolve_seq_len, shard_runs
from ds_usp.topology import USPTopology

CHUNK = 256  # tokens per step of the state sums: (b, CHUNK, d, N) floats at a time


@functools.lru_cache(maxsize=64)
def _rank_segments(padded: int, u: int, r: int, layout: str, starts: tuple[int, ...], real_len: int,
          bounds: Optional[tuple[int, ...]]) -> tuple[tuple[Segment, ...], ...]:
    """Every SP rank's segments (its runs cut at document starts and at the real end), in shard order (``bounds``:
    the balanced layout's, else None)."""
    return tuple(segments(shard_runs(padded, u, r, i, layout, bounds), starts, real_len) for i in range(u * r))


def _pass_states(parts: list[Tensor], segs: tuple[tuple[Segment, ...], ...],
                 topo: USPTopology) -> tuple[list[Optional[Tensor]], Tensor]:
    """Exchange this rank's segments' ``(P, F)`` (``parts``, each ``stack([P, F])``) over the SP group and combine
    the initial state of each of its segments.

    Returns:
        ``(its segments' initial states (None: zero), a zero to add to the outputs)``: every rank must reach the
        exchange's backward (a collective), even one whose segments all start from zero and read nothing, so the
        gathered states take part in every rank's outputs with weight 0.
    """
    count = max(len(p) for p in segs)
    mine = torch.stack(parts + [torch.zeros_like(parts[0])] * (count - len(parts)))
    every = exchange(mine, topo)  # (n, count, 2, ...)
    h0 = _initial_states(segs, every)
    return [h0[(topo.sp_rank, i)] for i in range(len(parts))], every.sum() * 0


def _initial_states(segs: tuple[tuple[Segment, ...], ...], every: Tensor) -> dict[tuple[int, int], Optional[Tensor]]:
    """Each segment's initial state (None: zero, at a document start), keyed ``(rank, index)``, from every segment's
    ``(P, F)`` (``every[rank, index]``): in global order, ``h0 = P_prev * h0_prev + F_prev`` (diagonal transitions)."""
    h0: dict[tuple[int, int], Optional[Tensor]] = {}
    prev: Optional[tuple[int, int]] = None
    for _, rank, i in sorted((seg.start, rank, i) for rank, p in enumerate(segs) for i, seg in enumerate(p)):
        if segs[rank][i].first or prev is None:
            h0[(rank, i)] = None
        else:
            before, (p_prev, f_prev) = h0[prev], every[prev[0], prev[1]]
            h0[(rank, i)] = f_prev if before is None else p_prev * before + f_prev
        prev = (rank, i)
    return h0


def _state_sums(dt: Tensor, x: Tensor, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(S (b, d, t) running sums of dt, P (b, d, N), F (b, d, N))`` of one segment from zero (fp32 or fp64)."""
    s = torch.cumsum(dt, dim=-1)
    end = s[..., -1:]  # (b, d, 1)
    final = dt.new_zeros(*dt.shape[:2], A.shape[-1])
    for a in range(0, dt.shape[-1], CHUNK):
        part = slice(a, a + CHUNK)
        decay = torch.exp(A[None, :, None, :] * (end - s[..., part])[..., None])  # (b, d, t, N), exponents <= 0
        final = final + torch.einsum("bdtn,bdt,bnt->bdn", decay, dt[..., part] * x[..., part], B[..., part])
    return s, torch.exp(A[None] * end), final


def _from_state(s: Tensor, A: Tensor, C: Tensor, h0: Tensor) -> Tensor:
    """``(b, d, t)``: the outputs' part from the initial state ``h0`` (b, d, N): ``C_t . (exp(A S_t) * h0)``."""
    parts = [torch.einsum("bdtn,bnt,bdn->bdt", torch.exp(A[None, :, None, :] * s[..., a:a + CHUNK, None]),
                          C[..., a:a + CHUNK], h0) for a in range(0, s.shape[-1], CHUNK)]
    return torch.cat(parts, dim=-1)


def sharded_selective_scan(scan: Callable[..., Tensor], x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Optional[Tensor], z: Optional[Tensor], delta_bias: Optional[Tensor],
                           delta_softplus: bool, topo: USPTopology, *, layout: str = "zigzag",
                           seq_len: Optional[int] = None,
                           doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None] = None,
                           **scan_kwargs: Any) -> Tensor:
    """Mamba-1's selective scan of this rank's shard, exact over the whole sequence (each document from zero).

    Args:
        scan: the family's ``mamba_selective_scan`` (its arguments as below), run on each segment from zero.
        x: ``(b, d, s_local)`` the inputs (after the convolution).
        dt: ``(b, d, s_local)`` the steps before ``delta_bias`` and softplus.
        A: ``(d, N)`` (negative).
        B: ``(b, N, s_local)``.
        C: ``(b, N, s_local)``.
        D: ``(d,)`` the skip, or None.
        z: ``(b, d, s_local)`` the gate (``silu(z)`` multiplies the outputs), or None.
        delta_bias: ``(d,)`` or None.
        delta_softplus: softplus on ``dt + delta_bias``.
        topo: the topology.
        layout: how the sequence was sharded.
        seq_len: the real global length (None: no padding).
        doc_lens: packed documents over the global sequence.
        **scan_kwargs: passed on to ``scan`` (``use_mambapy``...).

    Returns:
        ``(b, d, s_local)`` as ``scan`` returns them.
    """
    count_sp_layer()
    u, r = topo.ulysses_degree, topo.ring_degree
    b = x.shape[0]
    real_len, padded = resolve_seq_len(seq_len, x.shape[-1], u, r, layout)
    docs = normalize_docs(doc_lens, b, real_len)
    bounds = layout_bounds(layout, doc_lens, real_len, padded)
    step = dt if delta_bias is None else dt + delta_bias.to(dt.dtype)[..., None]
    step = (F.softplus(step) if delta_softplus else step).to(torch.promote_types(dt.dtype, torch.float32))
    outs = []
    for rows, starts in row_groups(docs):
        segs = _rank_segments(padded, u, r, layout, starts, real_len, bounds)
        mine = segs[topo.sp_rank]
        ys, sums, parts = [], [], []
        for seg in mine:
            at = slice(seg.row, seg.row + seg.length)
            cut = [None if t is None else t[rows, ..., at] for t in (x, dt, B, C, z)]
            ys.append(scan(cut[0], cut[1], A, cut[2], cut[3], D=D, z=cut[4], delta_bias=delta_bias,
                           delta_softplus=delta_softplus, return_last_state=False, **scan_kwargs))
            s, p, f = _state_sums(step[rows, ..., at], cut[0].to(step.dtype), A.to(step.dtype), cut[2].to(step.dtype))
            sums.append(s)
            parts.append(torch.stack([p, f]))
        h0, zero = _pass_states(parts, segs, topo)
        ys[0] = ys[0] + zero.to(ys[0].dtype)
        row_out = []
        for seg, y, s, state in zip(mine, ys, sums, h0):
            if state is not None:
                at = slice(seg.row, seg.row + seg.length)
                extra = _from_state(s, A.to(step.dtype), C[rows, ..., at].to(step.dtype), state)
                if z is not None:
                    extra = extra * F.silu(z[rows, ..., at].to(step.dtype))
                y = (y.to(step.dtype) + extra).to(y.dtype)
            row_out.append(y)
        outs.append(torch.cat(row_out, dim=-1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def sharded_linear_recurrence(scan: Callable[[Tensor, Tensor], Tensor], u: Tensor, a: Tensor, topo: USPTopology, *,
                              layout: str = "zigzag", seq_len: Optional[int] = None,
                              doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None] = None) -> Tensor:
    """``h_t = a_t * h_{t-1} + u_t`` (elementwise, one state per channel) over this rank's shard, exact over the
    whole sequence: RecurrentGemma's RG-LRU (its resets folded into ``a`` as zeros).

    Each segment (a run of the rank's positions; the documents only place the balanced layout's shards: the
    recurrence resets where ``a`` is zero) runs ``scan(u, a)`` from zero; its ``(prod a, last h)`` are exchanged
    over the SP group, and the initial state's part ``cumprod(a)_t * h0`` is added, in fp32.

    Args:
        scan: the family's scan from a zero state, ``(b, t, d), (b, t, d) -> (b, t, d)``.
        u: ``(b, s_local, d)`` the inputs.
        a: ``(b, s_local, d)`` the decays (zero where the state resets).
        topo: the topology.
        layout: how the sequence was sharded.
        seq_len: the real global length (None: no padding).
        doc_lens: packed documents (used to place the balanced layout's shards only).

    Returns:
        ``(b, s_local, d)`` as ``scan`` returns them.
    """
    count_sp_layer()
    u_, r_ = topo.ulysses_degree, topo.ring_degree
    real_len, padded = resolve_seq_len(seq_len, u.shape[1], u_, r_, layout)
    bounds = layout_bounds(layout, doc_lens, real_len, padded)
    segs = _rank_segments(padded, u_, r_, layout, (0,), padded, bounds)  # no cuts: the resets are in ``a``
    mine = segs[topo.sp_rank]
    acc = torch.promote_types(u.dtype, torch.float32)
    ys, decays, parts = [], [], []
    for seg in mine:
        at = slice(seg.row, seg.row + seg.length)
        y = scan(u[:, at], a[:, at])
        decay = torch.cumprod(a[:, at].to(acc), dim=1)
        ys.append(y)
        decays.append(decay)
        parts.append(torch.stack([decay[:, -1], y[:, -1].to(acc)]))
    h0, zero = _pass_states(parts, segs, topo)
    ys[0] = ys[0] + zero.to(ys[0].dtype)
    out = [y if state is None else (y.to(acc) + decay * state[:, None]).to(y.dtype)
           for y, decay, state in zip(ys, decays, h0)]
    return torch.cat(out, dim=1)
