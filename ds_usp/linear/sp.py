"""Gated DeltaNet (and its kin: KDA's per-channel decays, Mamba-2's scan) over a sequence sharded across a USP
topology: Ulysses for heads, state passing across the ring.

    out = gated_delta_attention(q, k, v, g, beta, conv_weight, conv_bias, topo, rule, F.silu, layout="zigzag")

1. **Ulysses** (U > 1): the all-to-all softmax attention uses (``ds_usp::seq_to_head``) gives each rank the whole
   ring piece of its Ulysses group for ``1/U`` of the linear heads: key heads and their value heads together
   (value head ``j`` belongs to key head ``j // (nv / nk)``, so contiguous blocks of both match). The short
   convolution is per channel, so each rank convolves its heads' channels with its slice of the filter.
2. **Ring** (R > 1): every rank cuts its piece into segments (:func:`ds_usp.linear.delta.segments`: at document
   starts, and between a zigzag piece's two runs), and
   a. exchanges each segment's last ``K - 1`` inputs (one all-gather over the ring): every segment gets its
      convolution halo from the segments before it in global order;
   b. runs every segment from a zero state in parallel, with its response to the initial state and its
      transition (:func:`ds_usp.linear.delta.run_segment`: one kernel call);
   c. exchanges ``(transition, final state)`` of every segment (one all-gather, ``dk x (dk + dv)`` per head and
      segment); every rank combines the prefix of the segments before its own in global order and corrects its
      outputs (:func:`ds_usp.linear.delta.initial_states`).
   The ring part is one autograd node (:class:`_StatePassing`): its backward sums every rank's gradient of each
   rank's halos and states over the ring (so the gradients that flow through them reach the ranks that produced
   them) in a fixed order on every rank.
3. The outputs go back to this rank's sequence shard through the inverse all-to-all.

Around it, the all-to-alls are custom ops with their derivatives; the family's own kernel
(``rule``: transformers' torch chunked rule on CPU, flash-linear-attention's on GPUs) runs the recurrence.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_usp.attention.counter import count_sp_layer
from ds_usp.attention.usp import as_units, head_to_seq_op, seq_to_head_op
from ds_usp.comm import all_gather_rows, all_reduce_sum_
from ds_usp.linear.delta import (Rule, Segment, SegmentRun, causal_conv, halo_of, initial_states, row_groups,
                                 run_segment, segments, state_dtype, with_initial_state)
from ds_usp.native import check_native_op
from ds_usp.sharding import check_layout, normalize_docs, piece_runs, resolve_seq_len, segment_bounds
from ds_usp.splits import gqa_compatible, key_head_offset, kv_replication, linear_heads_fit, local_heads
from ds_usp.topology import USPTopology


def check_linear_heads(num_k_heads: int, num_v_heads: int, ulysses_degree: int) -> None:
    """Check that the linear heads can be spread over a Ulysses group.

    Each Ulysses rank takes ``nv / U`` value heads and the key heads they belong to: whole key heads when ``U``
    divides ``nk``, else (``nk`` divides ``U``) each key head goes to the ``U / nk`` ranks of its value heads.

    Args:
        num_k_heads: key (and query) heads of the linear-attention layer.
        num_v_heads: value heads (a multiple of the key heads).
        ulysses_degree: U.

    Raises:
        ValueError: naming the counts and what would be valid.
    """
    if not gqa_compatible(num_v_heads, num_k_heads):
        raise ValueError(f"linear-attention value heads ({num_v_heads}) must be a multiple of its key heads "
                         f"({num_k_heads})")
    if not linear_heads_fit(num_k_heads, num_v_heads, ulysses_degree):
        raise ValueError(f"linear-attention heads ({num_k_heads} key, {num_v_heads} value) and ulysses_degree "
                         f"({ulysses_degree}) are incompatible: ulysses_degree must divide the value heads and be a "
                         f"multiple or a divisor of the key heads; put the rest in ring_degree")


@functools.lru_cache(maxsize=64)
def _channels(num_k_heads: int, dk: int, num_v_heads: int, dv: int, ulysses_rank: int, ulysses_degree: int,
              device: torch.device) -> Tensor:
    """The convolution channels ``[q | k | v]`` (head-major) of this Ulysses rank's heads, made on ``device`` (no copy
    from the host) once per layer shape, rank and device: the layers read it, never write it."""
    hk, hv, key_dim = local_heads(num_k_heads, ulysses_degree), num_v_heads // ulysses_degree, num_k_heads * dk
    q0, v0 = key_head_offset(num_k_heads, ulysses_rank, ulysses_degree) * dk, ulysses_rank * hv * dv
    with torch.inference_mode(False):  # kept across calls: a normal tensor, whatever mode the first call ran in
        return torch.cat([torch.arange(q0, q0 + hk * dk, device=device),
                          torch.arange(key_dim + q0, key_dim + q0 + hk * dk, device=device),
                          torch.arange(2 * key_dim + v0, 2 * key_dim + v0 + hv * dv, device=device)])


def gated_delta_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                          conv_bias: Optional[Tensor], topo: USPTopology, rule: Rule,
                          activation: Callable[[Tensor], Tensor], *, layout: str = "zigzag",
                          seq_len: Optional[int] = None,
                          doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None] = None,
                          native_op: Union[bool, str] = "auto") -> Tensor:
    """The convolution and gated delta rule of a Gated DeltaNet layer over a sequence sharded across ``topo``.

    Exact: the same outputs (and gradients) as the layer's own computation on the whole sequence, each document
    from a zero state and a zero convolution history.

    Args:
        q: ``(b, s_local, nk, dk)`` this rank's shard, after the input projection, before the convolution.
        k: ``(b, s_local, nk, dk)``.
        v: ``(b, s_local, nv, dv)``; ``nv % nk == 0``.
        g: ``(b, s_local, nv)`` fp32 log decays, one per head and token (Gated DeltaNet), or ``(b, s_local, nv,
            m)``: what the ``rule`` reads per token and head (Kimi Delta Attention: one decay per key channel;
            Mamba-2: ``[dt | D]``); it takes them as they are.
        beta: ``(b, s_local, nv)``.
        conv_weight: ``(2 nk dk + nv dv, K)`` the depthwise filter over the channels ``[q | k | v]``.
        conv_bias: ``(2 nk dk + nv dv,)`` or None.
        topo: the topology.
        rule: the family's delta rule (:data:`ds_usp.linear.delta.Rule`).
        activation: after the convolution (SiLU).
        layout: how the sequence was sharded (``"contiguous"``, ``"zigzag"``, ``"balanced"``).
        seq_len: the real global length (None: no padding).
        doc_lens: packed documents over the global sequence (as for :func:`ds_usp.usp_attention`).
        native_op: ``usp.native_op`` for the all-to-all's packing.

    Returns:
        ``(b, s_local, nv, dv)`` the core outputs (before the gated norm), in ``v``'s dtype.

    Raises:
        ValueError: head counts the Ulysses degree cannot split, or a bad layout / length / documents.
    """
    count_sp_layer()
    u, r = topo.ulysses_degree, topo.ring_degree
    nk, dk, nv, dv = k.shape[2], k.shape[3], v.shape[2], v.shape[3]
    check_linear_heads(nk, nv, u)
    check_layout(layout)
    check_native_op(native_op)
    real_len, padded = resolve_seq_len(seq_len, q.shape[1], u, r, layout)
    docs = normalize_docs(doc_lens, q.shape[0], real_len)
    native = str(native_op).lower()
    ulysses, ring_name, _ = topo.group_names
    rep = kv_replication(nk, u)
    hk = local_heads(nk, u)  # key heads per Ulysses rank
    if u > 1:  # sequence shards -> head shards of the Ulysses group's ring piece
        unit = math.gcd(dk, dv)
        if rep > 1 and unit != dk:  # units of one head would be replicated apart: replicate whole heads first
            q, k, rep = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), 1
        qkv = seq_to_head_op([as_units(x, unit) for x in (q, k, v)], [rep, rep, 1], ulysses, native, "input")
        big = qkv.shape[1]
        q, k, v = (part.reshape(q.shape[0], big, -1, d) for part, d in
                   zip(qkv.split([hk * dk // unit, hk * dk // unit, nv * dv // u // unit], dim=2), (dk, dk, dv)))
        wide = torch.promote_types(g.dtype, beta.dtype)  # one all-to-all for both, neither rounded
        per_token = g.dim() == 3  # one log decay per head (GDN), else m values per head (KDA, Mamba-2)
        gb = torch.cat([g.to(wide).unsqueeze(-1) if per_token else g.to(wide), beta.to(wide).unsqueeze(-1)], -1)
        gb = seq_to_head_op([gb], [1], ulysses, native, "input")  # (b, U*s, nv/U, (1 or m) + 1)
        g, beta = (gb[..., 0] if per_token else gb[..., :-1]).to(g.dtype), gb[..., -1].to(beta.dtype)
    channels = _channels(nk, dk, nv, dv, topo.ulysses_rank, u, conv_weight.device)
    weight = conv_weight.reshape(conv_weight.shape[0], -1).index_select(0, channels)  # (C_local, K)
    bias = None if conv_bias is None else conv_bias.index_select(0, channels)
    x = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)  # (b, T, C_local): the convolution's input
    bounds = segment_bounds(docs, real_len, padded)
    rank_runs = [piece_runs(padded, r, i, layout, bounds) for i in range(r)]
    groups = row_groups(docs)
    outs = [_StatePassing.apply(x[rows], g[rows], beta[rows], weight, bias,
                                _RowsSpec(rule, activation, tuple(segments(p, starts, real_len) for p in rank_runs),
                                          topo.ring_rank, r, topo.ring_group, (hk, dk, nv // u, dv)))
            for rows, starts in groups]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # (b, T, nv/U, dv); row groups are rows in order
    if u > 1:  # head shards -> this rank's sequence shard
        out = head_to_seq_op(out, [nv // u], [1], ulysses, native, "input")[0]
    return out


@dataclass(frozen=True)
class _RowsSpec:
    """What :class:`_StatePassing` needs besides tensors: the segments of every ring rank and the layer's functions."""

    rule: Rule
    activation: Callable[[Tensor], Tensor]
    segs: tuple[tuple[Segment, ...], ...]
    ring_rank: int
    ring: int
    group: Any
    dims: tuple[int, int, int, int]  # key heads, dk, value heads, dv of this rank


