"""The collectives of USP, one function each. Groups are always passed in.

* :func:`seq_to_head` / :func:`head_to_seq`: the Ulysses all-to-all, autograd-aware (each one's
  backward is the other).
* :func:`gather_seq`: all-gather of sequence shards, autograd-aware (backward keeps this rank's
  slice: the gathered tensor is assumed to feed the same computation on every rank).
* :func:`ring_shift`: non-blocking send to the next ring rank and receive from the previous one,
  returning a ``wait`` callable (the ring algorithm computes while it is in flight).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def _seq_to_head(x: Tensor, group: Any) -> Tensor:
    world = dist.get_world_size(group)
    b, s, h, d = x.shape
    # (b, s, h, d) -> (b, s, U, h/U, d) -> (U, b, s, h/U, d): chunk i goes to Ulysses rank i
    send = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # (U, b, s, h/U, d) -> (b, U, s, h/U, d) -> (b, U*s, h/U, d): chunk i is rank i's sequence shard
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def _head_to_seq(x: Tensor, group: Any) -> Tensor:
    world = dist.get_world_size(group)
    b, big_s, h, d = x.shape
    s = big_s // world
    # (b, U*s, h/U, d) -> (b, U, s, h/U, d) -> (U, b, s, h/U, d): chunk i goes back to rank i
    send = x.reshape(b, world, s, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # (U, b, s, h/U, d) -> (b, s, U, h/U, d) -> (b, s, h, d): chunk i is head group i
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, world * h, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x: Tensor, group: Any) -> Tensor:
    """Ulysses all-to-all: trade sequence shards for head shards.

    Args:
        x: ``(b, s, h, d)``, this rank's sequence shard with all heads; ``h`` divisible by the group size.
        group: the Ulysses process group (size U).

    Returns:
        ``(b, U*s, h/U, d)``: the U shards of the group concatenated in rank order, head group ``rank``.
    """
    return _SeqToHead.apply(x, group)


def head_to_seq(x: Tensor, group: Any) -> Tensor:
    """Inverse of :func:`seq_to_head`.

    Args:
        x: ``(b, U*s, h/U, d)``.
        group: the Ulysses process group (size U).

    Returns:
        ``(b, s, h, d)``: this rank's sequence shard with all heads.
    """
    return _HeadToSeq.apply(x, group)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        world = dist.get_world_size(group)
        ctx.rank, ctx.dim, ctx.n = dist.get_rank(group), dim, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n), None, None


def gather_seq(x: Tensor, group: Any, dim: int) -> Tensor:
    """Concatenate the group's shards along ``dim`` in group-rank order.

    The backward returns this rank's slice of the incoming gradient, which is exact when every
    rank feeds the gathered tensor into the same (replicated) computation, e.g. a loss.

    Args:
        x: this rank's shard (same shape on every rank).
        group: the process group.
        dim: the dimension to concatenate.

    Returns:
        The concatenation of all shards.
    """
    return _GatherSeq.apply(x, group, dim)


def ring_shift(send: Tensor, group: Any, ring_ranks: Sequence[int], ring_rank: int) -> Callable[[], Tensor]:
    """Start sending ``send`` to the next ring rank and receiving the previous rank's tensor.

    ``send`` must not be modified until the returned ``wait`` has been called.

    Args:
        send: the tensor to pass on (contiguous); the received tensor has its shape and dtype.
        group: the ring process group.
        ring_ranks: global ranks of the ring, in ring order.
        ring_rank: this rank's position in the ring.

    Returns:
        ``wait()``, which blocks until both transfers are done and returns the received tensor.
    """
    n = len(ring_ranks)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, ring_ranks[(ring_rank + 1) % n], group),
           dist.P2POp(dist.irecv, recv, ring_ranks[(ring_rank - 1) % n], group)]
    works = dist.batch_isend_irecv(ops)

    def wait() -> Tensor:
        for w in works:
            w.wait()
        return recv

    return wait
