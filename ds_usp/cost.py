"""What one USP attention layer costs per rank: bytes sent (closed form), bytes held (model), and a meter.

Symbols (docs/architecture.md): ``b`` batch, ``L`` the padded global length, ``N = U*R``, ``T = b L / N``
tokens per rank, ``e`` bytes per element of q/k/v, ``H``/``H_kv`` query/kv heads, ``D`` head dim,
``H_kv' = max(H_kv, U)`` the kv heads the all-to-all carries (replicated when ``H_kv < U``)::

    forward  = T e [ (U-1)/U (2 H + 2 H_kv') D  +  2 (R-1) H_kv' D ]
    backward = T [ e (U-1)/U (2 H + 2 H_kv') D  +  e 2 (R-1) H_kv' D  +  4 * 2 R H_kv' D [R > 1] ]

Forward: one all-to-all for q, k, v (``H + 2 H_kv'`` heads per token), one for the output (``H``);
the ring passes the stacked K/V piece R-1 times. Backward: the output's all-to-all reversed for
dout; the ring passes K/V again R-1 times (not kept from the forward) and the fp32 dK/dV
accumulator of each block R times (from its owner around and home), 4 bytes per element whatever
the input dtype; the q/k/v all-to-all reversed for dq, dk, dv. Derived from
:mod:`ds_usp.attention.usp`; the meter in ``benchmarks/meters.py`` measures it (tests/test_comm_volume.py
checks every split against it) and docs/choosing.md uses it.

:func:`attention_memory` models what the layer holds: what autograd saves for the backward (exact,
checked by the tests with ``saved_tensors_hooks``) and the transient peaks of the forward and the
backward (an estimate from the buffers each phase keeps alive; benchmarks/attention.py prints it
beside the measured peaks).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

ACC_BYTES = 4  # the ring backward's dK/dV and dQ accumulators and the LSE are fp32 whatever the input dtype


@dataclass(frozen=True)
class Volume:
    """Bytes one rank sends in one direction of one attention layer.

    Attributes:
        all_to_all: through the Ulysses all-to-alls (the chunks for the other U-1 ranks).
        ring: through the ring's point-to-point sends.
        other: through any other collective (0 for USP attention in its steady state).
    """

    all_to_all: float
    ring: float
    other: float = 0.0

    @property
    def total(self) -> float:
        """All bytes sent."""
        return self.all_to_all + self.ring + self.other


def sent_kv_heads(kv_heads: int, ulysses: int) -> int:
    """KV heads the Ulysses all-to-all carries per token: ``max(H_kv, U)``.

    Args:
        kv_heads: H_kv.
        ulysses: U; ``H_kv % U == 0`` or ``U % H_kv == 0`` (what ds-usp accepts).

    Returns:
        ``H_kv`` if U divides it, else ``U`` (each kv head replicated ``U / H_kv`` times).

    Raises:
        ValueError: neither divides the other.
    """
    if kv_heads % ulysses == 0:
        return kv_heads
    if ulysses % kv_heads == 0:
        return ulysses
    raise ValueError(f"kv heads ({kv_heads}) and U ({ulysses}) must divide one another")


def _all_to_all_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                      elem_bytes: int, v_head_dim: Optional[int] = None) -> tuple[Fraction, int, Fraction]:
    """``(T, H_kv' (D + D_v), bytes of the two all-to-alls of one direction)``: the same forward and backward."""
    dv = head_dim if v_head_dim is None else v_head_dim
    tokens = Fraction(batch * seq, ulysses * ring)
    hk = sent_kv_heads(kv_heads, ulysses)
    d_q, d_kv = heads * (head_dim + dv), hk * (head_dim + dv)  # q in and out (D, D_v); k and v
    return tokens, d_kv, tokens * elem_bytes * Fraction(ulysses - 1, ulysses) * (d_q + d_kv)


def forward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                  elem_bytes: int, v_head_dim: Optional[int] = None) -> Volume:
    """Closed form of the bytes one rank sends in the forward of one USP attention layer.

    Args:
        batch: b.
        seq: L, the padded global sequence length (a multiple of N, of 2N for zigzag).
        heads: H.
        kv_heads: H_kv.
        head_dim: D.
        ulysses: U.
        ring: R.
        elem_bytes: e (4 fp32, 2 bf16/fp16).
        v_head_dim: the value head dim when it is not ``head_dim`` (MLA).

    Returns:
        The :class:`Volume` (exact; floats only because (U-1)/U need not divide).
    """
    tokens, d_kv, a2a = _all_to_all_bytes(batch, seq, heads, kv_heads, head_dim, ulysses, ring, elem_bytes,
                                          v_head_dim)
    return Volume(float(a2a), float(tokens * elem_bytes * (ring - 1) * d_kv))


