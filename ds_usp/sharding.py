"""Which tokens of the global sequence live on which rank, padding, documents, and sharding.

With ``N = U * R`` sequence-parallel ranks, a global sequence of ``seq_len`` tokens is padded at
its end to ``padded_len`` (a multiple of ``N``, of ``2 * N`` for zigzag) and cut so that every rank
holds ``padded_len / N`` tokens. Ring rank ``r`` holds its *ring piece* (``padded_len / R`` tokens),
a list of runs of consecutive positions (:func:`piece_runs`); its Ulysses group splits the piece in
``U`` equal parts in order, and the Ulysses all-to-all reassembles the piece on every member:

* ``"contiguous"``: one run per ring rank, slice ``r`` of ``R``.
* ``"zigzag"``: the sequence is cut into ``2R`` chunks; ring rank ``r`` holds chunks ``r`` and
  ``2R-1-r`` (causal work balance).
* ``"balanced"``: zigzag applied to every *segment* between document boundaries (packed rows,
  :func:`normalize_docs`): each segment is cut into ``2R`` chunks paired the same way, with the
  integer rounding chosen so that every rank still holds exactly ``padded_len / R`` tokens. Causal
  work within a document grows linearly with the position, so pairing each chunk with its mirror
  balances it per document; plain zigzag does not (per-rank work max/mean 1.6 on a long-tail mix of
  documents at R = 4, see docs/benchmarks.md). With one document it is plain zigzag.

Padding (positions ``>= seq_len``) belongs to no document: the attention gives it zero output and
zero gradient and never lets a real token see it. :func:`shard_sequence` cuts a full tensor into
this rank's shard (no communication) and :func:`gather_sequence` puts the shards back together.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from ds_usp.comm import gather_seq
from ds_usp.config import LAYOUTS
from ds_usp.topology import USPTopology

Runs = tuple[tuple[int, int], ...]  # (first global position, length), in piece order
Docs = tuple[tuple[int, ...], ...]  # per batch row: the first position of every document (0 first)


def check_layout(layout: str) -> None:
    """Raise a clear error for an unknown layout.

    Args:
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.

    Raises:
        ValueError: any other value.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout ({layout!r}) must be one of {', '.join(map(repr, LAYOUTS))}")


def pad_multiple(ulysses_degree: int, ring_degree: int, layout: str) -> int:
    """The global length must be a multiple of this: ``N``, or ``2N`` for zigzag.

    Args:
        ulysses_degree: U.
        ring_degree: R.
        layout: the sharding layout.

    Returns:
        The multiple.
    """
    check_layout(layout)
    n = ulysses_degree * ring_degree
    return 2 * n if layout == "zigzag" else n


