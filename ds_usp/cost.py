"""What one USP attention layer costs per rank: bytes sent (closed form), bytes held (model), and a meter.

Symbols (docs/architecture.md): ``b`` batch, ``L`` the padded global length, ``N = U*R``, ``T = b L / N``
tokens per rank, ``e`` bytes per element of q/k/v, ``H``/``H_kv`` query/kv heads, ``D`` head dim,
``H_kv' = max(H_kv, U)`` the kv heads the all-to-all carries (replicated when ``H_kv < U``)::

    forward  = T e [ (U-1)/U (2 H + 2 H_kv') D  +  2 (R-1) H_kv' D ]
    backward = T e [ (U-1)/U (2 H + 2 H_kv') D  +  4 (R-1) H_kv' D ]            (K/V again, then dK/dV home)

Forward: one all-to-all for q, k, v (``H + 2 H_kv'`` heads per token), one for the output (``H``);
the ring passes the stacked K/V piece R-1 times. Backward: the output's all-to-all reversed for
dout; the ring passes K/V again R-1 times (not kept from the forward) and each rank sends the dK/dV
of the R-1 blocks that visited it straight to their owners, in the training dtype (the owner sums
them in fp32); the q/k/v all-to-all reversed for dq, dk, dv. With ``usp.comm_dtype = "fp8"`` the forward's
all-to-alls and every K/V hop carry 1 byte per element plus a 4-byte scale per row of the message's last dim
(:func:`ds_usp.comm.fp8_encode`; a row is one head of one token); the gradients keep ``e``. Derived from
:mod:`ds_usp.attention.usp`; the meter in ``ds_usp/instruments/meters.py`` measures it (tests/test_comm_volume.py
checks every split against it) and docs/choosing.md uses it.

:func:`attention_memory` models what the layer holds: what autograd saves for the backward (exact,
checked by the tests with ``saved_tensors_hooks``) and the transient peaks of the forward and the
backward (an estimate from the buffers each phase keeps alive; benchmarks/attention.py prints it
beside the measured peaks).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

from ds_usp.comm import FP8_SCALE_BYTES
from ds_usp.splits import kv_heads_compatible, sent_heads

ACC_BYTES = 4  # the ring's accumulators (output, dQ, the owner's dK/dV) and the LSE are fp32 whatever the input dtype


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
    if not kv_heads_compatible(kv_heads, ulysses):
        raise ValueError(f"kv heads ({kv_heads}) and U ({ulysses}) must divide one another")
    return sent_heads(kv_heads, ulysses)


def _all_to_all_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                      elem_bytes: int, v_head_dim: Optional[int] = None,
                      fp8: bool = False) -> tuple[Fraction, Fraction]:
    """``(T, bytes of the two all-to-alls of one direction)``.

    ``fp8``: the all-to-alls as the forward sends them under ``usp.comm_dtype = "fp8"``: 1 byte per element and
    :data:`~ds_usp.comm.FP8_SCALE_BYTES` per row (q, k, v go in rows of ``gcd(D, D_v)`` columns, the output in
    rows of ``D_v``)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    tokens = Fraction(batch * seq, ulysses * ring)
    hk = sent_kv_heads(kv_heads, ulysses)
    d_q, d_kv = heads * (head_dim + dv), hk * (head_dim + dv)  # q in and out (D, D_v); k and v
    if not fp8:
        return tokens, tokens * elem_bytes * Fraction(ulysses - 1, ulysses) * (d_q + d_kv)
    rows = Fraction(heads * head_dim + d_kv, math.gcd(head_dim, dv)) + heads  # q, k, v in units; the output in heads
    return tokens, tokens * Fraction(ulysses - 1, ulysses) * (d_q + d_kv + FP8_SCALE_BYTES * rows)


def _kv_hop_bytes(kv_heads: int, head_dim: int, ulysses: int, elem_bytes: int, v_head_dim: Optional[int],
                  fp8: bool) -> int:
    """Bytes of one token of a ring message: K and V of the ``H_kv'`` heads (``fp8``: 1 byte each plus a scale per
    head, the row being ``D + D_v``)."""
    hk = sent_kv_heads(kv_heads, ulysses)
    d_kv = hk * (head_dim + (head_dim if v_head_dim is None else v_head_dim))
    return d_kv + FP8_SCALE_BYTES * hk if fp8 else elem_bytes * d_kv