def backward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                   elem_bytes: int, v_head_dim: Optional[int] = None) -> Volume:
    """Closed form of the bytes one rank sends in the backward of one USP attention layer.

    Args:
        batch, seq, heads, kv_heads, head_dim, ulysses, ring, elem_bytes, v_head_dim: as for :func:`forward_bytes`.

    Returns:
        The :class:`Volume`: all-to-alls for dout and for dq/dk/dv, ring K/V (R-1 hops, e bytes) and
        fp32 dK/dV (R hops); no ring traffic when R = 1.
    """
    tokens, d_kv, a2a = _all_to_all_bytes(batch, seq, heads, kv_heads, head_dim, ulysses, ring, elem_bytes,
                                          v_head_dim)
    ring_b = tokens * d_kv * ((ring - 1) * elem_bytes + ring * ACC_BYTES) if ring > 1 else 0
    return Volume(float(a2a), float(ring_b))


# ----------------------------------------------------------------- a linear-attention (Gated DeltaNet) layer


def linear_bytes(batch: int, seq: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 kernel: int, ulysses: int, ring: int, elem_bytes: int, segments: int) -> tuple[Volume, Volume]:
    """Closed form of the bytes one rank sends in one Gated DeltaNet layer under USP: ``(forward, backward)``.

    With ``nk' = max(nk, U)`` key heads sent (replicated when ``nk < U``), ``C = (2 nk' dk + nv dv) / U`` the
    convolution channels of a rank's heads, ``n`` the segments a ring rank holds (1 contiguous, 2 zigzag, more
    where documents or the end padding cut them: the largest count over the ranks)::

        all-to-all, each way = T (U-1)/U [ e (2 nk' dk + nv dv) + 4 * 2 nv + e nv dv ]    (q, k, v; g, beta; out)
        forward ring         = (R-1) n b [ e (K-1) C  +  4 (nv/U) dk (dk + dv) ]          (halos; states)
        backward ring        = (R-1) R n b [ e (K-1) C  +  4 (nv/U) dk (dk + dv) ]        (their gradients summed)

    Linear attention sends no K/V around the ring: per segment, ``K-1`` tokens of inputs (the convolution's
    halo) and a ``dk x (dk + dv)`` state per head, independent of the length. The ring's collectives are an
    all-gather (forward) and an all-reduce of the gathered gradient (backward), counted as the bytes handed to
    them times the other ranks (the meter's convention; a ring all-reduce puts ``2 (R-1)/R`` of it on the wire).

    Args:
        batch: b.
        seq: L, the padded global length.
        num_k_heads: nk.
        num_v_heads: nv.
        k_head_dim: dk.
        v_head_dim: dv.
        kernel: K, the convolution's width.
        ulysses: U.
        ring: R.
        elem_bytes: e of the activations (the gates and states travel in fp32).
        segments: n.

    Returns:
        ``(forward, backward)`` :class:`Volume` s: all-to-all, and the ring's collectives as ``other``.
    """
    tokens = Fraction(batch * seq, ulysses * ring)
    nk = num_k_heads if num_k_heads % ulysses == 0 else ulysses  # sent key heads
    share = Fraction(ulysses - 1, ulysses)
    a2a = tokens * share * (elem_bytes * (2 * nk * k_head_dim + 2 * num_v_heads * v_head_dim) + 4 * 2 * num_v_heads)
    channels = Fraction(2 * nk * k_head_dim + num_v_heads * v_head_dim, ulysses)
    part = segments * batch * (elem_bytes * (kernel - 1) * channels
                               + ACC_BYTES * Fraction(num_v_heads, ulysses) * k_head_dim * (k_head_dim + v_head_dim))
    ring_fwd = (ring - 1) * part if ring > 1 else 0
    ring_bwd = (ring - 1) * ring * part if ring > 1 else 0
    return Volume(float(a2a), 0.0, float(ring_fwd)), Volume(float(a2a), 0.0, float(ring_bwd))


