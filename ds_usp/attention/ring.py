"""Ring attention over one ring group: K/V blocks travel around the ring, partial results merge by LSE.

Every rank holds its "ring piece" of the sequence (see :mod:`ds_usp.sharding`). At step ``t`` rank
``r`` holds the K/V piece of ring rank ``j = (r - t) mod R`` and computes attention of (part of)
its queries against (part of) that block, while the next block is already in flight
(:func:`ds_usp.comm.ring_shift`, double buffered). Which part is decided in one place,
:func:`block_plan`. The partial ``(out, lse)`` pairs are merged exactly in fp32 by
``ops.merge_block_`` (:mod:`ds_usp.ops`). The backward walks the same schedule with the merged
``(out, lse)`` and passes the fp32 dK/dV accumulator of each block around the ring until it is back
with its owner. Neither direction is autograd-aware: :mod:`ds_usp.attention.usp` wraps both in one
custom op. Shapes use the legend of docs/architecture.md (here ``s`` is one ring piece, ``U*s_local``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ds_usp.comm import ring_shift
from ds_usp.kernels import AttnBackend
from ds_usp.ops import TorchOps
from ds_usp.sharding import ring_block_valid_len

ALL = slice(None)


@dataclass(frozen=True)
class RingSpec:
    """Everything the ring needs to know about the ring and the sequence.

    Attributes:
        group: the ring process group (None when ``size`` is 1).
        ranks: global ranks of the ring in ring order.
        rank: this rank's position in the ring.
        layout: ``"contiguous"`` or ``"zigzag"``.
        seq_len: real global length (padding excluded).
        padded_len: padded global length.
    """

    group: Any
    ranks: tuple[int, ...]
    rank: int
    layout: str
    seq_len: int
    padded_len: int

    @property
    def size(self) -> int:
        """Ranks in the ring (R)."""
        return len(self.ranks)


def _prefix(n: int, piece_len: int) -> slice:
    return ALL if n == piece_len else slice(0, n)


def block_plan(spec: RingSpec, src: int, piece_len: int, causal: bool) -> Optional[tuple[slice, slice, bool]]:
    """Which queries of this rank attend to which keys of ring rank ``src``'s piece, and how.

    Padding (a suffix of a piece, see :func:`ring_block_valid_len`) takes part neither as query nor
    as key: padded query rows are left out, so their output is zero, their LSE ``-inf`` and their
    gradients zero.

    Args:
        spec: the ring.
        src: ring rank whose K/V piece is at hand.
        piece_len: tokens per ring piece.
        causal: causal attention.

    Returns:
        ``(query slice, key slice, causal mask?)`` along the piece's sequence dimension, or
        ``None`` when no query of this rank sees any key of that block.
    """
    me = spec.rank
    n_q = ring_block_valid_len(spec.seq_len, spec.padded_len, spec.size, me, spec.layout)
    if n_q == 0:
        return None  # this rank holds only padding
    real_q = _prefix(n_q, piece_len)
    if not causal:
        n_k = ring_block_valid_len(spec.seq_len, spec.padded_len, spec.size, src, spec.layout)
        return (real_q, _prefix(n_k, piece_len), False) if n_k else None
    # Causal: every key a real query can see precedes it, so it is real; only the diagonal block needs trimming.
    if src == me:
        return real_q, real_q, True
    if spec.layout == "contiguous":
        return (real_q, ALL, False) if src < me else None
    half = piece_len // 2
    if src < me:  # both my chunks come after src's first chunk and before its second
        return real_q, slice(0, half), False
    # only my second chunk sees src, and it sees all of it
    return (slice(half, n_q), ALL, False) if n_q > half else None


def ring_forward(q: Tensor, k: Tensor, v: Tensor, spec: RingSpec, causal: bool, scale: float,
                 backend: AttnBackend, ops: TorchOps) -> tuple[Tensor, Tensor]:
    """Attention of this rank's ring piece of queries against the whole sequence held by the ring.

    Args:
        q: ``(b, s, hq, d)``, this rank's ring piece.
        k: ``(b, s, hkv, d)``.
        v: ``(b, s, hkv, d)``.
        spec: the ring and the sequence layout.
        causal: causal attention.
        scale: softmax scale.
        backend: the local attention kernel.
        ops: the native op or its PyTorch twins (the LSE merge).

    Returns:
        ``out (b, s, hq, d)`` in ``q.dtype`` and ``lse (b, hq, s)`` fp32 (``-inf`` on padded rows).
    """
    b, s, h, d = q.shape
    if spec.size == 1:  # one block: the kernel's (out, lse) is the answer; no accumulator, no merge
        qs, ks, masked = block_plan(spec, spec.rank, s, causal)  # a real token is in every sequence
        block_out, block_lse = backend.forward(q[:, qs], k[:, ks], v[:, ks], masked, scale)
        if qs == ALL:
            return block_out, block_lse
        out = torch.zeros_like(q)  # padded query rows: zero output, -inf LSE
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        out[:, qs], lse[:, :, qs] = block_out, block_lse
        return out, lse
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])  # 2 x (b, s, hkv, d) -> (2, b, s, hkv, d): one message per step
    for step in range(spec.size):
        wait = ring_shift(kv, spec.group, spec.ranks, spec.rank) if step < spec.size - 1 else None
        plan = block_plan(spec, (spec.rank - step) % spec.size, s, causal)
        if plan is not None:
            qs, ks, masked = plan
            block_out, block_lse = backend.forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], masked, scale)
            ops.merge_block_(out[:, qs], lse[:, :, qs], block_out, block_lse)
            del block_out, block_lse  # free before the next block's kernel allocates its own
        if wait is not None:
            kv = wait()
    return out.to(q.dtype), lse


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: RingSpec,
                  causal: bool, scale: float, backend: AttnBackend, ops: TorchOps) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`ring_forward` from its merged ``(out, lse)``.

    Args:
        dout: ``(b, s, hq, d)`` gradient of the output.
        q: ``(b, s, hq, d)``.
        k: ``(b, s, hkv, d)``.
        v: ``(b, s, hkv, d)``.
        out: ``(b, s, hq, d)`` from :func:`ring_forward`.
        lse: ``(b, hq, s)`` fp32 from :func:`ring_forward`.
        spec: the ring and the sequence layout.
        causal: causal attention.
        scale: softmax scale.
        backend: the local attention kernel.
        ops: the native op or its PyTorch twins (the fp32 accumulation).

    Returns:
        ``dq, dk, dv`` in the inputs' dtypes; padded rows get zero gradient.
    """
    s = q.shape[1]
    if spec.size == 1:  # one block, gradients straight from the kernel
        qs, ks, masked = block_plan(spec, spec.rank, s, causal)
        dq_b, dk_b, dv_b = backend.backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs],
                                            masked, scale)
        if qs == ALL and ks == ALL:
            return dq_b, dk_b, dv_b
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)  # padding gets no gradient
        dq[:, qs], dk[:, ks], dv[:, ks] = dq_b, dk_b, dv_b
        return dq, dk, dv
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = torch.stack([k, v])  # (2, b, s, hkv, d)
    wait_dkv = None
    for step in range(spec.size):
        wait_kv = ring_shift(kv, spec.group, spec.ranks, spec.rank) if step < spec.size - 1 else None
        plan = block_plan(spec, (spec.rank - step) % spec.size, s, causal)
        # fp32 dK/dV accumulator of the block at hand: fresh for my own block, else from the previous rank
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device) if wait_dkv is None else wait_dkv()
        if plan is not None:
            qs, ks, masked = plan
            dq_b, dk_b, dv_b = backend.backward(dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                                                lse[:, :, qs], masked, scale)
            ops.accumulate_(dq[:, qs], dq_b)
            ops.accumulate_(dkv[0][:, ks], dk_b)
            ops.accumulate_(dkv[1][:, ks], dv_b)
            del dq_b, dk_b, dv_b  # free before the next block's kernel allocates its own
        wait_dkv = ring_shift(dkv, spec.group, spec.ranks, spec.rank)
        if wait_kv is not None:
            kv = wait_kv()
    dkv = wait_dkv()  # my own block's accumulator, back after a full circle
    # dv gets its own storage (a copy only for fp32): the custom op's outputs may not alias each other
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype, copy=True)
