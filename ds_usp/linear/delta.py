"""Gated delta rule pieces for sequence parallelism, in one process: segments, their states, the convolution halo.

Notation (docs/architecture.md): per linear head a state ``S`` of ``dk x dv``; the gated delta rule
(Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo Hybrid) updates it per token as
``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` and reads ``o_t = S_t^T q_t``. Both are *affine in the
initial state*: a segment started from ``S0``
ends in ``M S0 + B`` and outputs ``o_t + u_t S0``, where ``B`` and ``o_t`` are what it computes from a zero
start, ``M`` (``dk x dk``) is its transition and ``u_t = M_{1..t}^T q_t``. :func:`run_segment` gets all of them
from *one* call of the family's own kernel by carrying the identity along: values ``[v | 0]`` from the initial
state ``[0 | I]`` end in ``[B | M]`` and output ``[o | u]``. So every rank runs its segments in parallel from
zero, the ranks exchange ``(M, B)``, and each corrects its outputs with the true initial state
(:func:`initial_states`, :func:`with_initial_state`): no second pass, no pipeline (LASP-2's parallel form).

The short causal convolution before the rule needs the last ``K - 1`` inputs before a segment (its halo, zeros at
a document start): :func:`causal_conv`.

A *segment* is a maximal run of positions one rank holds that crosses no document start: its state starts at zero
at a document start, and otherwise continues the segment before it in global order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# rule(q, k, v, g, beta, initial_state) -> (out (b, t, nv, dv'), final state (b, nv, dk, dv') fp32): the family's
# chunked gated delta rule (transformers' torch one, or flash-linear-attention's on GPUs), l2-norm of q/k inside
Rule = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Optional[Tensor]], tuple[Tensor, Tensor]]


def state_dtype(x: Tensor) -> torch.dtype:
    """The dtype states and corrections are kept in: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.promote_types(x.dtype, torch.float32)


@dataclass(frozen=True)
class Segment:
    """A maximal run of global positions ``[start, stop)`` one rank holds that crosses no document start.

    Attributes:
        start: first global position.
        stop: one past the last.
        row: where the segment starts in the rank's piece (local index).
        first: the segment starts a document (its state and halo start at zero).
    """

    start: int
    stop: int
    row: int
    first: bool

    @property
    def length(self) -> int:
        """Tokens in the segment."""
        return self.stop - self.start


def segments(runs: tuple[tuple[int, int], ...], doc_starts: tuple[int, ...], seq_len: int) -> tuple[Segment, ...]:
    """Cut a rank's runs of positions at every document start (and at the end of the real tokens).

    Args:
        runs: ``((start, length), ...)`` the positions the rank holds, in piece order.
        doc_starts: the first position of every document of the row (0 first).
        seq_len: the real length: positions past it (padding) form a document of their own.

    Returns:
        The segments in piece order.
    """
    cuts = sorted(set(doc_starts) | {seq_len})
    out, row = [], 0
    for start, length in runs:
        a, stop = start, start + length
        while a < stop:
            b = min([c for c in cuts if a < c < stop] + [stop])
            out.append(Segment(a, b, row + a - start, a in cuts))
            a = b
        row += length
    return tuple(out)


@dataclass
class SegmentRun:
    """What one segment computes from a zero state (shapes: ``t`` its tokens, ``n`` its value heads).

    Attributes:
        out: ``(b, t, n, dv)`` the outputs.
        final: ``(b, n, dk, dv)`` fp32, the final state.
        response: ``(b, t, n, dk)``: the outputs from an initial state ``S0`` are ``out + response @ S0`` (None:
            the segment starts a document, its initial state is zero).
        transition: ``(b, n, dk, dk)`` fp32: the final state from ``S0`` is ``transition @ S0 + final`` (None: no
            segment continues this one).
    """

    out: Tensor
    final: Tensor
    response: Optional[Tensor] = None
    transition: Optional[Tensor] = None


def run_segment(rule: Rule, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                affine: bool) -> SegmentRun:
    """One segment from a zero state; with ``affine``, also its response to the initial state and its transition.

    Args:
        rule: the family's delta rule.
        q: ``(b, t, nk, dk)`` after the convolution.
        k: ``(b, t, nk, dk)``.
        v: ``(b, t, nv, dv)``.
        g: ``(b, t, nv)`` fp32 log decays (or ``(b, t, nv, m)``, what the rule reads: KDA, Mamba-2).
        beta: ``(b, t, nv)``.
        affine: also compute ``response`` and ``transition`` (one call, with the identity carried along ``v``).

    Returns:
        The :class:`SegmentRun`.
    """
    if not affine:
        out, final = rule(q, k, v, g, beta, None)
        return SegmentRun(out, final)
    b, t, n, dv = v.shape
    dk = k.shape[-1]
    zeros = v.new_zeros(b, t, n, dk)
    init = torch.zeros(b, n, dk, dv + dk, dtype=state_dtype(v), device=v.device)
    init[..., dv:] = torch.eye(dk, dtype=init.dtype, device=v.device)  # [0 | I]
    out, final = rule(q, k, torch.cat([v, zeros], dim=-1), g, beta, init)  # values [v | 0]
    return SegmentRun(out[..., :dv], final[..., :dv], out[..., dv:], final[..., dv:])


