"""The collectives of USP, one function each. Groups are always passed in.

* :func:`seq_to_head` / :func:`head_to_seq`: the Ulysses all-to-all, autograd-aware (each one's
  backward is the other). With a native ops object (:mod:`ds_usp.native`) the packing into and out
  of the send/recv buffers runs in the native op; :func:`packed_seq_to_head` sends several tensors
  (q, k, v with kv replication) through one all-to-all that way.
* :func:`gather_seq`: all-gather of sequence shards, autograd-aware (backward keeps this rank's
  slice: the gathered tensor is assumed to feed the same computation on every rank).
* :func:`ring_shift`: non-blocking send to the next ring rank and receive from the previous one,
  returning a ``wait`` callable (the ring algorithm computes while it is in flight).
* :func:`all_reduce_sum_` and :func:`all_gather_rows`: small collectives (the SP loss, cross-rank checks).

A collective that fails (a peer rank died, or stalled past the group's timeout) raises
:class:`USPCommError` naming the collective and the ranks of its group.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from ds_usp.native import NativeOps


class USPCommError(RuntimeError):
    """A USP collective failed: a rank of its group died, stalled past the timeout, or called another collective."""


@contextmanager
def _named(what: str, group: Any) -> Iterator[None]:
    """Re-raise a failing collective's error as :class:`USPCommError` that names it and its group's ranks."""
    try:
        yield
    except USPCommError:
        raise
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        raise USPCommError(f"the {what} over ranks {ranks} failed on rank {dist.get_rank()}: {e}\n"
                           f"A rank of this group died, stalled longer than the group timeout "
                           f"(usp.timeout_seconds), or called a different collective; see the other ranks' logs.") from e


def _all_to_all(send: Tensor, group: Any) -> Tensor:
    recv = torch.empty_like(send)
    with _named("Ulysses all-to-all", group):
        dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_head_send_buffer(x: Tensor, world: int) -> Tensor:
    """The PyTorch packing of :func:`seq_to_head` (the native op's twin): chunk ``i`` goes to Ulysses rank ``i``.

    Args:
        x: ``(b, s, h, d)`` with ``h`` divisible by ``world``.
        world: the Ulysses degree U.

    Returns:
        The contiguous send buffer ``(U, b, s, h/U, d)``.
    """
    b, s, h, d = x.shape
    # (b, s, h, d) -> (b, s, U, h/U, d) -> (U, b, s, h/U, d)
    return x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()


def _seq_to_head(x: Tensor, group: Any, ops: Optional["NativeOps"] = None) -> Tensor:
    world = dist.get_world_size(group)
    b, s, h, d = x.shape
    if ops is not None:  # native packing: one pass straight into the send buffer
        send = ops.pack_seq_to_head([x], [1], world)  # (b, s, h, d) -> (U, b, s, h/U, d)
        recv = _all_to_all(send, group)
        del send  # freed before unpacking: one buffer fewer at the peak
        return ops.unpack_seq_to_head(recv, [h // world])[0]  # -> (b, U*s, h/U, d)
    recv = _all_to_all(seq_to_head_send_buffer(x, world), group)
    # (U, b, s, h/U, d) -> (b, U, s, h/U, d) -> (b, U*s, h/U, d): chunk i is rank i's sequence shard
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def _head_to_seq(x: Tensor, group: Any, ops: Optional["NativeOps"] = None) -> Tensor:
    world = dist.get_world_size(group)
    b, big_s, h, d = x.shape
    s = big_s // world
    if ops is not None:  # native packing: one pass each way
        send = ops.pack_head_to_seq([x], world)  # (b, U*s, h/U, d) -> (U, b, s, h/U, d)
        recv = _all_to_all(send, group)
        del send
        return ops.unpack_head_to_seq(recv, [h], [1])[0]  # -> (b, s, h, d)
    # (b, U*s, h/U, d) -> (b, U, s, h/U, d) -> (U, b, s, h/U, d): chunk i goes back to rank i
    send = x.reshape(b, world, s, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = _all_to_all(send, group)
    del send
    # (U, b, s, h/U, d) -> (b, s, U, h/U, d) -> (b, s, h, d): chunk i is head group i
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, world * h, d)


class _UlyssesAllToAll(torch.autograd.Function):
    """The all-to-all in one direction (``to_heads``); its backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, ops: Optional["NativeOps"], to_heads: bool) -> Tensor:
        ctx.group, ctx.ops, ctx.to_heads = group, ops, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group, ops)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return (_head_to_seq if ctx.to_heads else _seq_to_head)(grad, ctx.group, ctx.ops), None, None, None


