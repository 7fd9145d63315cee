"""The Triton kernels behind :mod:`ds_usp.kernels.triton_attn` (imported on first use: needs triton).

Scores are kept in base 2 (``s = q.k * scale * log2(e)``, ``exp2``); LSEs are stored in natural log. With
``HAS_SOFTCAP`` the natural-log scores are soft-capped, ``c * tanh(q.k * scale / c)`` (``c = softcap``), and the
backward multiplies the score gradient by ``1 - tanh^2``.
A pair ``(i, j)`` (local query and key index) is kept when ``lo <= j - i <= hi`` and, with documents,
``q_doc[i] == k_doc[j]``; ``lo``/``hi`` arrive as integers (an absent edge is one no pair reaches).
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``; IEEE: exact fp32 products (fp32 inputs, and bf16 in the interpreter, whose bf16 dot
    is wrong on triton 3.9)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tanh(x):
    """tanh from one exp (stable for any x)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(qk, scale_log2, softcap, HAS_SOFTCAP: tl.constexpr):
    """Base-2 scores of the dot products ``qk`` and ``t = tanh(q.k * scale / softcap)`` (``qk`` itself unless
    soft-capped; the backward needs ``1 - t^2``)."""
    if HAS_SOFTCAP:
        t = _tanh(qk * (scale_log2 * LN2) / softcap)
        return t * (softcap * LOG2E), t
    else:
        return qk * scale_log2, qk