class _StatePassing(torch.autograd.Function):
    """The ring part of one row group: halos, segment runs, state exchange, corrected outputs.

    One autograd node, so that every rank runs its collectives in the same order in the backward too: the
    segments differ from rank to rank, and left to autograd, ranks would reach the ring's all-gathers, the
    Ulysses all-to-alls and ZeRO's reductions in different orders and wait on each other forever. The forward
    runs without a graph and keeps its inputs and the two gathered tensors (halos and states, small); the backward
    recomputes the rank's own part with a graph, then sums the gradients of the gathered parts over the ring in a
    fixed order: the states' first (they came last), then the halos'.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, g: Tensor, beta: Tensor, weight: Tensor, bias: Optional[Tensor],
                spec: _RowsSpec) -> Tensor:
        with torch.no_grad():
            out, _, _, halos, states = _ring_rows(x, g, beta, weight, bias, spec)
        ctx.spec = spec
        ctx.save_for_backward(x, g, beta, weight, bias, halos, states)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        spec = ctx.spec
        *inputs, halos, states = ctx.saved_tensors
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
        halos, states = halos.detach().requires_grad_(), states.detach().requires_grad_()
        with torch.enable_grad():
            out, tails, parts, _, _ = _ring_rows(*leaves, spec, halos, states)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = _grad([out], [dout], wanted + [halos, states])
        # the ring's sums, in a fixed order: each rank's states and halos got gradients on every rank
        d_parts = _ring_sum(grads.pop(), spec)
        more = _grad([parts], [d_parts], wanted + [halos])
        d_tails = _ring_sum(grads.pop() + more.pop(), spec)
        last = _grad([tails], [d_tails], wanted)
        total = iter([a + b + c for a, b, c in zip(grads, more, last)])
        return tuple(next(total) if t is not None and t.requires_grad else None for t in leaves) + (None,)


def _grad(outputs: list[Tensor], grads: list[Tensor], inputs: list[Tensor]) -> list[Tensor]:
    """``d outputs / d inputs`` (zeros where unused), keeping the graph."""
    if not outputs[0].requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    found = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if d is None else d for d, t in zip(found, inputs)]


def _ring_sum(grad: Tensor, spec: _RowsSpec) -> Tensor:
    """This rank's part of a gathered tensor's gradient summed over the ring (every rank used every part)."""
    if spec.ring > 1:
        all_reduce_sum_(grad, spec.group, "linear-attention state backward")
    return grad[spec.ring_rank]


def _gather(parts: list[Tensor], template: Tensor, count: int, spec: _RowsSpec,
            gathered: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(this rank's parts zero-padded to count, every ring rank's: (R, count, ...))``; ``gathered`` given (the
    backward's recomputation): it stands for the all-gather (no graph through the collective: see the caller)."""
    mine = torch.stack(parts + [torch.zeros_like(template)] * (count - len(parts)))
    if gathered is not None:
        return mine, gathered
    if spec.ring == 1:
        return mine, mine.unsqueeze(0)
    return mine, torch.stack(all_gather_rows(mine.detach().contiguous(), spec.group, "linear-attention state"))


