"""Ring attention over one ring group: K/V blocks travel around the ring, partial results merge by LSE.

Every rank holds its "ring piece" of the sequence (see :mod:`ds_usp.sharding`). At step ``t`` rank
``r`` holds the K/V piece of ring rank ``j = (r - t) mod R`` and computes attention of (part of)
its queries against (part of) that block, while the next block is already in flight
(:func:`ds_usp.comm.ring_shift`, double buffered). Which parts, and how many steps at all, is
decided in one place, :mod:`ds_usp.attention.masks` (causal, documents, windows, padding). The
partial ``(out, lse)`` pairs are merged exactly in fp32 by ``ops.merge_block_`` (:mod:`ds_usp.native`).
The backward walks the same schedule with the merged ``(out, lse)``; the gradients a rank computes for a
visiting block go straight to the block's owner in the training dtype, which sums them in fp32, leaving in one
batched exchange with the next K/V shift (:func:`ds_usp.comm.ring_exchange`). With
``usp.comm_dtype = "fp8"`` the K/V blocks travel as float8 e4m3 messages (:func:`ds_usp.comm.fp8_encode`), encoded
once by their owner and passed on unchanged, so every rank, forward and backward, sees the same values; a rank's
own block is used exact. Gradients always travel in the training dtype. Neither
direction is autograd-aware: :mod:`ds_usp.attention.usp` wraps both in one custom op. Shapes use the legend
of docs/architecture.md (here ``s`` is one ring piece, ``U*s_local``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ds_usp.attention.masks import MaskSpec, block_parts, needed_steps
from ds_usp.comm import fp8_decode, fp8_encode, ring_exchange, ring_shift
from ds_usp.kernels import AttnBackend, backward_pieces, forward_pieces
from ds_usp.native import TorchOps
from ds_usp.sharding import Runs, piece_runs


@dataclass(frozen=True)
class RingSpec:
    """Everything the ring needs to know about the ring and where the tokens live.

    Attributes:
        group: the ring process group.
        ranks: global ranks of the ring in ring order.
        rank: this rank's position in the ring.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.
        padded_len: padded global length.
        bounds: segment boundaries of the ``"balanced"`` layout (:func:`ds_usp.sharding.segment_bounds`).
    """

    group: Any
    ranks: tuple[int, ...]
    rank: int
    layout: str
    padded_len: int
    bounds: Optional[tuple[int, ...]] = None

    @property
    def size(self) -> int:
        """Ranks in the ring (R)."""
        return len(self.ranks)

    def pieces(self) -> tuple[Runs, ...]:
        """Every ring rank's runs of positions."""
        return tuple(piece_runs(self.padded_len, self.size, r, self.layout, self.bounds) for r in range(self.size))


def _plan(spec: RingSpec, mask: MaskSpec, batch: int) -> tuple[int, list]:
    """``(steps, [(source rank, [(rows, parts), ...]) per step])``: the whole schedule of this rank."""
    pieces = spec.pieces()
    groups = mask.row_groups(batch)
    steps = needed_steps(mask, spec.size, pieces)
    schedule = []
    for t in range(steps):
        src = (spec.rank - t) % spec.size
        schedule.append([(rows, block_parts(mask, row, pieces[spec.rank], pieces[src])) for rows, row in groups])
    return steps, schedule