class _PackedSeqToHead(torch.autograd.Function):
    """Native-op twin of ``cat -> seq_to_head -> split`` for several tensors (q, k, v) with kv replication."""

    @staticmethod
    def forward(ctx: Any, group: Any, ops: "NativeOps", reps: tuple[int, ...], *xs: Tensor) -> tuple[Tensor, ...]:
        world = dist.get_world_size(group)
        heads = [x.shape[2] * r // world for x, r in zip(xs, reps)]
        ctx.group, ctx.ops, ctx.reps, ctx.heads = group, ops, reps, heads
        send = ops.pack_seq_to_head(xs, reps, world)  # n x (b, s, h_i, d) -> (U, b, s, sum h_i*r_i/U, d)
        recv = _all_to_all(send, group)
        del send
        return tuple(ops.unpack_seq_to_head(recv, heads))  # -> n x (b, U*s, h_i*r_i/U, d)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        world = dist.get_world_size(ctx.group)
        ref = next(g for g in grads if g is not None)
        grads = [g if g is not None else ref.new_zeros(ref.shape[0], ref.shape[1], h, ref.shape[3])
                 for g, h in zip(grads, ctx.heads)]
        send = ctx.ops.pack_head_to_seq(grads, world)  # n x (b, U*s, h_i', d) -> (U, b, s, sum h_i', d)
        recv = _all_to_all(send, ctx.group)
        del send, grads
        dxs = ctx.ops.unpack_head_to_seq(recv, ctx.heads, ctx.reps)  # -> n x (b, s, h_i, d)
        return (None, None, None, *dxs)


def packed_seq_to_head(xs: Sequence[Tensor], reps: Sequence[int], group: Any, ops: "NativeOps") -> tuple[Tensor, ...]:
    """Several tensors through one Ulysses all-to-all with the native packing, autograd-aware.

    Same numbers as replicating heads with ``repeat_interleave``, interleaving the tensors per
    destination rank, :func:`seq_to_head` and splitting (the twin in
    :func:`ds_usp.ulysses.qkv_seq_to_head`); the backward sums the replicas' gradients.

    Args:
        xs: ``(b, s, h_i, d)`` tensors of one dtype (e.g. q, k, v).
        reps: per tensor, the head replication factor (1: none).
        group: the Ulysses process group (size U); ``h_i * reps_i`` divisible by U.
        ops: the native op.

    Returns:
        One ``(b, U*s, h_i * reps_i / U, d)`` tensor per input.
    """
    return _PackedSeqToHead.apply(group, ops, tuple(reps), *xs)


def seq_to_head(x: Tensor, group: Any, ops: Optional["NativeOps"] = None) -> Tensor:
    """Ulysses all-to-all: trade sequence shards for head shards.

    Args:
        x: ``(b, s, h, d)``, this rank's sequence shard with all heads; ``h`` divisible by the group size.
        group: the Ulysses process group (size U).
        ops: the native op for the packing, or None for the PyTorch twin.

    Returns:
        ``(b, U*s, h/U, d)``: the U shards of the group concatenated in rank order, head group ``rank``.
    """
    return _UlyssesAllToAll.apply(x, group, ops, True)


def head_to_seq(x: Tensor, group: Any, ops: Optional["NativeOps"] = None) -> Tensor:
    """Inverse of :func:`seq_to_head`.

    Args:
        x: ``(b, U*s, h/U, d)``.
        group: the Ulysses process group (size U).
        ops: the native op for the packing, or None for the PyTorch twin.

    Returns:
        ``(b, s, h, d)``: this rank's sequence shard with all heads.
    """
    return _UlyssesAllToAll.apply(x, group, ops, False)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        world = dist.get_world_size(group)
        ctx.rank, ctx.dim, ctx.n = dist.get_rank(group), dim, x.shape[dim]
        return torch.cat(all_gather_rows(x.contiguous(), group, "sequence all-gather"), dim=dim)

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
    with _named("ring send/recv", group):
        works = dist.batch_isend_irecv(ops)

    def wait() -> Tensor:
        with _named("ring send/recv", group):
            for w in works:
                w.wait()
        return recv

    return wait


def all_reduce_sum_(x: Tensor, group: Any, what: str) -> Tensor:
    """Sum ``x`` over ``group`` in place.

    Args:
        x: the tensor (same shape on every rank).
        group: the process group.
        what: a name for error messages (e.g. ``"SP loss all-reduce"``).

    Returns:
        ``x``.

    Raises:
        USPCommError: the collective failed.
    """
    with _named(what, group):
        dist.all_reduce(x, group=group)
    return x


_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}  # the tensors each backend moves (for ours)


def backend_device_type(group: Any) -> Optional[str]:
    """The device type ``group``'s backend moves: ``"cuda"`` for NCCL, ``"cpu"`` for gloo, None for others.

    Args:
        group: the process group.

    Returns:
        The device type, or None when the backend is not one of those two.
    """
    return _BACKEND_DEVICE.get(dist.get_backend(group))


def group_device(group: Any) -> torch.device:
    """The device a small tensor must be on to go through ``group`` (this rank's GPU for NCCL, else CPU).

    Args:
        group: the process group.

    Returns:
        The device.
    """
    return torch.device("cuda", torch.cuda.current_device()) if backend_device_type(group) == "cuda" else torch.device("cpu")


def all_gather_rows(x: Tensor, group: Any, what: str) -> list[Tensor]:
    """Every rank's ``x`` (same shape everywhere), in group-rank order.

    Args:
        x: this rank's tensor.
        group: the process group.
        what: a name for error messages.

    Returns:
        One tensor per rank of ``group``.

    Raises:
        USPCommError: the collective failed.
    """
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    with _named(what, group):
        dist.all_gather(parts, x, group=group)
    return parts
