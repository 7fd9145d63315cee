"""A short causal depthwise convolution over a sequence sharded across a USP topology (LFM2's short convolutions).

    y = sharded_causal_conv(x, weight, bias, topo, layout="zigzag", seq_len=s, doc_lens=docs)

Each output reads its own input and the ``K - 1`` before it in the same document. Under sequence parallelism the
inputs before the first position of each run a rank holds live on other ranks (zigzag: before both halves). Every
rank works out from the layout which of its positions any other rank needs (at most ``K - 1`` before each run start,
the same list on every rank), sends those rows in one all-gather over the sequence-parallel group, and convolves
over its own rows and the gathered ones; positions before a document start (or before 0) read zeros. The gradient
of the gathered rows is summed over the group in the backward (one all-reduce), so it reaches the ranks that sent
them. The channels stay whole on every rank: no all-to-all, and the work is the layer's own.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from ds_usp.attention.counter import count_sp_layer
from ds_usp.comm import all_gather_rows, all_reduce_sum_
from ds_usp.sharding import layout_bounds, normalize_docs, resolve_seq_len, shard_positions
from ds_usp.topology import USPTopology


@functools.lru_cache(maxsize=64)
def _halo_rows(padded: int, u: int, r: int, layout: str, bounds: Optional[tuple[int, ...]], kernel: int,
               sp_rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """What one rank sends and where each of its taps reads, from the layout alone (the same on every rank;
    ``bounds``: the balanced layout's, else None).

    Returns:
        ``(send (m,) local rows this rank sends, source (s_local, K-1) rows of [own | gathered] each tap ``j``
        (offset ``j + 1`` back) reads, before (s_local, K-1) the global positions they stand for (negative: before
        the sequence), mine (s_local,) this rank's global positions, count)``: ``count`` rows per rank are gathered.
    """
    n = u * r
    pos = [shard_positions(padded, u, r, i, layout, bounds) for i in range(n)]
    s_local = pos[0].numel()
    owner, local = torch.empty(padded, dtype=torch.long), torch.empty(padded, dtype=torch.long)
    for i, p in enumerate(pos):
        owner[p], local[p] = i, torch.arange(s_local)
    back = torch.arange(1, kernel)
    needed = torch.cat([(p[:, None] - back)[(p[:, None] - back >= 0) & (owner[(p[:, None] - back).clamp_min(0)] != i)]
                        for i, p in enumerate(pos)]).unique()  # sorted: every position some other rank reads
    sends = [needed[owner[needed] == i] for i in range(n)]
    count = max(1, max(len(x) for x in sends))
    slot = torch.zeros(padded, dtype=torch.long)
    for x in sends:
        slot[x] = torch.arange(len(x))
    mine = pos[sp_rank]
    before = mine[:, None] - back  # (s_local, K-1)
    at = before.clamp_min(0)
    source = torch.where(owner[at] == sp_rank, local[at], s_local + owner[at] * count + slot[at])
    return local[sends[sp_rank]], source, before, mine, count


def exchange(rows: Tensor, topo: USPTopology) -> Tensor:
    """``(n, *rows.shape)``: every SP rank's ``rows`` (all-gathered), whose gradient is summed over the group back to
    the rank that sent them (each rank may read every other rank's rows); ``rows[None]`` on one rank."""
    return _Exchange.apply(rows, topo.sp_group, topo.sp_rank) if topo.sp_size > 1 else rows[None]


class _Exchange(torch.autograd.Function):
    """All-gather of every rank's rows; the backward sums each rank's gradient over the group (each rank read
    every other rank's rows) and keeps this rank's part."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, group: Any, rank: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        return torch.stack(all_gather_rows(rows.contiguous(), group, "sequence-parallel exchange"))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        grad = grad.contiguous().clone()
        all_reduce_sum_(grad, ctx.group, "sequence-parallel exchange backward")
        return grad[ctx.rank], None, None


@functools.lru_cache(maxsize=64)
def _device_halo_rows(padded: int, u: int, r: int, layout: str, bounds: Optional[tuple[int, ...]], kernel: int,
                      sp_rank: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """:func:`_halo_rows` on ``device``: copied there once per layout, shape, rank and device, not per call."""
    with torch.inference_mode(False):  # kept across calls: normal tensors, whatever mode the first call ran in
        return tuple(t.to(device) if isinstance(t, Tensor) else t  # type: ignore[return-value]
                     for t in _halo_rows(padded, u, r, layout, bounds, kernel, sp_rank))


@functools.lru_cache(maxsize=64)
def _document_ids(docs: Optional[tuple], seq_len: int, padded: int, device: torch.device) -> Tensor:
    """``(b or 1, padded)`` the document of every global position (the end padding: one of its own), made on
    ``device`` from the starts (fills of ranges, nothing copied from the host) once per documents and device: the
    model's convolution layers share it, in the forward and the recomputation."""
    rows = docs if docs is not None else ((0,),)
    with torch.inference_mode(False):  # kept across calls: a normal tensor, whatever mode the first call ran in
        ids = torch.zeros(len(rows), padded, dtype=torch.long, device=device)
        for i, starts in enumerate(rows):
            for start in (*starts[1:], seq_len):
                ids[i, start:] += 1
    return ids


def sharded_causal_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], topo: USPTopology, *,
                        layout: str = "zigzag", seq_len: Optional[int] = None,
                        doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None] = None,
                        activation: Optional[Callable[[Tensor], Tensor]] = None,
                        documents_reset: bool = True) -> Tensor:
    """``y[p] = sum_k weight[:, k] x[p - K + 1 + k] + bias`` over the whole sequence, for this rank's positions.

    Exact: what the layer's own causal convolution computes on the whole sequence, each document from zeros.

    Args:
        x: ``(b, s_local, C)`` this rank's shard (any layout).
        weight: ``(C, K)`` one filter per channel (``nn.Conv1d(groups=C).weight.squeeze(1)``).
        bias: ``(C,)`` or None.
        topo: the topology.
        layout: how the sequence was sharded.
        seq_len: the real global length (None: no padding).
        doc_lens: packed documents over the global sequence (as for :func:`ds_usp.usp_attention`).
        activation: applied to the result (None: none).
        documents_reset: positions before a document start read zeros (False: only before the sequence, as a
            family whose own convolution runs across packed documents, RecurrentGemma's).

    Returns:
        ``(b, s_local, C)`` in ``x``'s dtype, computed in the weight's (as transformers' ``causal_conv1d_fn``).
    """
    count_sp_layer()
    u, r, kernel = topo.ulysses_degree, topo.ring_degree, weight.shape[-1]
    b, s_local, channels = x.shape
    real_len, padded = resolve_seq_len(seq_len, s_local, u, r, layout)
    docs = normalize_docs(doc_lens, b, real_len)
    h = x.to(weight.dtype)
    y = h * weight[:, -1]
    if kernel > 1:
        send, source, before, mine, count = _device_halo_rows(
            padded, u, r, layout, layout_bounds(layout, doc_lens, real_len, padded), kernel, topo.sp_rank, x.device)
        rows = torch.zeros(b, count, channels, dtype=h.dtype, device=h.device)
        rows[:, :send.numel()] = h.index_select(1, send)
        gathered = exchange(rows, topo)
        every = torch.cat([h, gathered.transpose(0, 1).reshape(b, -1, channels)], dim=1)  # [own | gathered]
        doc = _document_ids(docs if documents_reset else None, real_len, padded, x.device)
        keep = (before >= 0) & (doc[:, before.clamp_min(0)] == doc[:, mine, None])  # (b or 1, s_local, K-1)
        for j in range(kernel - 1):  # offset j + 1 back: tap K - 2 - j
            y = y + every.index_select(1, source[:, j]) * keep[..., j, None].to(h.dtype) * weight[:, kernel - 2 - j]
    if bias is not None:
        y = y + bias
    if activation is not None:
        y = activation(y)
    return y.to(x.dtype)
