"""Bytes sent and bytes saved per rank per USP attention layer equal the model of ds_usp.cost, on 4 gloo ranks.

For every (U, R) split of 4 ranks over a small matrix (fp32/bf16, kv heads = H, H_kv < U (GQA
replication) and MQA, causal zigzag / causal contiguous / non-causal, a length that needs padding, and
``usp.comm_dtype = "fp8"``),
``measure_attention`` (ds_usp/instruments/meters.py) meters one layer's forward and backward: the bytes each rank sends
must equal the closed form within 1 % (they agree exactly), and the bytes autograd saves for the
backward must equal ``attention_memory(...).saved`` exactly.
"""
from __future__ import annotations

import pytest
import torch

from ds_usp.cost import Volume, attention_memory, backward_bytes, forward_bytes, sent_kv_heads

H, D, B = 4, 8, 2
TOLERANCE = 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = [  # (b, seq, H, H_kv, D, dtype, causal, layout, comm_dtype)
    (B, 64, H, H, D, "fp32", True, "zigzag", "input"),
    (B, 64, H, 2, D, "fp32", True, "contiguous", "input"),  # H_kv < U=4: kv replicated before the all-to-all
    (B, 64, H, 1, D, "bf16", False, "zigzag", "input"),  # MQA, bf16 (dK/dV on the wire in bf16 too)
    (1, 61, H, 2, D, "bf16", True, "zigzag", "input"),  # padded to 64 (zigzag: a multiple of 2N)
    (1, 70, H, H, D, "fp32", False, "contiguous", "input"),  # padded to 72
    (B, 64, H, 2, D, "bf16", True, "zigzag", "fp8"),  # forward activations and K/V hops as e4m3 + scales
    (1, 70, H, H, D, "fp32", False, "contiguous", "fp8"),
]


def _rel_err(measured: float, formula: float) -> float:
    return abs(measured - formula) / formula if formula else (0.0 if measured == 0 else float("inf"))


def measure_split(u: int, r: int) -> list:
    """On every rank: build the (u, r) topology and meter each case; returns (fwd, bwd, saved) per case."""
    import ds_usp
    from ds_usp.instruments.meters import measure_attention
    from ds_usp.sharding import padded_length

    topo = ds_usp.USPTopology.build(u, r)
    results = []
    for b, seq, h, hkv, d, dtype, causal, layout, wire in CASES:
        s_local = padded_length(seq, u, r, layout) // (u * r)
        g = torch.Generator().manual_seed(topo.rank)
        q, k, v, dout = (torch.randn(b, s_local, n, d, generator=g).to(DTYPES[dtype]) for n in (h, hkv, hkv, h))
        results.append(measure_attention(topo, q, k, v, dout, causal=causal, layout=layout, seq_len=seq,
                                         comm_dtype=wire))
    return results


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2), (1, 4)])
def test_bytes_sent_and_saved_match_the_model(world4, u, r):
    from ds_usp.sharding import padded_length

    per_rank = world4.run(measure_split, u, r)
    failures = []
    for i, (b, seq, h, hkv, d, dtype, causal, layout, wire) in enumerate(CASES):
        args = (b, padded_length(seq, u, r, layout), h, hkv, d, u, r, torch.empty(0, dtype=DTYPES[dtype]).element_size())
        f_form, b_form = forward_bytes(*args, comm_dtype=wire), backward_bytes(*args, comm_dtype=wire)
        memory = attention_memory(*args)
        for rank, results in enumerate(per_rank):
            fwd, bwd, saved = results[i]
            for what, got, want in (("fwd", fwd, f_form), ("bwd", bwd, b_form)):
                if got.other or _rel_err(got.total, want.total) > TOLERANCE:
                    failures.append(f"{u}x{r} case {i} rank {rank} {what}: measured {got} vs closed form {want}")
            if saved != memory.saved:
                failures.append(f"{u}x{r} case {i} rank {rank}: saved {saved} bytes, model {memory.saved}")
    assert not failures, "\n".join(failures)


def test_closed_form_hand_values():
    """Spot values: b=1, L=1024, H=H_kv=4, D=16, N=4 (b L/N = 256 tokens, H D = 64 per token)."""
    tok, d = 256, 4 * 16
    # Ulysses 4x1: (3/4) (2 d + 2 d) 4 bytes each way, no ring.
    assert forward_bytes(1, 1024, 4, 4, 16, 4, 1, 4) == Volume(tok * 4 * 3 / 4 * 4 * d, 0)
    assert backward_bytes(1, 1024, 4, 4, 16, 4, 1, 4) == Volume(tok * 4 * 3 / 4 * 4 * d, 0)
    # Ring 1x4: K+V 3 hops forward; backward K+V 3 hops plus 3 blocks of dK+dV, each sent once to its owner, in
    # the training dtype: in bf16 3/8 of the bytes of an fp32 accumulator travelling 4 hops with its block.
    assert forward_bytes(1, 1024, 4, 4, 16, 1, 4, 2) == Volume(0, tok * 2 * 2 * 3 * d)
    assert backward_bytes(1, 1024, 4, 4, 16, 1, 4, 2) == Volume(0, tok * 2 * d * (3 * 2 + 3 * 2))
    assert backward_bytes(1, 1024, 4, 4, 16, 1, 4, 4) == Volume(0, tok * 2 * d * (3 * 4 + 3 * 4))
    # GQA with H_kv = 2 < U = 8: the all-to-all carries 8 kv heads, as many as with H_kv = 8.
    assert forward_bytes(1, 4096, 8, 2, 64, 8, 1, 4) == forward_bytes(1, 4096, 8, 8, 64, 8, 1, 4)
    assert forward_bytes(1, 4096, 8, 2, 64, 8, 1, 4).total > forward_bytes(1, 4096, 8, 2, 64, 4, 2, 4).all_to_all
    with pytest.raises(ValueError, match="divide"):
        sent_kv_heads(3, 2)
    # fp8 wire, U=4 x R=2, H=8, H_kv=2, D=64: the forward sends 1 byte per element plus a 4-byte scale per head of a
    # token (q, k, v and the output in the all-to-alls; each K/V hop); the backward keeps e for its all-to-alls and
    # dK/dV, and carries the forward's fp8 K/V again.
    tok, hk = 4096 // 8, 4  # H_kv' = U
    fwd = forward_bytes(1, 4096, 8, 2, 64, 4, 2, 2, comm_dtype="fp8")
    assert fwd == Volume(tok * 3 / 4 * ((2 * 8 + 2 * hk) * 64 + 4 * (2 * 8 + 2 * hk)), tok * (2 * hk * 64 + 4 * hk))
    bwd = backward_bytes(1, 4096, 8, 2, 64, 4, 2, 2, comm_dtype="fp8")
    assert bwd == Volume(backward_bytes(1, 4096, 8, 2, 64, 4, 2, 2).all_to_all,
                         tok * ((2 * hk * 64 + 4 * hk) + 2 * 2 * hk * 64))
    # MLA (D = 192, D_v = 128): q, k, v travel in rows of gcd = 64 columns, the output in rows of D_v.
    mla = forward_bytes(1, 4096, 8, 8, 192, 4, 1, 2, v_head_dim=128, comm_dtype="fp8")
    assert mla.all_to_all == tok * 2 * 3 / 4 * (8 * 320 * 2 + 4 * ((8 * 192 + 8 * 320) / 64 + 8))