def forward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                  elem_bytes: int, v_head_dim: Optional[int] = None, comm_dtype: str = "input") -> Volume:
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
        comm_dtype: ``usp.comm_dtype``: ``"input"`` or ``"fp8"``.

    Returns:
        The :class:`Volume` (exact; floats only because (U-1)/U need not divide).
    """
    fp8 = comm_dtype == "fp8"
    tokens, a2a = _all_to_all_bytes(batch, seq, heads, kv_heads, head_dim, ulysses, ring, elem_bytes, v_head_dim, fp8)
    return Volume(float(a2a), float(tokens * (ring - 1) * _kv_hop_bytes(kv_heads, head_dim, ulysses, elem_bytes,
                                                                        v_head_dim, fp8)))


def backward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                   elem_bytes: int, v_head_dim: Optional[int] = None, comm_dtype: str = "input") -> Volume:
    """Closed form of the bytes one rank sends in the backward of one USP attention layer.

    Args:
        batch, seq, heads, kv_heads, head_dim, ulysses, ring, elem_bytes, v_head_dim, comm_dtype: as for
            :func:`forward_bytes`.

    Returns:
        The :class:`Volume`: all-to-alls for dout and for dq/dk/dv, ring K/V (R-1 hops) and dK/dV (R-1
        blocks of gradients, each sent once to its owner), both in the training dtype (e bytes); no ring
        traffic when R = 1. Under ``comm_dtype = "fp8"`` the K/V hops carry the forward's fp8 messages.
    """
    tokens, a2a = _all_to_all_bytes(batch, seq, heads, kv_heads, head_dim, ulysses, ring, elem_bytes, v_head_dim)
    hop = functools.partial(_kv_hop_bytes, kv_heads, head_dim, ulysses, elem_bytes, v_head_dim)
    ring_b = tokens * (ring - 1) * (hop(comm_dtype == "fp8") + hop(False))  # K/V as the forward sent them; dK/dV
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
    nk = sent_heads(num_k_heads, ulysses)  # sent key heads
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
    all-to-all, the ring (fp32 dQ accumulator, K/V block and the one in flight, my block's fp32 dK/dV
    sum, a visiting block's fp32 dK/dV and the two in flight in the training dtype, one block's gradients),
    the dq/dk/dv all-to-all (send, receive, results).

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
    # fp32 dQ; K/V block and in flight; dK/dV: my block's fp32 sum, a visiting block's fp32 gradients, and those
    # leaving and arriving in the training dtype; one block's gradients
    ring_bwd = (t * heads * head_dim * a + 4 * kv_b + 4 * (a + e) * t * hk * head_dim if ring > 1 else 0) + grads_b
    if ulysses == 1:
        backward_peak = ring_bwd + (grads_b if ring > 1 else 0)  # plus the casts of the fp32 accumulators
    else:
        dout_heads = q_b
        a2a_back = grads_b + 2 * qkv_b + (t * (heads + 2 * kv_heads) * head_dim * e)
        backward_peak = max(2 * dout_heads, dout_heads + ring_bwd, a2a_back)
    return AttentionMemory(output=q_b, saved=saved, forward_peak=forward_peak, backward_peak=backward_peak)


def attention_kept(tokens: int, heads: int, kv_heads: int, head_dim: int, v_head_dim: int, ulysses: int,
                   elem_bytes: int) -> float:
    """Bytes one softmax layer's attention keeps for its backward on a rank holding ``tokens`` tokens, counted from the
    tensors autograd saves (``saved_tensors_hooks`` on a Llama layer, 4 CPU ranks, 1x4, 2x2 and 4x1, 8 or 4 key/value
    heads): q, k and v as the kernel reads them (``T`` tokens' worth either way; with ``U > 1`` in head layout after the
    all-to-all, the key/value heads replicated up to ``U`` when fewer), the output in head layout when ``U > 1`` (with
    ``U = 1`` it is ``o_proj``'s input, counted with the layer's ``h``-sized tensors) and the fp32 LSE. The key/value
    part scales with ``H_kv``: a layer of 8 key/value heads keeps ``2 h`` more per token than one of 4 (a Llama
    with 8 heads of 32)."""
    hk = sent_kv_heads(kv_heads, ulysses) if kv_heads_compatible(kv_heads, ulysses) else kv_heads
    qkv = tokens * (heads * head_dim + hk * (head_dim + v_head_dim)) * elem_bytes
    out = tokens * heads * v_head_dim * elem_bytes if ulysses > 1 else 0
    return float(qkv + out + tokens * heads * ACC_BYTES)


# ------------------------------------------------------------------------------------------ a whole step

GIB = 2 ** 30


@dataclass(frozen=True)
class ModelShape:
    """What the step's cost model needs of a model (``ds_usp.plan.model_shape`` reads it from an HF config).

    Attributes:
        name: the model (for messages).
        hidden: h.
        attention_layers: softmax-attention decoder layers.
        heads: query heads H.
        kv_heads: H_kv.
        head_dim: d (query/key).
        v_head_dim: d_v (MLA: other than d).
        vocab: V.
        mlp_width: the feed-forward width a token goes through in one layer: the intermediate size, or for MoE
            ``top_k x the expert width`` (+ shared experts).
        params: all parameters.
        active_params: the parameters one token uses (MoE: only its experts); embeddings excluded.
        linear_layers: linear-attention (Gated DeltaNet) layers.
        linear_k_heads, linear_v_heads, linear_k_dim, linear_v_dim, conv_kernel: their heads and dims.
        causal: the attention is causal (a language model: half the pairs); False for a diffusion transformer.
    """

    name: str
    hidden: int
    attention_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    vocab: int
    mlp_width: int
    params: int
    active_params: int
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 4
    causal: bool = True

    @property
    def layers(self) -> int:
        """All decoder layers."""
        return self.attention_layers + self.linear_layers


@dataclass(frozen=True)
class StepSettings:
    """One way to run a step: the layout, ZeRO and the memory features (the planner's knobs).

    Attributes:
        ulysses: U.
        ring: R.
        dp: data-parallel replicas.
        zero: ZeRO stage (1, 2, 3).
        checkpointing: ``""``, ``"selective"`` or ``"full"``.
        tiled_mlp: feed-forward blocks over sequence tiles.
        chunked_loss: logits and loss in chunks.
        offload_optimizer: the optimizer state (and its step) in host memory.
        offload_activations: checkpointed layer inputs in host memory.
        tile_mib: the tile budget (``usp.tile_mib``).
    """

    ulysses: int
    ring: int
    dp: int = 1
    zero: int = 3
    checkpointing: str = ""
    tiled_mlp: bool = False
    chunked_loss: bool = False
    offload_optimizer: bool = False
    offload_activations: bool = False
    tile_mib: float = 128.0
    features: Optional["Features"] = None  # exactly these features (the "auto" choice) instead of the flags above

    @property
    def sp(self) -> int:
        """U x R."""
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        """All ranks."""
        return self.sp * self.dp


@dataclass(frozen=True)
class Calibration:
    """The constants of :func:`step_memory` that are not derived from the model's shape.

    Counted, not fitted (issue 65): the tensors a Llama layer and the loss keep, by ``saved_tensors_hooks`` and by the
    resident set's growth phase by phase of a step on 4 CPU ranks (``benchmarks/long_seq.py``'s Llama at S = 16K,
    2x2, ZeRO-3, fp32). Against the peaks of whole steps in live bytes, as ``max_memory_allocated`` counts them on a
    GPU (``VmHWM`` with glibc's mmap threshold fixed at 64 KiB, so freed tensors leave the resident set; 17 rows of
    Llama shapes, ZeRO-1/2/3, every feature; ``benchmarks/plan_calibration.py --table``) they predict 0.95-1.14 of
    the measured peak, and 0.98-1.03 of four H200 rows (tests/test_plan.py, docs/planner.md). The constants fitted
    before (7.79 ``h`` and 4.33 of the feed-forward width per token, 10.97 bytes per logit, 4.38 bytes per parameter
    under ZeRO-3) fitted the same rows as well, but all those rows had 4 key/value heads for 8 query heads: with as
    many key/value heads as query heads a layer kept 10% more than they said, and a tight budget on CPU was missed.

    Attributes:
        per_layer_hidden: elements of ``h`` a decoder layer keeps per token for its backward besides its attention's
            q, k, v, output and LSE (:func:`attention_kept`, counted apart since they scale with the heads): 7 counted
            in a Llama layer (each RMSNorm's input and output and the projections' input after it, the output
            projection's input).
        per_layer_mlp: elements of the feed-forward width it keeps per token (4 counted in a gated MLP: gate, its
            activation, up, their product).
        selective_hidden: elements of ``h`` per token a layer under selective checkpointing keeps besides its input
            (the ring's output and LSE, and what the policy saves with them).
        logits: bytes per token and vocabulary entry of an unchunked loss: three fp32 ``T x V`` tensors at once in
            the log-softmax's backward (its output, the gradient coming in and the one going out), measured at 1500 MiB
            for 4096 tokens x 32000.
        fixed: bytes a rank holds whatever the model (none measured beyond the counted parts).
        per_param: bytes per parameter beyond the counted model states, by ZeRO stage, for DeepSpeed's buffers
            (counted up to the bucket sizes that bound them; none: fitted to the 17 rows with the counted constants
            above they came out at 0).
    """

    per_layer_hidden: float = 7.0
    per_layer_mlp: float = 4.0
    selective_hidden: float = 1.0
    logits: float = 12.0
    fixed: float = 0.0
    per_param: tuple[float, float, float] = (0.0, 0.0, 0.0)


# DeepSpeed's defaults that bound its buffers (elements): reduce_bucket_size, stage3_max_live_parameters
REDUCE_BUCKET, LIVE_PARAMS = 5e8, 1e9
HEADROOM = 0.9  # the share of what a rank's memory leaves beside what it holds that a step's activations are planned into


def activation_budget(memory: float, held: float) -> float:
    """The bytes a step's activations, loss and attention buffers may take: :data:`HEADROOM` of what ``memory`` leaves
    beside the ``held`` bytes (the model's states, and what the process holds besides; ``python -m ds_usp.plan`` and
    ``"auto"`` both plan with it). The headroom is on the step's part alone: the allocator's slack grows with what the
    step allocates, and the states (allocated once) need none."""
    return HEADROOM * (memory - held)


@dataclass(frozen=True)
class StepMemory:
    """Predicted bytes one rank holds at the peak of a step, by part (see :func:`step_memory`)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    attention: float
    loss: float
    fixed: float

    @property
    def total(self) -> float:
        """Everything."""
        return self.params + self.grads + self.optimizer + self.activations + self.attention + self.loss + self.fixed


LOSS_MIN_ROWS = 256  # a loss chunk's fewest rows under a fixed tile budget (below it lm_head's matmuls lose efficiency)
ROW_MULTIPLE = 128  # the loss chunks the planner chooses are a multiple of this many rows (whole matmul tiles)
MLP_LIVE = 9  # tokens x intermediate tensors a tiled gated MLP's forward + backward holds at once (gate, up, act(gate),
# the product, its gradient, the gradient of act(gate), and gate's and up's: 7.1-7.2 measured on CPU in a fresh
# process, 8.2 inside the test suite (tests/test_memory.py); with 6 the planner under-predicted an H200's peak at
# 128K by 7.5%)


def loss_chunk_rows(tokens: int, hidden: int, vocab: int, tile_mib: float) -> int:
    """Tokens per chunk of the chunked loss under a fixed tile budget (``usp.tile_mib``): as many as make the chunk's
    fp32 logits as large as the rank's hidden states, at least :data:`LOSS_MIN_ROWS`, and never more than one tile
    holds.

    Args:
        tokens: tokens this rank holds.
        hidden: the model's hidden size.
        vocab: the vocabulary size.
        tile_mib: the tile budget.

    Returns:
        The chunk's rows, at least 1.
    """
    return max(1, min(int(tile_mib * 2 ** 20 // (vocab * 4)), max(LOSS_MIN_ROWS, tokens * hidden // vocab)))


def tokens_per_rank(seq: int, micro_batch: int, sp: int) -> int:
    """``T``: tokens of the micro-batch one rank holds (the sequence padded to a multiple of ``2 x sp``)."""
    padded = -(-seq // (2 * sp)) * (2 * sp)
    return micro_batch * padded // sp


@dataclass(frozen=True)
class Features:
    """What one forward-backward does to hold less memory: the choice ``"auto"`` makes for each call.

    Attributes:
        loss_chunk: tokens per logits chunk of the loss (0: the whole logits).
        loss_grad_in_forward: the chunked loss takes its gradients in its forward (else its backward recomputes the
            logits: one more ``2 T H V`` matmul, for the same memory).
        mlp_tiles: sequence tiles of each feed-forward block (0: not tiled).
        checkpoint: ``"selective"``, ``"full"`` or ``""``.
        checkpoint_layers: how many decoder layers (the first ones) are checkpointed.
        offload: the checkpointed layers' inputs wait in host memory.
    """

    loss_chunk: int = 0
    loss_grad_in_forward: bool = True
    mlp_tiles: int = 0
    checkpoint: str = ""
    checkpoint_layers: int = 0
    offload: bool = False

    def describe(self, layers: int) -> str:
        """The features in words (the start-up log line and the planner's table)."""
        loss = "whole logits"
        if self.loss_chunk:
            loss = f"loss in {self.loss_chunk}-row chunks" + ("" if self.loss_grad_in_forward else ", recomputed")
        parts = [loss, f"MLP in {self.mlp_tiles} tiles" if self.mlp_tiles else "MLP whole",
                 f"{self.checkpoint} checkpointing of {self.checkpoint_layers}/{layers} layers" if self.checkpoint
                 else "no checkpointing"]
        return ", ".join(parts) + (", their inputs offloaded" if self.offload else "")


def features_of(shape: ModelShape, tokens: int, s: StepSettings) -> Features:
    """The features a :class:`StepSettings` means at ``tokens`` per rank: its own :attr:`~StepSettings.features`
    when set, else its flags (every layer checkpointed, the loss chunked by :func:`loss_chunk_rows`, the MLP in
    tiles of ``tile_mib``)."""
    if s.features is not None:
        return s.features
    tiles = max(1, math.ceil(tokens * shape.mlp_width * 2 * MLP_LIVE / (s.tile_mib * 2 ** 20))) if s.tiled_mlp else 0
    return Features(loss_chunk=loss_chunk_rows(tokens, shape.hidden, shape.vocab, s.tile_mib) if s.chunked_loss else 0,
                    mlp_tiles=tiles, checkpoint=s.checkpointing,
                    checkpoint_layers=shape.layers if s.checkpointing else 0,
                    offload=s.offload_activations and bool(s.checkpointing))


def activation_memory(shape: ModelShape, tokens: int, f: Features, elem_bytes: int, attention_peak: float,
                      cal: Calibration = Calibration(), ulysses: int = 2) -> tuple[float, float, float]:
    """``(activations, loss, attention)``: the bytes one rank holds for its step's activations at the peak.

    Per token and softmax layer :class:`Calibration`'s ``h`` and feed-forward parts (a tiled block keeps its input
    instead of its feed-forward part) and what its attention keeps (:func:`attention_kept`); a linear-attention layer its projections and gates. A checkpointed layer keeps
    its input (selective: also the ring's output and LSE; offloaded: nothing on the device) and one layer is
    recomputed at a time. The loss: the whole fp32 logits, or one chunk, an fp32 ``lm_head`` gradient and ``dx``.
    The peak is at the loss (the kept activations and the loss's buffers) or in a layer's backward (the kept
    activations, a recomputed layer, and the larger of the attention's buffers and an MLP tile's), whichever is larger.

    Args:
        shape: the model.
        tokens: ``T``, tokens per rank.
        f: the features.
        elem_bytes: the training dtype's bytes.
        attention_peak: the attention's transient backward bytes (:func:`attention_memory`).
        cal: the measured constants.
        ulysses: U (what the attention keeps depends on it: :func:`attention_kept`).

    Returns:
        The three parts (at most one of ``loss`` and ``attention`` is not 0: the part the peak is at).
    """
    return _Pricer(shape, tokens, elem_bytes, attention_peak, 0.0, Hardware(), cal, ulysses).memory(f)


def offloaded_bytes(shape: ModelShape, tokens: int, f: Features, elem_bytes: int = 2) -> float:
    """The host bytes the features' offloaded layer inputs take on one rank (pinned; none without offload)."""
    return _layer_inputs(shape, tokens, f.checkpoint_layers if f.offload and f.checkpoint else 0, elem_bytes)


def _layer_inputs(shape: ModelShape, tokens: int, layers: int, elem_bytes: int) -> float:
    """The bytes of ``layers`` decoder layers' inputs at ``tokens`` per rank."""
    return layers * tokens * elem_bytes * shape.hidden


def _optimizer_bytes(shape: ModelShape, s: StepSettings, elem_bytes: int) -> float:
    """One rank's optimizer state wherever it lives: Adam's moments, and fp32 master weights in mixed precision."""
    return shape.params * (8 + (4 if elem_bytes != 4 else 0)) / s.world


def host_held(shape: ModelShape, s: StepSettings, elem_bytes: int = 2) -> float:
    """The host bytes one rank's optimizer state takes when offloaded (none otherwise)."""
    return _optimizer_bytes(shape, s, elem_bytes) if s.offload_optimizer else 0.0


def step_memory(shape: ModelShape, s: StepSettings, seq: int, micro_batch: int = 1, elem_bytes: int = 2,
                cal: Calibration = Calibration()) -> StepMemory:
    """The bytes one rank holds at the peak of a training step (AdamW, DeepSpeed ZeRO), by part.

    The model's states (:func:`model_state_memory`), and the activations, the attention's transient buffers and the
    loss's of :func:`activation_memory` for the features of ``s`` (:func:`features_of`).

    Args:
        shape: the model.
        s: the layout, ZeRO stage and features.
        seq: the sequence length S.
        micro_batch: sequences per micro-batch.
        elem_bytes: bytes of the training dtype (2 bf16, 4 fp32).
        cal: the measured constants.

    Returns:
        The :class:`StepMemory`.
    """
    t = tokens_per_rank(seq, micro_batch, s.sp)
    params, grads, optimizer = model_state_memory(shape, s, elem_bytes, cal)
    att = attention_memory(micro_batch, tokens_per_rank(seq, 1, s.sp) * s.sp, shape.heads, shape.kv_heads,
                           shape.head_dim, s.ulysses, s.ring, elem_bytes)
    activations, loss, attention = activation_memory(shape, t, features_of(shape, t, s), elem_bytes,
                                                     att.backward_peak, cal, s.ulysses)
    return StepMemory(params=params, grads=grads, optimizer=optimizer, activations=activations, attention=attention,
                      loss=loss, fixed=cal.fixed)


def model_state_memory(shape: ModelShape, s: StepSettings, elem_bytes: int = 2,
                       cal: Calibration = Calibration()) -> tuple[float, float, float]:
    """``(parameters, gradients, optimizer)``: the bytes of the model's states one rank holds at the step's peak.

    With ``P`` parameters, ``w`` ranks, ``e`` bytes of the training dtype (mixed precision when ``e = 2``):
    parameters ``P e`` (ZeRO-3: ``P e / w`` plus the gathered ones, up to DeepSpeed's 1e9 live parameters);
    gradients: the full set while the backward runs (ZeRO-1), up to a reduce bucket (ZeRO-2/3), plus the rank's fp32
    partition; optimizer ``P (8 + 4 [fp32 master]) / w`` (nothing with the optimizer offloaded); and
    :attr:`Calibration.per_param` bytes per parameter (up to a bucket) for DeepSpeed's own buffers.
    """
    w, e, p = s.world, elem_bytes, shape.params
    params = p * e / w + step_only_states(shape, s, e) if s.zero == 3 else p * e  # the partition and the gathered
    grads = (p if s.zero == 1 else min(p, REDUCE_BUCKET)) * e + (0.0 if s.offload_optimizer else p * 4 / w)
    grads += cal.per_param[s.zero - 1] * min(p, REDUCE_BUCKET)
    optimizer = 0.0 if s.offload_optimizer else _optimizer_bytes(shape, s, e)
    return params, grads, optimizer


def step_only_states(shape: ModelShape, s: StepSettings, elem_bytes: int = 2) -> float:
    """The bytes of :func:`model_state_memory` that exist only while a step runs: ZeRO-3's gathered parameters
    (``min(P, LIVE_PARAMS) e``). DeepSpeed gathers them as the forward starts (with its default prefetch bucket and
    reuse distance a small model's whole set: 73 MiB of fp32 on each of 4 CPU ranks for ``benchmarks/long_seq.py``'s
    Llama, its small always-gathered weights aside) and releases them at the end of the backward; the rest (the
    partitions, the gradient buffers, the optimizer's state) stays allocated between steps, so it is in what a rank
    holds when its next forward starts, and this is not: ``"auto"`` plans the activations beside both."""
    return min(shape.params, LIVE_PARAMS) * elem_bytes if s.zero == 3 else 0.0


def attention_forward_flops(shape: ModelShape, seq: int, micro_batch: int = 1, causal: bool = True,
                            doc_lens: Optional[Sequence[int]] = None) -> float:
    """FLOPs of one softmax layer's attention forward: ``2 b pairs H (d + d_v)``, the (query, key) pairs ``S^2`` (or
    ``sum n_i^2`` over packed documents), halved under a causal mask."""
    pairs = seq * seq if doc_lens is None else sum(n * n for n in doc_lens)
    return 2 * micro_batch * pairs * shape.heads * (shape.head_dim + shape.v_head_dim) * (0.5 if causal else 1.0)


def step_flops(shape: ModelShape, seq: int, micro_batch: int = 1, causal: bool = True,
               checkpointing: str = "", doc_lens: Optional[Sequence[int]] = None) -> float:
    """FLOPs of one training step over one micro-batch (all ranks together).

    ``6 N tokens`` for the matmuls (``N`` the active parameters, ``lm_head`` included) plus the attention's
    ``3 x 2 b S^2 H (d + d_v)`` per softmax layer (forward and backward; half under a causal mask); checkpointing
    adds the forward it recomputes (``2 N tokens``, and the attention's forward under full checkpointing).

    Args:
        shape: the model.
        seq: S.
        micro_batch: b.
        causal: causal attention.
        checkpointing: ``""``, ``"selective"`` or ``"full"``.
        doc_lens: the documents packed in a row (a query meets only its own document's keys: ``sum n_i^2`` pairs
            instead of ``S^2``); None: one document.

    Returns:
        FLOPs.
    """
    tokens = micro_batch * seq
    dense = 6 * shape.active_params * tokens
    attn_fwd = attention_forward_flops(shape, seq, micro_batch, causal, doc_lens) * shape.attention_layers
    recompute = 2 * shape.active_params * tokens if checkpointing else 0
    if checkpointing == "full":
        recompute += attn_fwd
    return dense + 3 * attn_fwd + recompute


@dataclass(frozen=True)
class Hardware:
    """The cluster the step runs on.

    Attributes:
        nodes: machines.
        gpus_per_node: ranks per machine.
        gpu_mem_gib: memory of one GPU.
        peak_tflops: dense bf16 peak of one GPU.
        intra_bw: GB/s one rank sends to the ranks of its node (NVLink).
        inter_bw: GB/s one rank sends across nodes (its share of the network).
        efficiency: the share of the peak the model's matmuls reach.
        host_bw: GB/s between a GPU and its host (PCIe), one way: offloaded activations.
        launch_us: microseconds a kernel launch costs beyond its work (a tile's or a chunk's small kernels).
        host_mem_gib: memory of one machine's host, shared by its GPUs: offloaded activations (and an offloaded
            optimizer state) must fit it.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    peak_tflops: float = 989.0
    intra_bw: float = 300.0
    inter_bw: float = 25.0
    efficiency: float = 0.5
    host_bw: float = 25.0
    launch_us: float = 8.0
    host_mem_gib: float = 2048.0

    @property
    def world(self) -> int:
        """All ranks."""
        return self.nodes * self.gpus_per_node

    def host_budget(self, held: float = 0.0) -> float:
        """The host bytes one rank's offloaded activations may take: :data:`HEADROOM` of its GPU's share of the
        host's memory less ``held`` (e.g. an offloaded optimizer state)."""
        return HEADROOM * (self.host_mem_gib * GIB / self.gpus_per_node - held)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step, by part (see :func:`step_time`)."""

    compute: float
    all_to_all: float
    ring: float
    ring_hidden: float
    zero: float
    features: float = 0.0  # what the memory features add: recomputation, exposed offload copies, their launches

    @property
    def ring_exposed(self) -> float:
        """The ring's part not hidden behind the attention's compute."""
        return max(0.0, self.ring - self.ring_hidden)

    @property
    def total(self) -> float:
        """Compute, the memory features, the all-to-alls, the exposed ring and ZeRO's collectives in sequence."""
        return self.compute + self.features + self.all_to_all + self.ring_exposed + self.zero


def step_time(shape: ModelShape, s: StepSettings, seq: int, hw: Hardware, micro_batch: int = 1,
              elem_bytes: int = 2, doc_lens: Optional[Sequence[int]] = None) -> StepTime:
    """Seconds of one training step per rank.

    Compute: :func:`step_flops` over the ranks of a sequence at ``peak x efficiency``; the memory features:
    :func:`feature_seconds`. Communication: the exact
    bytes of :func:`forward_bytes` / :func:`backward_bytes` (and :func:`linear_bytes`) per layer, the all-to-all at
    the bandwidth of the Ulysses group (inside a node when ``U`` fits one), the ring at the bandwidth between
    ring neighbours (``U`` ranks apart), overlapped with the attention's compute (the K/V of the next step is in
    flight while this one computes); ZeRO's gradient reduce-scatter (and ZeRO-3's parameter gathers, forward and
    backward) over all ranks, not overlapped.

    Args:
        shape: the model.
        s: the layout and settings.
        seq: S.
        hw: the cluster.
        micro_batch: b.
        elem_bytes: bytes of the training dtype.
        doc_lens: the documents packed in the row (see :func:`step_flops`); None: one document.

    Returns:
        The :class:`StepTime`.
    """
    flops = step_flops(shape, seq, micro_batch, shape.causal, doc_lens=doc_lens) / s.sp
    rate = hw.peak_tflops * 1e12 * hw.efficiency
    compute = flops / rate
    padded = tokens_per_rank(seq, 1, s.sp) * s.sp
    tokens = tokens_per_rank(seq, micro_batch, s.sp)
    extra = feature_seconds(shape, tokens, features_of(shape, tokens, s), hw, elem_bytes,
                            attention_forward_flops(shape, padded, micro_batch, shape.causal, doc_lens) / s.sp)

    def bw(span: int) -> float:  # GB/s between ranks ``span`` apart
        return (hw.intra_bw if span < hw.gpus_per_node else hw.inter_bw) * 1e9

    a2a = ring = 0.0
    if shape.attention_layers:
        f = forward_bytes(micro_batch, padded, shape.heads, shape.kv_heads, shape.head_dim, s.ulysses, s.ring,
                          elem_bytes, shape.v_head_dim)
        b = backward_bytes(micro_batch, padded, shape.heads, shape.kv_heads, shape.head_dim, s.ulysses, s.ring,
                           elem_bytes, shape.v_head_dim)
        a2a += shape.attention_layers * (f.all_to_all + b.all_to_all) / bw(s.ulysses)
        ring += shape.attention_layers * (f.ring + b.ring) / bw(s.ulysses * s.ring if s.ring > 1 else 1)
    if shape.linear_layers:
        lf, lb = linear_bytes(micro_batch, padded, shape.linear_k_heads, shape.linear_v_heads, shape.linear_k_dim,
                              shape.linear_v_dim, shape.conv_kernel, s.ulysses, s.ring, elem_bytes, 2)
        a2a += shape.linear_layers * (lf.all_to_all + lb.all_to_all) / bw(s.ulysses)
        ring += shape.linear_layers * (lf.other + lb.other) / bw(s.ulysses * s.ring if s.ring > 1 else 1)
    attn_flops = 3 * attention_forward_flops(shape, padded, micro_batch, shape.causal, doc_lens)
    hidden = shape.attention_layers * attn_flops / s.sp / rate * (s.ring - 1) / s.ring if s.ring > 1 else 0.0
    per_param = elem_bytes * (3 if s.zero == 3 else 1) * (s.world - 1) / s.world
    zero = shape.params * per_param / bw(s.world) if s.world > 1 else 0.0
    return StepTime(compute=compute, all_to_all=a2a, ring=ring, ring_hidden=hidden, zero=zero, features=extra)


# ------------------------------------------------------------------------------------------ the memory features

KERNELS_PER_TILE = 30  # launches one MLP tile adds (its forward, recomputation and backward: matmuls, pointwise)
KERNELS_PER_CHUNK = 20  # launches one loss chunk adds (logits, softmax, its gradient, three matmuls)
KERNELS_PER_CHECKPOINT = 10  # launches a checkpointed layer adds besides its recomputation (saving, unpacking)
OFFLOAD_HIDDEN = 0.75  # the most of an offload copy's time a layer's compute hides (the first layers' never are)


@dataclass(frozen=True)
class FeatureModes:
    """What the ``usp`` memory keys leave to :func:`choose_features`.

    Attributes:
        chunked_loss: ``"auto"``, True or False.
        tiled_mlp: ``"auto"``, True or False.
        activation_checkpointing: ``"auto"``, ``"selective"``, ``"full"`` or False (a mode given: every layer).
        offload_activations: ``"auto"``, True or False.
        tile_mib: the most a loss chunk's fp32 logits and an MLP tile's backward may hold (None: what fits).
    """

    chunked_loss: object = "auto"
    tiled_mlp: object = "auto"
    activation_checkpointing: object = "auto"
    offload_activations: object = "auto"
    tile_mib: Optional[float] = None


class _Pricer:
    """The memory and the seconds of each feature at ``tokens`` per rank, in parts (the one place their formulas are
    written: :func:`activation_memory`, :func:`feature_seconds` and :func:`choose_features` use it)."""

    def __init__(self, shape: ModelShape, tokens: int, elem_bytes: int, attention_peak: float,
                 attention_flops: float, hw: Hardware, cal: Calibration, ulysses: int = 2) -> None:
        t, h, e = tokens, shape.hidden, elem_bytes
        self.shape, self.t, self.e, self.hw, self.cal = shape, t, e, hw, cal
        self.layers = shape.layers
        self.rate = hw.peak_tflops * 1e12 * hw.efficiency
        linear_layer = t * e * (2 * shape.linear_k_heads * shape.linear_k_dim + 3 * shape.linear_v_heads
                                * shape.linear_v_dim + 2 * shape.linear_v_heads) + t * e * cal.per_layer_hidden * h
        attention = attention_kept(t, shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim, ulysses, e) \
            if shape.attention_layers else 0.0
        self.whole, self.one = {}, {}
        for tiled in (False, True):
            full_layer = t * e * (cal.per_layer_hidden * h + (0.0 if tiled else cal.per_layer_mlp * shape.mlp_width)) \
                + attention
            # every layer kept, a tiled block's input included; the one a checkpointed layer recomputes
            self.whole[tiled] = (shape.attention_layers * full_layer + shape.linear_layers * linear_layer
                                 + (t * e * h * self.layers if tiled else 0.0))
            self.one[tiled] = max(full_layer if shape.attention_layers else 0.0,
                                  linear_layer if shape.linear_layers else 0.0)
        self.attention = attention_peak if shape.attention_layers else 0.0
        self.attention_flops = attention_flops
        self.proj = 2.0 * t * h * (2 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim)
        self.mlp = 2.0 * t * 3 * h * shape.mlp_width

    # ---- memory
    def kept(self, mode: str, k: int, offload: bool, tiled: bool) -> float:
        """What the layers keep on the device for their backward: ``k`` checkpointed (their inputs, unless offloaded;
        under selective checkpointing also what the policy saves, which stays on the device), the others whole."""
        per = self.t * self.e * self.shape.hidden * ((0 if offload else 1)
                                                     + (self.cal.selective_hidden if mode == "selective" else 0))
        return k * per + (self.whole[tiled] * (self.layers - k) / self.layers if self.layers else 0.0)

    def offloaded(self, k: int, offload: bool) -> float:
        """The bytes the ``k`` checkpointed layers' inputs take in host memory when offloaded (pinned)."""
        return _layer_inputs(self.shape, self.t, k if offload else 0, self.e)

    def backward(self, k: int, tiles: int) -> tuple[float, float]:
        """``(recomputed layer, the larger of the attention's and an MLP tile's buffers)`` in a layer's backward."""
        tile = math.ceil(self.t / tiles) * self.shape.mlp_width * self.e * MLP_LIVE if tiles else 0.0
        return (self.one[tiles > 0] if k else 0.0), max(self.attention, tile)

    def loss(self, chunk: int) -> float:
        """The loss's buffers: the whole fp32 logits, or one chunk's (its fp32 logits, and in a 2-byte dtype the
        logits' matmul output and the gradient cast back to it: 6 bytes per row and vocabulary entry), an fp32
        ``lm_head`` gradient (in a 2-byte dtype also the fp32 product added into it) and ``dx``."""
        if chunk:
            low = self.e != 4  # the chunk's matmuls run in a low-precision dtype (ds_usp.integration.step.loss)
            return min(chunk, self.t) * self.shape.vocab * (4 + (self.e if low else 0)) \
                + self.shape.vocab * self.shape.hidden * 4 * (2 if low else 1) + self.t * self.shape.hidden * self.e
        return self.t * self.shape.vocab * self.cal.logits

    def memory(self, f: Features) -> tuple[float, float, float]:
        """``(activations, loss, attention)`` at the peak (:func:`activation_memory`)."""
        k = self._k(f)
        kept = self.kept(f.checkpoint, k, f.offload, f.mlp_tiles > 0)
        one, transient = self.backward(k, f.mlp_tiles)
        loss = self.loss(f.loss_chunk)
        if loss >= one + transient:  # the loss's buffers are gone by the layers' backward
            return kept, loss, 0.0
        return kept + one, 0.0, transient

    # ---- seconds
    def layers_seconds(self, mode: str, k: int, offload: bool, tiles: int) -> float:
        """What checkpointing ``k`` layers and tiling every feed-forward block add (see :func:`feature_seconds`)."""
        tiled = tiles > 0
        flops = k * (self.proj + (0.0 if tiled else self.mlp) + (self.attention_flops if mode == "full" else 0.0))
        if tiled:
            flops += self.layers * self.mlp * 2 / 3
        launches = self.layers * tiles * KERNELS_PER_TILE + k * KERNELS_PER_CHECKPOINT
        exposed = 0.0
        if offload and k:  # a layer's forward and backward hide a share of its input's two copies at best
            copy = 2 * self.t * self.shape.hidden * self.e / (self.hw.host_bw * 1e9)
            exposed = k * max(copy * (1 - OFFLOAD_HIDDEN), copy - 3 * (self.proj + self.mlp) / self.rate)
        return flops / self.rate + launches * self.hw.launch_us * 1e-6 + exposed

    def loss_seconds(self, chunk: int, grad_in_forward: bool) -> float:
        """What the chunked loss adds: its chunks' launches, and ``2 T H V`` when it recomputes its logits."""
        if not chunk:
            return 0.0
        flops = 0.0 if grad_in_forward else 2.0 * self.t * self.shape.hidden * self.shape.vocab
        return flops / self.rate + math.ceil(self.t / chunk) * KERNELS_PER_CHUNK * self.hw.launch_us * 1e-6

    def seconds(self, f: Features) -> float:
        """:func:`feature_seconds`."""
        return self.layers_seconds(f.checkpoint, self._k(f), f.offload, f.mlp_tiles) + \
            self.loss_seconds(f.loss_chunk, f.loss_grad_in_forward)

    def _k(self, f: Features) -> int:
        return min(f.checkpoint_layers, self.layers) if f.checkpoint else 0


def feature_seconds(shape: ModelShape, tokens: int, f: Features, hw: Hardware, elem_bytes: int = 2,
                    attention_flops: float = 0.0) -> float:
    """Seconds the memory features add to one rank's step: recomputed FLOPs at ``peak x efficiency``, the offload
    copies' part not hidden behind a layer's compute, and the launches of each tile, chunk and checkpoint.

    * a checkpointed layer recomputes its projections, its feed-forward block when it is not tiled (a tiled block
      keeps its input, so the recomputation ends before it), and under ``"full"`` its attention's forward;
    * a tiled gated MLP recomputes ``gate`` and ``up`` (two thirds of its forward) per tile;
    * the chunked loss recomputing its logits adds ``2 T H V``; taking its gradients in the forward adds nothing;
    * an offloaded layer input goes to the host and back (``2 T H e`` bytes at ``host_bw``), overlapped with the
      layer's own forward and backward, at most :data:`OFFLOAD_HIDDEN` of it.

    Args:
        shape: the model.
        tokens: ``T``, tokens per rank.
        f: the features.
        hw: the device (its peak, efficiency, host bandwidth and launch cost).
        elem_bytes: the training dtype's bytes.
        attention_flops: one softmax layer's attention forward on this rank (for ``"full"`` checkpointing).

    Returns:
        Seconds.
    """
    return _Pricer(shape, tokens, elem_bytes, 0.0, attention_flops, hw, Calibration()).seconds(f)


def _chunk_options(tokens: int, cap_rows: Optional[int]) -> list[int]:
    """Loss chunk rows to try: multiples of :data:`ROW_MULTIPLE` doubling up to the tokens (rounded up), at most
    ``cap_rows``."""
    top = -(-tokens // ROW_MULTIPLE) * ROW_MULTIPLE
    rows, out = ROW_MULTIPLE, []
    while rows < top:
        out.append(rows)
        rows *= 2
    out.append(top)
    if cap_rows is not None:  # usp.tile_mib: a cap below one multiple is taken as it is (small models, tests)
        out = [r for r in out if r <= cap_rows] or [max(1, min(cap_rows, top))]
    return out


def _tile_options(tokens: int) -> list[int]:
    """MLP tile counts to try: 1, 2, 3, 4, 6, 8, 12, 16, 24... while a tile keeps at least :data:`ROW_MULTIPLE` tokens."""
    out, n = [1], 2
    while tokens / n >= ROW_MULTIPLE:
        out.append(n)
        n = n + 1 if n < 4 else n * 3 // 2 if n % 8 == 0 or n == 4 else n * 4 // 3
    return out


def _allowed(value: object, auto: list, on: list, off: list) -> list:
    return auto if value == "auto" else (off if value is False or value is None or value == "" else on)


def choose_features(shape: ModelShape, tokens: int, modes: FeatureModes, budget: float, hw: Hardware,
                    elem_bytes: int = 2, attention_peak: float = 0.0, attention_flops: float = 0.0,
                    offload_possible: bool = True, cal: Calibration = Calibration(),
                    host_budget: float = math.inf, ulysses: int = 2) -> tuple[Features, float, float]:
    """The fastest features whose activations fit ``budget``: what ``"auto"`` takes (and the planner's ``auto``).

    Every combination the keys allow is priced: the loss whole or in chunks (multiples of :data:`ROW_MULTIPLE` rows,
    gradients in the forward), the feed-forward blocks whole or in tiles, checkpointing (``"selective"`` or ``"full"``)
    of the first ``k`` layers for every ``k``, their inputs offloaded or not; a key set to true forces its feature (a
    checkpointing mode forces every layer), false rules it out. Memory: :func:`activation_memory`; time:
    :func:`feature_seconds`. The fastest combination that fits wins (ties: the one holding least); when none fits, the
    one holding least.

    Args:
        shape: the model.
        tokens: ``T``, tokens per rank.
        modes: the ``usp`` keys.
        budget: bytes the activations, the loss and the attention's buffers may take on one rank.
        hw: the device.
        elem_bytes: the training dtype's bytes.
        attention_peak: the attention's transient backward bytes.
        attention_flops: one layer's attention forward FLOPs on this rank.
        offload_possible: the device has a host to offload to (a GPU).
        cal: the measured constants.
        host_budget: the host bytes offloaded layer inputs may take (:meth:`Hardware.host_budget`): a row that
            offloads more is not taken.
        ulysses: U (:func:`attention_kept`).

    Returns:
        ``(features, activation bytes, seconds they add)``.
    """
    p = _Pricer(shape, tokens, elem_bytes, attention_peak, attention_flops, hw, cal, ulysses)
    layers = shape.layers
    cap = None if modes.tile_mib is None else int(modes.tile_mib * 2 ** 20 // (shape.vocab * 4))
    chunks = _chunk_options(tokens, cap)
    losses = sorted(((p.loss_seconds(c, True), p.loss(c), c) for c in
                     _allowed(modes.chunked_loss, [0] + chunks, chunks, [0])))  # fastest first
    tiles = _tile_options(tokens)
    if modes.tile_mib is not None:  # a tile's backward within the tile budget
        tiles = [n for n in tiles if math.ceil(tokens / n) * shape.mlp_width * elem_bytes * MLP_LIVE
                 <= modes.tile_mib * 2 ** 20] or tiles[-1:]
    tile_opts = _allowed(modes.tiled_mlp, [0] + tiles, tiles, [0])
    mode = modes.activation_checkpointing
    if mode == "auto":
        ckpts = [("", 0)] + [(m, k) for m in ("selective", "full") for k in range(1, layers + 1)]
    else:
        ckpts = [(mode, layers)] if mode in ("selective", "full") else [("", 0)]
    offloads = _allowed(modes.offload_activations, [False, True], [True], [False]) if offload_possible else [False]

    smallest_loss = min(b for _, b, _ in losses)
    best = least = None  # (seconds, bytes, features)
    for ckpt, k in ckpts:
        for offload in offloads:
            if offload and (not ckpt or p.offloaded(k, offload) > host_budget):
                continue
            for n in tile_opts:
                kept = p.kept(ckpt, k, offload, n > 0)
                one, transient = p.backward(k, n)
                layers_part = one + transient
                # a row's losses are looked at only where they can fit, or hold less than the least so far: the
                # planner's "nothing fits" searches price thousands of rows that can do neither
                floor = kept + max(smallest_loss, layers_part)  # the least this row can hold
                if floor > budget and least is not None and floor >= least[1]:
                    continue
                layers_s = p.layers_seconds(ckpt, k, offload, n)
                for loss_s, loss_b, chunk in losses:
                    mem = kept + max(loss_b, layers_part)
                    option = (layers_s + loss_s, mem, chunk, n, ckpt, k, offload)
                    if least is None or mem < least[1]:
                        least = option
                    if mem <= budget:
                        if best is None or option[:2] < best[:2]:
                            best = option
                        break  # the losses are sorted fastest first: the first that fits is this row's best
    sec, mem, chunk, n, ckpt, k, offload = best if best is not None else least
    return Features(loss_chunk=chunk, mlp_tiles=n, checkpoint=ckpt, checkpoint_layers=k, offload=offload), mem, sec