def padded_length(seq_len: int, ulysses_degree: int, ring_degree: int, layout: str) -> int:
    """``seq_len`` rounded up to the layout's multiple.

    Args:
        seq_len: real tokens in the global sequence.
        ulysses_degree: U.
        ring_degree: R.
        layout: the sharding layout.

    Returns:
        The padded global length.
    """
    m = pad_multiple(ulysses_degree, ring_degree, layout)
    return -(-seq_len // m) * m


def per_row(values: Union[Sequence[Any], Tensor], batch: int, name: str, what: str,
            one_for_all: Callable[[list], bool]) -> list:
    """A per-row argument given once for every row or once per row, as one entry per row.

    Args:
        values: the argument (a tensor is read as nested lists).
        batch: rows of the batch.
        name: the argument's name (in the error).
        what: what one row's entry holds (in the error).
        one_for_all: whether ``values`` (as a list) is one entry for every row.

    Returns:
        ``batch`` entries.

    Raises:
        ValueError: per-row entries whose count is not ``batch``.
    """
    rows = values.tolist() if isinstance(values, Tensor) else list(values)
    if one_for_all(rows):
        return [rows] * batch
    if len(rows) != batch:
        raise ValueError(f"{name} has {len(rows)} rows, the batch has {batch}: give one list of {what} for every row, "
                         f"or one list for all rows")
    return rows


def normalize_docs(doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None], batch: int,
                   seq_len: int) -> Optional[Docs]:
    """Documents of each batch row, as the first position of every document.

    Args:
        doc_lens: document lengths over the global sequence: one list for every row (or a 1-D
            tensor), or one list per row (a list of lists, or a 2-D tensor padded with zeros);
            ``None``: one document per row.
        batch: rows of the batch.
        seq_len: real global length; every row's lengths must sum to it.

    Returns:
        ``None`` (one document per row) or one tuple of document starts per row.

    Raises:
        ValueError: lengths that are not positive integers, do not sum to ``seq_len``, or a per-row
            list whose row count is not ``batch``.
    """
    if doc_lens is None:
        return None
    rows = per_row(doc_lens, batch, "doc_lens", "document lengths",
                   lambda rows: bool(rows) and not isinstance(rows[0], (list, tuple)))
    starts = []
    for i, row in enumerate(rows):
        lens = list(row)
        while lens and lens[-1] == 0:  # a zero-padded 2-D tensor
            lens.pop()
        if not lens or any(isinstance(x, bool) or int(x) != x or x < 1 for x in lens):
            raise ValueError(f"doc_lens row {i} ({list(row)[:8]}{'...' if len(row) > 8 else ''}) must be positive "
                             f"integers (document lengths)")
        lens = [int(x) for x in lens]
        if sum(lens) != seq_len:
            raise ValueError(f"doc_lens row {i} sums to {sum(lens)}, but the sequence has {seq_len} real tokens: "
                             f"the documents must cover the sequence exactly")
        acc, row_starts = 0, []
        for x in lens:
            row_starts.append(acc)
            acc += x
        starts.append(tuple(row_starts))
    return tuple(starts)


def segment_bounds(docs: Optional[Docs], seq_len: int, padded_len: int) -> tuple[int, ...]:
    """Every document boundary of any row, the end of the real tokens and the padded end, sorted (0 first).

    Args:
        docs: from :func:`normalize_docs`.
        seq_len: real global length.
        padded_len: padded global length.

    Returns:
        The sorted boundaries.
    """
    cuts = {0, seq_len, padded_len}
    for row in docs or ():
        cuts.update(row)
    return tuple(sorted(cuts))


def piece_runs(padded_len: int, ring_degree: int, ring_rank: int, layout: str,
               bounds: Optional[tuple[int, ...]] = None) -> Runs:
    """The runs of positions ring rank ``ring_rank`` holds, in piece order.

    Args:
        padded_len: padded global length.
        ring_degree: R.
        ring_rank: position in the ring.
        layout: the sharding layout.
        bounds: segment boundaries (:func:`segment_bounds`), used by ``"balanced"`` only (``None``:
            one segment).

    Returns:
        ``((start, length), ...)``, lengths summing to ``padded_len / R``.
    """
    check_layout(layout)
    r, n = ring_rank, ring_degree
    if layout == "contiguous":
        piece = padded_len // n
        return ((r * piece, piece),)
    if layout == "zigzag":
        c = padded_len // (2 * n)
        return _merge(((r * c, c), ((2 * n - 1 - r) * c, c)))
    return _balanced_runs(bounds or (0, padded_len), n)[r]


def _merge(runs: Sequence[tuple[int, int]]) -> Runs:
    """Runs without empty ones, adjacent ones joined."""
    out: list[list[int]] = []
    for start, length in runs:
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((a, b) for a, b in out)


