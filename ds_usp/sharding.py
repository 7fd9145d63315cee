"""Which tokens of the global sequence live on which rank (contiguous or zigzag), padding, and sharding.

With ``N = U * R`` sequence-parallel ranks, a global sequence of ``seq_len`` tokens is padded at
its end to ``padded_len`` (a multiple of ``N``, or of ``2 * N`` for zigzag) and cut so that every
rank holds ``padded_len / N`` tokens:

* ``"contiguous"``: SP rank ``p = ring_rank * U + ulysses_rank`` holds slice ``p``.
* ``"zigzag"``: the sequence is cut into ``2R`` chunks; ring rank ``r`` holds chunks ``r`` and
  ``2R-1-r`` (causal work balance), and its Ulysses group splits that piece in ``U`` equal parts.

Either way, the Ulysses all-to-all reassembles on every member of ring rank ``r`` exactly the
"ring piece" of ``r`` in increasing position order, which is what the ring algorithm relies on.
Padded tokens sit after every real token, and the real tokens of every ring piece form a prefix of
it (:func:`ring_block_valid_len`); the ring trims padded queries and keys off each block, so padding
gets zero output and zero gradient and never changes a real token's result.

:func:`shard_sequence` cuts a full tensor into this rank's shard (no communication) and
:func:`gather_sequence` puts the shards back together (one all-gather).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ds_usp.comm import gather_seq
from ds_usp.topology import USPTopology

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    """Raise a clear error for an unknown layout.

    Args:
        layout: ``"contiguous"`` or ``"zigzag"``.

    Raises:
        ValueError: any other value.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout ({layout!r}) must be one of {', '.join(map(repr, LAYOUTS))}")


def pad_multiple(ulysses_degree: int, ring_degree: int, layout: str) -> int:
    """The global length must be a multiple of this: ``N`` (contiguous) or ``2N`` (zigzag).

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


def ring_piece_positions(padded_len: int, ring_degree: int, ring_rank: int, layout: str) -> torch.Tensor:
    """Global positions held by ring rank ``ring_rank`` after the Ulysses all-to-all, in order.

    Args:
        padded_len: padded global length.
        ring_degree: R.
        ring_rank: position in the ring.
        layout: the sharding layout.

    Returns:
        A 1-D int64 tensor of ``padded_len / R`` positions.
    """
    check_layout(layout)
    if layout == "contiguous":
        piece = padded_len // ring_degree
        return torch.arange(ring_rank * piece, (ring_rank + 1) * piece)
    c = padded_len // (2 * ring_degree)
    mirror = 2 * ring_degree - 1 - ring_rank
    return torch.cat([torch.arange(ring_rank * c, (ring_rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])


def shard_positions(padded_len: int, ulysses_degree: int, ring_degree: int, sp_rank: int, layout: str) -> torch.Tensor:
    """Global positions held by SP rank ``sp_rank`` (``ring_rank * U + ulysses_rank``).

    Args:
        padded_len: padded global length.
        ulysses_degree: U.
        ring_degree: R.
        sp_rank: position in the sequence-parallel group.
        layout: the sharding layout.

    Returns:
        A 1-D int64 tensor of ``padded_len / (U * R)`` positions.
    """
    ring_rank, ulysses_rank = divmod(sp_rank, ulysses_degree)
    piece = ring_piece_positions(padded_len, ring_degree, ring_rank, layout)
    n = piece.numel() // ulysses_degree
    return piece[ulysses_rank * n:(ulysses_rank + 1) * n]


def ring_block_valid_len(seq_len: int, padded_len: int, ring_degree: int, ring_rank: int, layout: str) -> int:
    """How many leading tokens of ring rank ``ring_rank``'s piece are real (not padding).

    The real tokens of a piece always form a prefix of it: padding sits at the global end, and in
    the zigzag layout the second chunk of a piece comes later globally than the first, so it is
    padded first.

    Args:
        seq_len: real global length.
        padded_len: padded global length.
        ring_degree: R.
        ring_rank: whose piece.
        layout: the sharding layout.

    Returns:
        The length of the real prefix (0 when the piece is all padding).
    """
    check_layout(layout)
    if layout == "contiguous":
        piece = padded_len // ring_degree
        return max(0, min(piece, seq_len - ring_rank * piece))
    c = padded_len // (2 * ring_degree)
    first = max(0, min(c, seq_len - ring_rank * c))
    second = max(0, min(c, seq_len - (2 * ring_degree - 1 - ring_rank) * c))
    return first + second


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


def shard_sequence(x: Tensor, topo: USPTopology, dim: int = 1, layout: str = "zigzag",
                   pad_value: float = 0) -> Tensor:
    """This rank's shard of a full-sequence tensor (no communication).

    The sequence is padded with ``pad_value`` at its end to a multiple of ``U*R`` (contiguous) or
    ``2*U*R`` (zigzag); pass the real length as ``seq_len`` to :func:`ds_usp.usp_attention` and :func:`gather_sequence`.

    Args:
        x: the full tensor, identical on every rank of the SP group.
        topo: the topology.
        dim: the sequence dimension.
        layout: ``"contiguous"`` or ``"zigzag"``.
        pad_value: the value of the padding (e.g. a pad token id, or -100 for labels).

    Returns:
        The shard, ``x.shape[dim]`` padded and divided by ``U*R`` along ``dim``; differentiable.

    Raises:
        ValueError: bad ``dim`` or ``layout``, or an empty sequence.
    """
    dim = _check_dim(x, dim)
    check_layout(layout)
    n = x.shape[dim]
    if n == 0:
        raise ValueError("cannot shard an empty sequence")
    padded = padded_length(n, topo.ulysses_degree, topo.ring_degree, layout)
    if padded != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = padded - n
        x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
    idx = shard_positions(padded, topo.ulysses_degree, topo.ring_degree, topo.sp_rank, layout).to(x.device)
    return x.index_select(dim, idx)


def gather_sequence(x: Tensor, topo: USPTopology, dim: int = 1, layout: str = "zigzag",
                    seq_len: Optional[int] = None) -> Tensor:
    """Reassemble the full sequence from every SP rank's shard (inverse of :func:`shard_sequence`).

    The backward keeps this rank's shard of the gradient: exact when every rank uses the gathered
    tensor the same way (e.g. computes the same loss on it).

    Args:
        x: this rank's shard.
        topo: the topology.
        dim: the sequence dimension.
        layout: ``"contiguous"`` or ``"zigzag"``.
        seq_len: real global length, to cut the padding off (``None``: keep every position).

    Returns:
        The full tensor, in global position order.

    Raises:
        ValueError: bad ``dim``, ``layout`` or ``seq_len``.
    """
    dim = _check_dim(x, dim)
    check_layout(layout)
    real_len, padded = resolve_seq_len(seq_len, x.shape[dim], topo.ulysses_degree, topo.ring_degree, layout)
    full = gather_seq(x, topo.sp_group, dim) if topo.sp_size > 1 else x  # shards in SP-rank order
    order = torch.cat([shard_positions(padded, topo.ulysses_degree, topo.ring_degree, p, layout)
                       for p in range(topo.sp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(padded)
    return full.index_select(dim, inverse[:real_len].to(x.device))
