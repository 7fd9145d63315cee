"""Bytes sent per rank per USP attention layer equal the closed form (issue 6), on a 4-rank gloo world.

The closed form and the byte counter live in benchmarks/comm_volume.py (one copy); this test runs its
``measure_layer`` for every (U, R) split of 4 ranks over a small matrix: fp32/bf16, kv heads = H,
H_kv < U (GQA replication) and MQA, causal zigzag / causal contiguous / non-causal, and a length that
needs padding. Measured and formula must agree within 1 % (they agree exactly).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import comm_volume as cv  # noqa: E402

H, D, B = 4, 8, 2
CASES = [
    cv.Case(B, 64, H, H, D, "fp32", "causal-zigzag"),
    cv.Case(B, 64, H, 2, D, "fp32", "causal-contiguous"),  # H_kv < U=4: kv replicated before the all-to-all
    cv.Case(B, 64, H, 1, D, "bf16", "full-zigzag"),  # MQA, bf16 (fp32 dK/dV accumulators all the same)
    cv.Case(1, 61, H, 2, D, "bf16", "causal-zigzag"),  # padded to 64 (zigzag: a multiple of 2N)
    cv.Case(1, 70, H, H, D, "fp32", "full-contiguous"),  # padded to 72
]


def measure_split(u: int, r: int, cases: list) -> list:
    """On every rank: build the (u, r) topology and measure each case; returns (fwd, bwd) per case."""
    from ds_usp import USPTopology

    topo = USPTopology.build(u, r)
    return [cv.measure_layer(topo, case) for case in cases]


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2), (1, 4)])
def test_bytes_sent_match_closed_form(world4, u, r):
    per_rank = world4.run(measure_split, u, r, CASES)
    failures = []
    for i, case in enumerate(CASES):
        f_form, b_form = case.formula(u, r)
        for rank, results in enumerate(per_rank):
            fwd, bwd = results[i]
            for what, got, want in (("fwd", fwd, f_form), ("bwd", bwd, b_form)):
                if got.other or cv.rel_err(got.total, want.total) > cv.TOLERANCE:
                    failures.append(f"{u}x{r} {case} rank {rank} {what}: measured {got} vs closed form {want}")
    assert not failures, "\n".join(failures)


def test_closed_form_reduces_to_the_issue_formula():
    """With H_kv >= U the forward is the issue's formula; with H_kv < U it is larger by the replication."""
    for u, r in ((4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)):
        args = (2, 4096, 8, 8, 64, u, r, 2)
        assert cv.forward_bytes(*args).total == cv.issue_forward_bytes(*args)
    gqa = (1, 4096, 8, 2, 64, 8, 1, 4)  # H_kv = 2 < U = 8: d_kv' = 8 D
    assert cv.forward_bytes(*gqa).total == cv.issue_forward_bytes(1, 4096, 8, 8, 64, 8, 1, 4)
    assert cv.forward_bytes(*gqa).total > cv.issue_forward_bytes(*gqa)


def test_closed_form_hand_values():
    """Spot values: b=1, L=1024, H=H_kv=4, D=16, fp32, N=4 (b L/N = 256 tokens, d = 64 per head group)."""
    tok, d = 256, 4 * 16
    # Ulysses 4x1: (3/4) (2 d + 2 d) 4 bytes each way, no ring.
    assert cv.forward_bytes(1, 1024, 4, 4, 16, 4, 1, 4) == cv.Volume(tok * 4 * 3 / 4 * 4 * d, 0)
    assert cv.backward_bytes(1, 1024, 4, 4, 16, 4, 1, 4) == cv.Volume(tok * 4 * 3 / 4 * 4 * d, 0)
    # Ring 1x4: K+V 3 hops forward; backward K+V 3 hops plus fp32 dK+dV 4 hops, whatever the dtype.
    assert cv.forward_bytes(1, 1024, 4, 4, 16, 1, 4, 2) == cv.Volume(0, tok * 2 * 2 * 3 * d)
    assert cv.backward_bytes(1, 1024, 4, 4, 16, 1, 4, 2) == cv.Volume(0, tok * 2 * d * (3 * 2 + 4 * 4))
    with pytest.raises(ValueError, match="divide"):
        cv.sent_kv_heads(3, 2)