@functools.lru_cache(maxsize=64)
def _balanced_runs(bounds: tuple[int, ...], ring_degree: int) -> tuple[Runs, ...]:
    """The ``"balanced"`` layout: every segment zigzagged over the ring, exactly ``total / R`` tokens per rank.

    Rank ``r`` should get ``L / R`` tokens of a segment of length ``L``, which is rarely an integer: the
    floors are given first, then each segment's ``L mod R`` remaining tokens go to the ranks still
    furthest below ``total / R`` (every rank's fractional share of a segment is the same, so this
    greedy rounding always ends with exactly ``total / R`` per rank). Within the segment, rank ``r``'s
    share is cut in two chunks placed at slot ``r`` and at the mirror slot ``2R-1-r``.
    """
    n = ring_degree
    total = bounds[-1] - bounds[0]
    segs = [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    need = [total // n] * n
    share = []
    for _, length in segs:
        base = [length // n] * n
        for i in range(n):
            need[i] -= base[i]
        share.append(base)
    for k, (_, length) in enumerate(segs):
        for i in sorted(range(n), key=lambda j: -need[j])[:length % n]:  # ranks furthest below their total
            share[k][i] += 1
            need[i] -= 1
    runs: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for (start, _), counts in zip(segs, share):
        firsts = [c // 2 for c in counts]
        order = list(range(n)) + list(range(n - 1, -1, -1))  # slot -> rank
        pos = start
        for slot, i in enumerate(order):
            size = firsts[i] if slot < n else counts[i] - firsts[i]
            runs[i].append((pos, size))
            pos += size
    return tuple(_merge(sorted(r)) for r in runs)


def ring_piece_positions(padded_len: int, ring_degree: int, ring_rank: int, layout: str,
                         bounds: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """Global positions held by ring rank ``ring_rank`` after the Ulysses all-to-all, in piece order.

    Args:
        padded_len: padded global length.
        ring_degree: R.
        ring_rank: position in the ring.
        layout: the sharding layout.
        bounds: segment boundaries for ``"balanced"`` (:func:`segment_bounds`).

    Returns:
        A 1-D int64 tensor of ``padded_len / R`` positions.
    """
    runs = piece_runs(padded_len, ring_degree, ring_rank, layout, bounds)
    return torch.cat([torch.arange(a, a + n) for a, n in runs])


def shard_positions(padded_len: int, ulysses_degree: int, ring_degree: int, sp_rank: int, layout: str,
                    bounds: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """Global positions held by SP rank ``sp_rank`` (``ring_rank * U + ulysses_rank``).

    Args:
        padded_len: padded global length.
        ulysses_degree: U.
        ring_degree: R.
        sp_rank: position in the sequence-parallel group.
        layout: the sharding layout.
        bounds: segment boundaries for ``"balanced"`` (:func:`segment_bounds`).

    Returns:
        A 1-D int64 tensor of ``padded_len / (U * R)`` positions.
    """
    ring_rank, ulysses_rank = divmod(sp_rank, ulysses_degree)
    piece = ring_piece_positions(padded_len, ring_degree, ring_rank, layout, bounds)
    n = piece.numel() // ulysses_degree
    return piece[ulysses_rank * n:(ulysses_rank + 1) * n]


def shard_runs(padded_len: int, ulysses_degree: int, ring_degree: int, sp_rank: int, layout: str,
               bounds: Optional[tuple[int, ...]] = None) -> Runs:
    """The runs of global positions SP rank ``sp_rank`` holds (:func:`shard_positions`), in shard order."""
    pos = shard_positions(padded_len, ulysses_degree, ring_degree, sp_rank, layout, bounds).tolist()
    return _merge([(p, 1) for p in pos])


def resolve_seq_len(seq_len: Optional[int], local_len: int, ulysses_degree: int, ring_degree: int,
                    layout: str) -> tuple[int, int]:
    """Check a global length against a local shard length and return ``(seq_len, padded_len)``.

    Args:
        seq_len: the real global length, or ``None`` for "no padding" (``local_len * N``).
        local_len: tokens on this rank.
        ulysses_degree: U.
        ring_degree: R.
        layout: the sharding layout.

    Returns:
        ``(seq_len, padded_len)``.

    Raises:
        ValueError: the shard length does not fit the layout, or ``seq_len`` does not pad to
            ``local_len * N``.
    """
    n = ulysses_degree * ring_degree
    padded = local_len * n
    mult = pad_multiple(ulysses_degree, ring_degree, layout)
    if padded % mult != 0:
        raise ValueError(f"local sequence length {local_len} x {n} ranks = {padded} is not a multiple of {mult} "
                         f"as the {layout!r} layout needs; shard the sequence with ds_usp.shard_sequence, which pads")
    if seq_len is None:
        return padded, padded
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len ({seq_len!r}) must be a positive integer")
    if padded_length(seq_len, ulysses_degree, ring_degree, layout) != padded:
        raise ValueError(f"seq_len ({seq_len}) does not match the local length {local_len}: with {n} ranks and the "
                         f"{layout!r} layout it pads to {padded_length(seq_len, ulysses_degree, ring_degree, layout)}"
                         f" tokens, but the shards hold {padded}")
    return seq_len, padded


def _check_dim(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise ValueError(f"expected a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim ({dim}) is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def layout_bounds(layout: str, doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None], seq_len: int,
                  padded_len: int) -> Optional[tuple[int, ...]]:
    """The ``bounds`` :func:`shard_positions` takes for ``layout``: the ``"balanced"`` layout's segment boundaries
    for ``doc_lens`` (any row form, see :func:`normalize_docs`); None for the other layouts, which ignore documents.

    Args:
        layout: the sharding layout.
        doc_lens: document lengths, one list or one per row; ``None``: one document.
        seq_len: real global length.
        padded_len: padded global length.

    Returns:
        The boundaries, or None.

    Raises:
        ValueError: see :func:`normalize_docs`.
    """
    if layout != "balanced":
        return None
    if isinstance(doc_lens, Tensor):
        doc_lens = doc_lens.tolist()
    rows = None if doc_lens is None else (len(doc_lens) if doc_lens and isinstance(doc_lens[0], (list, tuple)) else 1)
    return segment_bounds(normalize_docs(doc_lens, rows or 1, seq_len), seq_len, padded_len)


def shard_sequence(x: Tensor, topo: USPTopology, dim: int = 1, layout: str = "zigzag", pad_value: float = 0,
                   doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None] = None) -> Tensor:
    """This rank's shard of a full-sequence tensor (no communication).

    The sequence is padded with ``pad_value`` at its end to a multiple of ``U*R`` (``2*U*R`` for zigzag);
    pass the real length as ``seq_len`` to :func:`ds_usp.usp_attention` and :func:`gather_sequence`.

    Args:
        x: the full tensor, identical on every rank of the SP group.
        topo: the topology.
        dim: the sequence dimension.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.
        pad_value: the value of the padding (e.g. a pad token id, or -100 for labels).
        doc_lens: the documents (``"balanced"`` only; the same as given to the attention).

    Returns:
        The shard, ``x.shape[dim]`` padded and divided by ``U*R`` along ``dim``; differentiable.

    Raises:
        ValueError: bad ``dim``, ``layout`` or ``doc_lens``, or an empty sequence.
    """
    dim = _check_dim(x, dim)
    check_layout(layout)
    n = x.shape[dim]
    if n == 0:
        raise ValueError("cannot shard an empty sequence")
    padded = padded_length(n, topo.ulysses_degree, topo.ring_degree, layout)
    bounds = layout_bounds(layout, doc_lens, n, padded)
    if padded != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = padded - n
        x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
    idx = shard_positions(padded, topo.ulysses_degree, topo.ring_degree, topo.sp_rank, layout, bounds).to(x.device)
    return x.index_select(dim, idx)


def gather_sequence(x: Tensor, topo: USPTopology, dim: int = 1, layout: str = "zigzag",
                    seq_len: Optional[int] = None,
                    doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None] = None) -> Tensor:
    """Reassemble the full sequence from every SP rank's shard (inverse of :func:`shard_sequence`).

    The backward keeps this rank's shard of the gradient: exact when every rank uses the gathered
    tensor the same way (e.g. computes the same loss on it).

    Args:
        x: this rank's shard.
        topo: the topology.
        dim: the sequence dimension.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.
        seq_len: real global length, to cut the padding off (``None``: keep every position).
        doc_lens: the documents (``"balanced"`` only).

    Returns:
        The full tensor, in global position order.

    Raises:
        ValueError: bad ``dim``, ``layout``, ``seq_len`` or ``doc_lens``.
    """
    dim = _check_dim(x, dim)
    check_layout(layout)
    real_len, padded = resolve_seq_len(seq_len, x.shape[dim], topo.ulysses_degree, topo.ring_degree, layout)
    bounds = layout_bounds(layout, doc_lens, real_len, padded)
    full = gather_seq(x, topo.sp_group, dim) if topo.sp_size > 1 else x  # shards in SP-rank order
    order = torch.cat([shard_positions(padded, topo.ulysses_degree, topo.ring_degree, p, layout, bounds)
                       for p in range(topo.sp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(padded)
    return full.index_select(dim, inverse[:real_len].to(x.device))