@dataclass(frozen=True)
class AttentionMemory:
    """Bytes one rank holds for one USP attention layer (see :func:`attention_memory`).

    Attributes:
        output: the layer's output shard ``(b, s_local, H, D)``.
        saved: what autograd keeps for the backward beyond the output (with ``U = 1`` that is q, k,
            v and the LSE; otherwise the head-layout q/k/v, output and LSE).
        forward_peak: the most the forward holds at once beyond its inputs q, k, v (estimate).
        backward_peak: the most the backward holds at once beyond the saved tensors and dout (estimate).
    """

    output: int
    saved: int
    forward_peak: int
    backward_peak: int


def attention_memory(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                     elem_bytes: int) -> AttentionMemory:
    """A model of the bytes one rank holds for one USP attention layer, from the buffers of each phase.

    ``T = b L / N`` tokens per rank. The forward's phases: the q/k/v all-to-all (send and receive
    buffer), the ring (fp32 output and LSE accumulators, the stacked K/V block and the one in flight,
    one block's result), the output's all-to-all (send, receive, output). The backward's: the dout
    all-to-all, the ring (fp32 dQ accumulator, K/V block and the one in flight, fp32 dK/dV block and
    the one in flight, one block's gradients), the dq/dk/dv all-to-all (send, receive, results).

    Args:
        batch, seq, heads, kv_heads, head_dim, ulysses, ring, elem_bytes: as for :func:`forward_bytes`.

    Returns:
        The :class:`AttentionMemory` in bytes.
    """
    t = batch * seq // (ulysses * ring)
    e, a = elem_bytes, ACC_BYTES
    hk = sent_kv_heads(kv_heads, ulysses)
    q_b, kv_b = t * heads * head_dim * e, t * hk * head_dim * e  # head layout: T tokens' worth either way
    qkv_b, lse_b = q_b + 2 * kv_b, t * heads * a
    acc_out = t * heads * head_dim * a if ring > 1 else 0  # the ring's fp32 running output
    acc_cast = q_b if ring > 1 and e != a else 0  # its cast to the input dtype
    in_ring_fwd = (4 * kv_b if ring > 1 else 0) + q_b + lse_b  # K/V block + in flight; one block's result
    if ulysses == 1:
        saved = lse_b  # q, k, v are the inputs; the output is counted apart
        forward_peak = acc_out + in_ring_fwd + acc_cast
    else:
        saved = qkv_b + q_b + lse_b  # head-layout q/k/v, head-layout output, LSE
        a2a_in = 2 * qkv_b
        ring_phase = qkv_b + acc_out + in_ring_fwd + acc_cast
        a2a_out = qkv_b + q_b + lse_b + 3 * q_b  # residuals, then send, receive, output
        forward_peak = max(a2a_in, ring_phase, a2a_out)
    grads_b = q_b + 2 * kv_b  # one block's dq, dk, dv
    ring_bwd = (t * heads * head_dim * a + 4 * kv_b + 4 * t * hk * head_dim * a if ring > 1 else 0) + grads_b
    if ulysses == 1:
        backward_peak = ring_bwd + (grads_b if ring > 1 else 0)  # plus the casts of the fp32 accumulators
    else:
        dout_heads = q_b
        a2a_back = grads_b + 2 * qkv_b + (t * (heads + 2 * kv_heads) * head_dim * e)
        backward_peak = max(2 * dout_heads, dout_heads + ring_bwd, a2a_back)
    return AttentionMemory(output=q_b, saved=saved, forward_peak=forward_peak, backward_peak=backward_peak)
