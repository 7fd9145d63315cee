"""A ring exchange staged through host buffers gives bitwise what the direct one gives (issue 63, the shared GPU).

gloo's send and recv take host memory only, so on a GPU shared by ranks over gloo, ``ds_usp.comm`` stages each ring
exchange of CUDA tensors through pinned host buffers of a pool. On CPU the same code runs when a group is marked with
``ds_usp.comm.stage_point_to_point`` (test-only): unpinned buffers, no device waits. On 4 gloo ranks, at (U, R) = (2, 2)
and (1, 4), staged and direct runs of ``ring_shift``, ``ring_exchange`` (two tensors, two hops, fp32 and bf16) and the
USP attention's forward and backward (causal zigzag, GQA) must agree bit for bit and send the same bytes
(``CommCounter``); the pool makes no buffer after the first of repeated calls, and the group's backend is looked up
once, not per exchange.
"""
from __future__ import annotations

import sys

import pytest
import torch

from dist_harness import get_topo

SEQ, HQ, HKV, D = 64, 4, 2, 8
REPEATS = 3


def _exchanges(topo) -> list:
    """``ring_shift`` of an fp32 block and ``ring_exchange`` of (bf16 block, 1 hop) and (fp32 block, R - 1 hops)."""
    from ds_usp.comm import ring_exchange, ring_shift

    group, ranks = topo.ring_group, topo.ring_ranks
    me = ranks.index(topo.rank)
    g = torch.Generator().manual_seed(100 + topo.rank)
    a = torch.randn(2, 8, 3, generator=g)
    b = torch.randn(4, 5, generator=g).to(torch.bfloat16)
    shifted = ring_shift(a, group, ranks, me)()
    both = ring_exchange([(b, 1), (a, len(ranks) - 1)], group, ranks, me)()
    return [shifted, *both]


def _attention(topo) -> list:
    """The USP attention's output and q/k/v gradients on this rank's shards (causal zigzag, GQA)."""
    import ds_usp

    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, SEQ, n, D, generator=g) for n in (HQ, HKV, HKV, HQ))
    shards = [ds_usp.shard_sequence(x, topo, 1, "zigzag").requires_grad_() for x in (q, k, v)]
    out = ds_usp.usp_attention(*shards, topo, causal=True, layout="zigzag", seq_len=SEQ, native_op=False)
    out.backward(ds_usp.shard_sequence(dout, topo, 1, "zigzag"))
    return [out.detach(), *(x.grad for x in shards)]


def _metered(fn, topo) -> tuple[list, int]:
    """``fn(topo)``'s tensors and the ring bytes this rank sent meanwhile."""
    from ds_usp.instruments.meters import CommCounter

    counter = CommCounter()
    with counter.phase("run"):
        got = fn(topo)
    return got, counter.volume("run").ring


def staged_against_direct(u: int, r: int) -> dict:
    """On every rank: each function direct, then staged ``REPEATS`` times; bitwise agreement, bytes, pool counts."""
    import torch.distributed as dist

    from ds_usp import comm

    topo = get_topo(u, r)
    lookups = []
    backend = dist.get_backend

    def counted(group=None):  # the routes' lookups (group_device's, for other callers' small tensors, are not counted)
        if sys._getframe(1).f_code is comm._route.__code__:
            lookups.append(group)
        return backend(group)

    found: dict = {"equal": {}, "bytes": {}, "allocations": {}, "buffers": {}}
    for name, fn in (("exchanges", _exchanges), ("attention", _attention)):
        want, want_bytes = _metered(fn, topo)
        comm.stage_point_to_point(topo.ring_group)
        dist.get_backend = counted
        try:
            before = comm.staging_stats()
            runs = []
            for _ in range(REPEATS):
                runs.append(_metered(fn, topo))
                runs[-1] += (comm.staging_stats(),)
        finally:
            dist.get_backend = backend
            comm.stage_point_to_point(topo.ring_group, on=False)
        found["equal"][name] = all(len(got) == len(want) and all(torch.equal(x, y) and x.dtype == y.dtype
                                                                 for x, y in zip(got, want)) for got, _, _ in runs)
        found["bytes"][name] = (want_bytes, [sent for _, sent, _ in runs])
        found["allocations"][name] = [before["allocations"]] + [stats["allocations"] for _, _, stats in runs]
        found["buffers"][name] = [stats["buffers"] for _, _, stats in runs]
        found.setdefault("staged", {})[name] = runs[-1][2]["exchanges"] - before["exchanges"]
    found["lookups"] = len(lookups)
    found["host_syncs"] = comm.staging_stats()["host_syncs"]
    return found


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4)])
def test_staged_ring_exchanges_equal_direct_ones(world4, u, r):
    for rank, found in enumerate(world4.run(staged_against_direct, u, r)):
        for name in ("exchanges", "attention"):
            assert found["equal"][name], f"rank {rank}: staged {name} differ from direct ones"
            want, sent = found["bytes"][name]
            assert want > 0 and sent == [want] * REPEATS, f"rank {rank}: {name} sent {sent} bytes, direct {want}"
            allocations = found["allocations"][name]
            assert allocations[1:] == [allocations[1]] * REPEATS, f"rank {rank}: the pool grew: {allocations}"
            buffers = found["buffers"][name]
            assert buffers == [buffers[0]] * REPEATS, f"rank {rank}: the pool's buffers changed: {buffers}"
            assert found["staged"][name] > 0, f"rank {rank}: no {name} exchange went through the host buffers"
        assert found["lookups"] == 0, f"rank {rank}: the route was looked up {found['lookups']} times"
        assert found["host_syncs"] == 0, "CPU tensors made the host wait for a device"
