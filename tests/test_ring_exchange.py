"""The ring backward's point-to-point traffic: one batched exchange per ring step (issue 63 item 7).

On a 1x4 gloo ring (causal zigzag: every one of the 4 steps computes) ``dist.batch_isend_irecv`` and the ring's
backward kernels are logged during one backward. Each step's K/V shift and the previous step's dK/dV return to
their owner go in one ``batch_isend_irecv`` call: 4 steps + 1 call for the last block's gradients = 5 calls
(before: the K/V shift and the dK/dV return were separate calls, 2 x 3 = 6, two of them back to back between the same
kernels). The sends are the same 6 tensors (3 K/V hops, 3 dK/dV blocks; their bytes: tests/test_comm_volume.py), and
each exchange but the last is waited for only after a kernel ran meanwhile (the transfers overlap compute).
"""
from __future__ import annotations

import itertools

import torch

R, STEPS, SEQ = 4, 4, 64


class _LoggedWork:
    """A ``Work`` whose ``wait`` is logged."""

    def __init__(self, work, events: list, n: int) -> None:
        self.work, self.events, self.n = work, events, n

    def wait(self, *args, **kwargs):
        self.events.append(("wait", self.n))
        return self.work.wait(*args, **kwargs)


def log_backward_exchanges() -> list:
    """On every rank: ``[("launch", n, sends, recvs) | ("wait", n) | ("kernel",)]`` of one ring backward."""
    import torch.distributed as dist

    import ds_usp
    from ds_usp.attention import ring

    topo = ds_usp.USPTopology.build(1, R)
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, SEQ, n, 8, generator=g) for n in (4, 2, 2, 4))
    shards = [ds_usp.shard_sequence(x, topo, 1, "zigzag").requires_grad_() for x in (q, k, v)]
    out = ds_usp.usp_attention(*shards, topo, causal=True, layout="zigzag", seq_len=SEQ)
    events: list = []
    batch, pieces = dist.batch_isend_irecv, ring.backward_pieces

    def logged_batch(ops):
        n = sum(e[0] == "launch" for e in events)
        sends = sum(getattr(op.op, "__name__", "") == "isend" for op in ops)
        events.append(("launch", n, sends, len(ops) - sends))
        return [_LoggedWork(w, events, n) for w in batch(ops)]

    def logged_pieces(*args, **kwargs):
        events.append(("kernel",))
        return pieces(*args, **kwargs)

    dist.batch_isend_irecv, ring.backward_pieces = logged_batch, logged_pieces
    try:
        out.backward(ds_usp.shard_sequence(dout, topo, 1, "zigzag"))
    finally:
        dist.batch_isend_irecv, ring.backward_pieces = batch, pieces
    return events


def test_one_batched_exchange_per_ring_step(world4):
    for rank, events in enumerate(world4.run(log_backward_exchanges)):
        launches = [e for e in events if e[0] == "launch"]
        assert len(launches) == STEPS + 1, f"rank {rank}: {len(launches)} exchanges for {STEPS} steps: {events}"
        assert sum(e[2] for e in launches) == 2 * (STEPS - 1) == sum(e[3] for e in launches), events
        assert all(e[2] <= 2 for e in launches), f"rank {rank}: more than K/V + one dK/dV in a call: {events}"
        kinds = [e[0] for e in events if e[0] != "wait"]
        assert ("launch", "launch") not in set(itertools.pairwise(kinds)), \
            f"rank {rank}: two exchanges between the same kernels: {events}"
        for n in range(len(launches) - 1):  # the last one takes the last block's gradients home, after every kernel
            start = events.index(launches[n])
            between = events[start + 1:events.index(("wait", n), start)]
            assert ("kernel",) in between, f"rank {rank}: exchange {n} waited for before any kernel: {events}"