def _whole(work: list, s: int) -> bool:
    """One part covering the whole block with a full or causal mask, for every row: the kernel's result is final."""
    return len(work) == 1 and len(work[0][1]) == 1 and work[0][0] == slice(None) and \
        work[0][1][0].q == slice(0, s) == work[0][1][0].k and (work[0][1][0].full or work[0][1][0].causal)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, spec: RingSpec, mask: MaskSpec, scale: float,
                 backend: AttnBackend, ops: TorchOps, softcap: float = 0.0,
                 sinks: Optional[Tensor] = None, fp8: bool = False) -> tuple[Tensor, Tensor]:
    """Attention of this rank's ring piece of queries against the whole sequence held by the ring.

    Args:
        q: ``(b, s, hq, d)``, this rank's ring piece.
        k: ``(b, s, hkv, d)``.
        v: ``(b, s, hkv, dv)`` (``dv`` may differ from ``d``: MLA).
        spec: the ring and the layout.
        mask: which pairs meet (:mod:`ds_usp.attention.masks`).
        scale: softmax scale.
        backend: the local attention kernel.
        ops: the native op or its PyTorch twins (the LSE merge).
        softcap: attention logit soft-cap (0: none), applied by the kernels to every block.
        sinks: ``(hq,)`` one sink logit per head (GPT-OSS): one more term of each row's log-sum-exp, merged
            once after the ring, whatever the number of steps; None: none.
        fp8: the K/V blocks travel as float8 e4m3 messages (``usp.comm_dtype = "fp8"``).

    Returns:
        ``out (b, s, hq, dv)`` in ``q.dtype`` and ``lse (b, hq, s)`` fp32 (the sinks included); rows that see no
        key (padding) have zero output and ``-inf`` LSE (without sinks).
    """
    b, s, h, _ = q.shape
    dk, dv = k.shape[-1], v.shape[-1]
    steps, schedule = _plan(spec, mask, b)
    if steps == 1 and _whole(schedule[0], s):  # one kernel call is the answer: no accumulator, no merge
        part = schedule[0][0][1][0]
        out, lse = backend.forward(q, k, v, part.causal, scale, softcap)
        return (out, lse) if sinks is None else _merge_sinks(out.float(), lse, sinks, q.dtype)
    out = torch.zeros(b, s, h, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    own = torch.cat([k, v], dim=-1)  # (b, s, hkv, d) + (b, s, hkv, dv) -> (b, s, hkv, d + dv): one message per step
    msg = fp8_encode(own) if fp8 and steps > 1 else own
    fused = backend.band_forward_merge_ is not None and dk == dv
    for t in range(steps):
        wait = ring_shift(msg, spec.group, spec.ranks, spec.rank) if t < steps - 1 else None
        kv = _block(own, msg, t, fp8)
        kb, vb = kv[..., :dk], kv[..., dk:]
        for rows, parts in schedule[t]:
            for part in parts:
                if fused:  # attention and merge in one kernel pass
                    backend.band_forward_merge_(q[rows, part.q], kb[rows, part.k], vb[rows, part.k], part.lo, part.hi,
                                                scale, out[rows, part.q], lse[rows, :, part.q], softcap=softcap)
                    continue
                for qs, block_out, block_lse in forward_pieces(backend, q[rows, part.q], kb[rows, part.k],
                                                                vb[rows, part.k], part.lo, part.hi, scale, softcap):
                    at = slice(part.q.start + qs.start, part.q.start + qs.stop)
                    ops.merge_block_(out[rows, at], lse[rows, :, at], block_out, block_lse)
                    del block_out, block_lse  # free before the next kernel allocates its own
        del kv, kb, vb
        if wait is not None:
            msg = wait()
    if sinks is not None:
        return _merge_sinks(out, lse, sinks, q.dtype)
    return out.to(q.dtype), lse


def _block(own: Tensor, msg: Tensor, t: int, fp8: bool) -> Tensor:
    """The K/V block of ring step ``t``: this rank's own (exact) at step 0, else the message that arrived."""
    return own if t == 0 else (fp8_decode(msg, own.dtype) if fp8 else msg)


def _merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Fold one sink logit per head into the final fp32 ``(out, lse)``: a key with logit ``sink`` and value 0.

    ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``; the backward of the attention then takes
    ``(out', lse')`` as the softmax statistics unchanged, and the sinks' own gradient is :func:`sink_grad`.
    """
    new = torch.logaddexp(lse, sinks.float()[None, :, None])  # (b, h, s)
    out = out * torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)  # (b, h, s) -> (b, s, h, 1)
    return out.to(dtype), new


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Gradient of the sinks folded in by :func:`ring_forward`: ``-sum_rows exp(sink - lse) * <dout, out>``.

    Args:
        dout: ``(b, s, hq, dv)``.
        out: ``(b, s, hq, dv)`` the final output (sinks included).
        lse: ``(b, hq, s)`` the final LSE (sinks included).
        sinks: ``(hq,)``.

    Returns:
        ``(hq,)`` in the sinks' dtype: this rank's rows' share.
    """
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (b, s, h) -> (b, h, s)
    return -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: RingSpec,
                  mask: MaskSpec, scale: float, backend: AttnBackend, ops: TorchOps,
                  softcap: float = 0.0, fp8: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`ring_forward` from its merged ``(out, lse)`` (sinks included: they need nothing more
    here; their own gradient is :func:`sink_grad`).

    The K/V blocks travel the same steps again. A rank's gradients for a visiting block go straight to the
    block's owner (``t`` ranks back at step ``t``) in the training dtype, where they are summed in fp32: half
    the bytes of an fp32 accumulator travelling with the block in bf16/fp16, one hop fewer in fp32. They leave
    at the start of the next step in the same batched exchange as that step's K/V shift
    (:func:`ds_usp.comm.ring_exchange`: one call per step, plus one after the last step for the last block's
    gradients), which is waited for only after that step's kernels.

    Args:
        dout: ``(b, s, hq, dv)`` gradient of the output.
        q: ``(b, s, hq, d)``.
        k: ``(b, s, hkv, d)``.
        v: ``(b, s, hkv, dv)``.
        out: ``(b, s, hq, dv)`` from :func:`ring_forward`.
        lse: ``(b, hq, s)`` fp32 from :func:`ring_forward`.
        spec: the ring and the layout.
        mask: which pairs meet.
        scale: softmax scale.
        backend: the local attention kernel.
        ops: the native op or its PyTorch twins (the fp32 accumulation).
        softcap: attention logit soft-cap (0: none).
        fp8: the K/V blocks travel as float8 e4m3 messages, as in the forward (the same values).

    Returns:
        ``dq, dk, dv`` in the inputs' dtypes; rows that see no key get zero gradient.
    """
    b, s = q.shape[:2]
    dk_ = k.shape[-1]
    steps, schedule = _plan(spec, mask, b)
    if steps == 1 and _whole(schedule[0], s):  # one block, gradients straight from the kernel
        return backend.backward(dout, q, k, v, out, lse, schedule[0][0][1][0].causal, scale, softcap)
    dq = torch.zeros_like(q, dtype=torch.float32)
    own = torch.cat([k, v], dim=-1)  # (b, s, hkv, d) + (b, s, hkv, dv) -> (b, s, hkv, d + dv)
    msg = fp8_encode(own) if fp8 and steps > 1 else own
    dkv = torch.zeros(own.shape, dtype=torch.float32, device=q.device)  # my own block's gradients, fp32
    spare = None  # an fp32 buffer for a visiting block's gradients, free again once they left in a cast copy
    leaving: list = []  # the previous step's visiting block's gradients, (training-dtype copy, hop to its owner)
    for t in range(steps + 1):  # step ``steps`` only takes the last block's gradients home
        sends = ([(msg, 1)] if t < steps - 1 else []) + leaving  # next K/V block + gradients home: one exchange
        wait = ring_exchange(sends, spec.group, spec.ranks, spec.rank) if sends else None
        if t < steps:
            target = dkv if t == 0 else (spare.zero_() if spare is not None else torch.zeros_like(dkv))
            _step_grads(schedule[t], dout, q, _block(own, msg, t, fp8), out, lse, dk_, scale, softcap, backend, ops,
                        dq, target)
        got = wait() if wait is not None else []  # waited for after this step's kernels
        if leaving:  # my block's gradients from the rank that held it at step t - 1
            ops.accumulate_(dkv, got[-1])
        msg = got[0] if t < steps - 1 else msg
        leaving = []
        if 0 < t < steps:  # this block's gradients go straight to its owner, t ranks back, in the training dtype
            leaving = [(target.to(own.dtype), spec.size - t)]
            spare = target if leaving[0][0] is not target else None  # fp32 training sends the buffer itself
    # dk and dv get storage of their own (a copy only for fp32): the custom op's outputs may not alias each other
    return dq.to(q.dtype), dkv[..., :dk_].to(k.dtype, copy=True), dkv[..., dk_:].to(v.dtype, copy=True)


def _step_grads(work: list, dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, dk_: int, scale: float,
                softcap: float, backend: AttnBackend, ops: TorchOps, dq: Tensor, target: Tensor) -> None:
    """One ring step's kernels: ``dq`` and the visiting block's ``target`` (its dK|dV, fp32) accumulate in place.

    Args:
        work: this step's ``[(rows, parts), ...]`` from :func:`_plan`.
        dout: ``(b, s, hq, dv)``.
        q: ``(b, s, hq, d)``.
        kv: ``(b, s, hkv, d + dv)`` the visiting K/V block.
        out: ``(b, s, hq, dv)`` the merged output.
        lse: ``(b, hq, s)`` the merged LSE.
        dk_: ``d``, where K ends in ``kv``'s last dim.
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none).
        backend: the local attention kernel.
        ops: the native op or its PyTorch twins (the fp32 accumulation).
        dq: ``(b, s, hq, d)`` fp32.
        target: ``(b, s, hkv, d + dv)`` fp32.
    """
    for rows, parts in work:
        for part in parts:
            pieces = backward_pieces(backend, dout[rows, part.q], q[rows, part.q], kv[..., :dk_][rows, part.k],
                                     kv[..., dk_:][rows, part.k], out[rows, part.q], lse[rows, :, part.q],
                                     part.lo, part.hi, scale, softcap)
            for qs, ks, dq_b, dk_b, dv_b in pieces:
                qrows = slice(part.q.start + qs.start, part.q.start + qs.stop)
                krows = slice(part.k.start + ks.start, part.k.start + ks.stop)
                ops.accumulate_(dq[rows, qrows], dq_b)
                ops.accumulate_(target[..., :dk_][rows, krows], dk_b)
                ops.accumulate_(target[..., dk_:][rows, krows], dv_b)
                del dq_b, dk_b, dv_b  # free before the next kernel allocates its own