@triton.jit
def _keep(offs_m, offs_n, nq, nk, lo, hi, qdoc, kdoc, HAS_DOC: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) mask of kept pairs of a tile."""
    diff = offs_n[None, :] - offs_m[:, None]
    keep = (diff >= lo) & (diff <= hi) & (offs_n[None, :] < nk) & (offs_m[:, None] < nq)
    if HAS_DOC:
        keep = keep & (qdoc[:, None] == kdoc[None, :])
    return keep


@triton.jit
def _tile_docs(D, start, end, offs, n, HAS_DOC: tl.constexpr, OTHER: tl.constexpr):
    """A tile's document ids (``OTHER`` past ``n``) and the documents of its first and last row ``end - 1``
    (ids ascend along the sequence, so the tile's documents are the range between); zeros without documents."""
    doc = tl.zeros(offs.shape, tl.int32)
    first = 0
    last = 0
    if HAS_DOC:
        doc = tl.load(D + offs, mask=offs < n, other=OTHER)
        first = tl.load(D + start)
        last = tl.load(D + end - 1)
    return doc, first, last


@triton.jit
def _query_tile(Q, sqb, sqs, sqh, nq, hq, groups, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (query tile, batch x head): batch, head, kv head, the tile's rows and its queries."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bi = pid_bh // hq
    h = pid_bh % hq
    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < nq
    q = tl.load(Q + bi * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    return bi, h, h // groups, m_start, tl.minimum(m_start + BLOCK_M, nq), offs_m, offs_d, row_ok, q


@triton.jit
def fwd(Q, K, V, O, L, QD, KD,
        sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh, sls,
        nq, nk, hq, groups, scale_log2, softcap, lo, hi,
        HAS_DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MERGE: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (query tile, batch x head): online softmax over the key tiles the mask allows."""
    bi, h, kh, m_start, m_end, offs_m, offs_d, row_ok, q = _query_tile(Q, sqb, sqs, sqh, nq, hq, groups, BLOCK_M,
                                                                       BLOCK_D)
    qdoc, qd_first, qd_last = _tile_docs(QD, m_start, m_end, offs_m, nq, HAS_DOC, -1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + bi * skb + kh * skh
    v_base = V + bi * svb + kh * svh
    j_lo = tl.maximum(m_start + lo, 0)  # keys some row of the tile may see: [j_lo, j_hi)
    j_hi = tl.minimum(m_end - 1 + hi + 1, nk)
    for n_start in range((j_lo // BLOCK_N) * BLOCK_N, j_hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_last = tl.minimum(n_start + BLOCK_N, nk) - 1
        visit = n_start < nk
        need_mask = (n_start - (m_end - 1) < lo) | (n_start + BLOCK_N - 1 - m_start > hi) | (n_start + BLOCK_N > nk)
        kdoc, kd_first, kd_last = _tile_docs(KD, n_start, n_last + 1, offs_n, nk, HAS_DOC, -2)
        if HAS_DOC:
            visit = visit & (kd_last >= qd_first) & (kd_first <= qd_last)
            need_mask = need_mask | (kd_first != kd_last) | (qd_first != qd_last) | (kd_first != qd_first)
        if visit:
            col_ok = offs_n < nk
            k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            s, _ = _scores(_dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE), scale_log2, softcap,
                           HAS_SOFTCAP)
            if need_mask:
                s = tl.where(_keep(offs_m, offs_n, nq, nk, lo, hi, qdoc, kdoc, HAS_DOC), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing kept yet stay at zero
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
            m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    o_ptr = O + bi * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :]
    l_ptr = L + bi * slb + h * slh + offs_m * sls
    if MERGE:  # fold into the running (out, lse): exact log-sum-exp merge, rows seeing nothing stay 0 / -inf
        lse_old = tl.load(l_ptr, mask=row_ok, other=float("-inf"))
        top = tl.maximum(lse_old, lse)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.exp(lse_old - top_safe) + tl.exp(lse - top_safe)
        new = tl.where(total > 0.0, top_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        new_safe = tl.where(new == float("-inf"), 0.0, new)
        # row weights first, then one pass over the tile: acc is scaled in place before the old tile is loaded
        o = acc * (tl.exp(lse - new_safe) / l_safe)[:, None]
        o += tl.load(o_ptr, mask=row_ok[:, None], other=0.0) * tl.exp(lse_old - new_safe)[:, None]
        lse = new
    else:
        o = acc / l_safe[:, None]
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(l_ptr, lse, mask=row_ok)


@triton.jit
def bwd_dkdv(Q, K, V, DO, L, DELTA, DK, DV, QD, KD,
             sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, slb, slh, sls, seb, seh, ses,
             skgb, skgs, skgh, svgb, svgs, svgh,
             nq, nk, hq, groups, scale_log2, softcap, lo, hi,
             HAS_DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (key tile, batch x kv head): dK and dV summed over the head's q-head group and the query tiles."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    hkv = hq // groups
    bi = pid_bh // hkv
    kh = pid_bh % hkv
    n_start = pid_n * BLOCK_N
    n_end = tl.minimum(n_start + BLOCK_N, nk)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < nk
    k = tl.load(K + bi * skb + kh * skh + offs_n[:, None] * sks + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + bi * svb + kh * svh + offs_n[:, None] * svs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    kdoc, kd_first, kd_last = _tile_docs(KD, n_start, n_end, offs_n, nk, HAS_DOC, -2)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    i_lo = tl.maximum(n_start - hi, 0)  # queries that may see a key of the tile: [i_lo, i_hi)
    i_hi = tl.minimum(n_end - 1 - lo + 1, nq)
    for g in range(0, groups):
        h = kh * groups + g
        for m_start in range((i_lo // BLOCK_M) * BLOCK_M, i_hi, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < nq
            visit = m_start < nq
            qdoc, qd_first, qd_last = _tile_docs(QD, m_start, tl.minimum(m_start + BLOCK_M, nq), offs_m, nq, HAS_DOC,
                                                 -1)
            if HAS_DOC:
                visit = visit & (kd_last >= qd_first) & (kd_first <= qd_last)
            if visit:
                q = tl.load(Q + bi * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None],
                            other=0.0)
                do = tl.load(DO + bi * sdb + h * sdh + offs_m[:, None] * sds + offs_d[None, :],
                             mask=row_ok[:, None], other=0.0)
                lse2 = tl.load(L + bi * slb + h * slh + offs_m * sls, mask=row_ok, other=float("-inf")) * LOG2E
                lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # rows that saw nothing: p = 0
                delta = tl.load(DELTA + bi * seb + h * seh + offs_m * ses, mask=row_ok, other=0.0)
                s, t = _scores(_dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE), scale_log2,
                               softcap, HAS_SOFTCAP)
                keep = _keep(offs_m, offs_n, nq, nk, lo, hi, qdoc, kdoc, HAS_DOC)
                p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)
                dv = _dot(tl.trans(p.to(do.dtype)), do, dv, IEEE)
                dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE)
                ds = p * (dp - delta[:, None])
                if HAS_SOFTCAP:
                    ds = ds * (1.0 - t * t)
                dk = _dot(tl.trans(ds.to(q.dtype)), q, dk, IEEE)
    dk = dk * (scale_log2 * LN2)
    tl.store(DK + bi * skgb + kh * skgh + offs_n[:, None] * skgs + offs_d[None, :], dk, mask=col_ok[:, None])
    tl.store(DV + bi * svgb + kh * svgh + offs_n[:, None] * svgs + offs_d[None, :], dv, mask=col_ok[:, None])


@triton.jit
def bwd_dq(Q, K, V, DO, L, DELTA, DQ, QD, KD,
           sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, slb, slh, sls, seb, seh, ses,
           sqgb, sqgs, sqgh,
           nq, nk, hq, groups, scale_log2, softcap, lo, hi,
           HAS_DOC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (query tile, batch x head): dQ over the key tiles the mask allows."""
    bi, h, kh, m_start, m_end, offs_m, offs_d, row_ok, q = _query_tile(Q, sqb, sqs, sqh, nq, hq, groups, BLOCK_M,
                                                                       BLOCK_D)
    do = tl.load(DO + bi * sdb + h * sdh + offs_m[:, None] * sds + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(L + bi * slb + h * slh + offs_m * sls, mask=row_ok, other=float("-inf")) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = tl.load(DELTA + bi * seb + h * seh + offs_m * ses, mask=row_ok, other=0.0)
    qdoc, qd_first, qd_last = _tile_docs(QD, m_start, m_end, offs_m, nq, HAS_DOC, -1)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + bi * skb + kh * skh
    v_base = V + bi * svb + kh * svh
    j_lo = tl.maximum(m_start + lo, 0)
    j_hi = tl.minimum(m_end - 1 + hi + 1, nk)
    for n_start in range((j_lo // BLOCK_N) * BLOCK_N, j_hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < nk
        visit = n_start < nk
        kdoc, kd_first, kd_last = _tile_docs(KD, n_start, tl.minimum(n_start + BLOCK_N, nk), offs_n, nk, HAS_DOC, -2)
        if HAS_DOC:
            visit = visit & (kd_last >= qd_first) & (kd_first <= qd_last)
        if visit:
            k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            s, t = _scores(_dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE), scale_log2, softcap,
                           HAS_SOFTCAP)
            keep = _keep(offs_m, offs_n, nq, nk, lo, hi, qdoc, kdoc, HAS_DOC)
            p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE)
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq = _dot(ds.to(k.dtype), k, dq, IEEE)
    dq = dq * (scale_log2 * LN2)
    tl.store(DQ + bi * sqgb + h * sqgh + offs_m[:, None] * sqgs + offs_d[None, :], dq, mask=row_ok[:, None])