def with_initial_state(run: SegmentRun, state: Optional[Tensor]) -> Tensor:
    """The segment's outputs from the initial state ``state`` (``(b, n, dk, dv)``; None: zero).

    Returns:
        ``(b, t, n, dv)`` in the outputs' dtype.
    """
    if state is None:
        return run.out
    acc = state_dtype(run.out)
    # (b, t, n, dk) x (b, n, dk, dv) -> (b, t, n, dv)
    return (run.out.to(acc) + torch.einsum("btnk,bnkv->btnv", run.response.to(acc), state.to(acc))).to(run.out.dtype)


def initial_states(order: list[tuple[bool, Optional[Tensor], Tensor]]) -> list[Optional[Tensor]]:
    """The initial state of every segment of a row, in global order, from each one's ``(first, transition, final)``.

    ``S0 = 0`` at a document start (None), else ``transition_prev @ S0_prev + final_prev``.

    Args:
        order: per segment in global order: whether it starts a document, its transition (may be None when it
            is the last of its document) and its zero-start final state.

    Returns:
        Per segment, its initial state (None: zero).
    """
    states: list[Optional[Tensor]] = []
    for i, (first, _, _) in enumerate(order):
        if first or i == 0:
            states.append(None)
            continue
        _, trans, final = order[i - 1]
        prev = states[-1]
        states.append(final if prev is None else torch.matmul(trans, prev) + final)
    return states


def row_groups(docs: Optional[tuple[tuple[int, ...], ...]]) -> list[tuple[slice, tuple[int, ...]]]:
    """The batch rows that share one document layout, as ``(rows, document starts)``: all rows at once when every
    row has the same documents (or none), else one row at a time."""
    if docs is None or len(set(docs)) == 1:
        return [(slice(None), docs[0] if docs else (0,))]
    return [(slice(i, i + 1), row) for i, row in enumerate(docs)]


def causal_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], halo: Tensor,
                activation: Callable[[Tensor], Tensor]) -> Tensor:
    """The short causal depthwise convolution of a segment, continuing from the ``K - 1`` inputs before it.

    Args:
        x: ``(b, t, C)`` the segment's inputs.
        weight: ``(C, K)`` one filter per channel.
        bias: ``(C,)`` or None.
        halo: ``(b, K - 1, C)`` the inputs before the segment (zeros at a document start).
        activation: applied to the result (Qwen3-Next: SiLU).

    Returns:
        ``(b, t, C)`` in ``x``'s dtype (computed in the weight's, as transformers does).
    """
    xx = torch.cat([halo, x], dim=1).transpose(1, 2).to(weight.dtype)  # (b, K-1+t, C) -> (b, C, K-1+t)
    y = F.conv1d(xx, weight.unsqueeze(1), bias, groups=weight.shape[0])  # (b, C, t)
    return activation(y).transpose(1, 2).to(x.dtype)  # -> (b, t, C)


def halo_of(tails: list[tuple[bool, Tensor, int]], kernel: int) -> Optional[Tensor]:
    """The last ``kernel - 1`` inputs before a segment, from the segments before it in its document.

    Args:
        tails: the earlier segments of the document, nearest last: ``(first, last inputs (b, <= K-1, C), length)``;
            a segment shorter than ``K - 1`` contributes all it has, and the walk continues before it.
        kernel: K.

    Returns:
        ``(b, K - 1, C)``, zero-padded where the document starts closer than ``K - 1``; None when ``tails`` is empty.
    """
    if not tails:
        return None
    parts, have = [], 0
    for first, tail, length in reversed(tails):
        take = min(length, kernel - 1 - have, tail.shape[1])
        if take > 0:
            parts.append(tail[:, tail.shape[1] - take:])
            have += take
        if first or have >= kernel - 1:
            break
    got = torch.cat(parts[::-1], dim=1) if parts else tails[-1][1][:, :0]
    return F.pad(got, (0, 0, kernel - 1 - got.shape[1], 0))  # zeros for what precedes the document