def _ring_rows(x: Tensor, g: Tensor, beta: Tensor, weight: Tensor, bias: Optional[Tensor], spec: _RowsSpec,
               halos: Optional[Tensor] = None, states: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """Rows sharing one document layout: halos, segment runs, state exchange, corrected outputs in piece order.

    With ``halos`` / ``states`` given (the backward), they stand for the all-gathers.

    Returns:
        ``(out (b, T, hv, dv), my tails, my states, every rank's tails, every rank's states)``.
    """
    hk, dk, hv, dv = spec.dims
    segs, ring_rank = spec.segs, spec.ring_rank
    kernel = weight.shape[1]
    mine = segs[ring_rank]
    count = max(len(p) for p in segs)
    order = sorted(((seg.start, rank, i) for rank, p in enumerate(segs) for i, seg in enumerate(p)))
    position = {(rank, i): n for n, (_, rank, i) in enumerate(order)}
    continued = {n for n in range(1, len(order)) if not segs[order[n][1]][order[n][2]].first}  # n continues n-1

    # a. halos: every segment's last K-1 inputs, gathered over the ring
    b = x.shape[0]
    template = x.new_zeros(b, kernel - 1, x.shape[2])
    tails = [F.pad(x[:, s.row + max(0, s.length - kernel + 1):s.row + s.length],
                   (0, 0, kernel - 1 - min(s.length, kernel - 1), 0)) for s in mine]
    my_tails, gathered = _gather(tails, template, count, spec, halos)  # (R, count, b, K-1, C)
    runs: list[SegmentRun] = []
    for i, seg in enumerate(mine):
        n = position[(ring_rank, i)]
        earlier: list = []
        for m in range(n - 1, -1, -1):  # the segments before it in its document, nearest last
            if m + 1 not in continued:
                break
            rank, j = order[m][1], order[m][2]
            earlier.insert(0, (segs[rank][j].first, gathered[rank, j], segs[rank][j].length))
            if segs[rank][j].first or sum(e[2] for e in earlier) >= kernel - 1:
                break
        halo = halo_of(earlier, kernel) if earlier else template
        xs = causal_conv(x[:, seg.row:seg.row + seg.length], weight, bias, halo, spec.activation)
        q, k, v = xs.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
        rows = slice(seg.row, seg.row + seg.length)
        # b. from a zero state; the response and transition when a state comes in or goes on
        runs.append(run_segment(spec.rule, q, k, v, g[:, rows], beta[:, rows],
                                affine=not seg.first or (n + 1) in continued))
    # c. (transition, final) of every segment, gathered; each rank combines the prefix of its own
    zero = torch.zeros(b, hv, dk, dk + dv, dtype=state_dtype(x), device=x.device)
    parts = [torch.cat([run.transition if run.transition is not None else zero[..., :dk], run.final], dim=-1)
             for run in runs]
    my_states, every = _gather(parts, zero, count, spec, states)  # (R, count, b, hv, dk, dk + dv)
    chain = [(segs[rank][j].first, every[rank, j][..., :dk], every[rank, j][..., dk:]) for _, rank, j in order]
    starts = initial_states(chain)
    outs = [with_initial_state(run, starts[position[(ring_rank, i)]]) for i, run in enumerate(runs)]
    return torch.cat(outs, dim=1), my_tails, my_states, gathered, every
