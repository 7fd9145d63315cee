"""The Ulysses step of USP: sequence shards <-> head shards through one all-to-all each way.

GQA/MQA: with ``hkv`` KV heads and Ulysses degree ``U``, KV heads are split when ``hkv % U == 0``
and otherwise (``U % hkv == 0``) each KV head is replicated ``U / hkv`` times *before* the
all-to-all, so each rank receives exactly the one KV head its query heads use; the way back sums
the replicas' gradients. Nothing repeated ever travels around the ring. The packing into and out of
the all-to-all buffers is ``ops`` (:mod:`ds_usp.native`: the native op or its PyTorch twins).
"""
from __future__ import annotations

from typing import Any, Sequence

from torch import Tensor

from ds_usp.comm import all_to_all
from ds_usp.native import TorchOps
from ds_usp.splits import gqa_compatible, kv_heads_compatible, query_heads_fit


def check_heads(num_heads: int, num_kv_heads: int, ulysses_degree: int) -> None:
    """Check that q and kv head counts can be spread over a Ulysses group (the rules of :mod:`ds_usp.splits`).

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads.
        ulysses_degree: U.

    Raises:
        ValueError: naming the counts and what would be valid.
    """
    if not gqa_compatible(num_heads, num_kv_heads):
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if not query_heads_fit(num_heads, ulysses_degree):
        raise ValueError(f"q heads ({num_heads}) must be divisible by ulysses_degree ({ulysses_degree}); "
                         f"use a ulysses_degree that divides {num_heads} and put the rest in ring_degree")
    if not kv_heads_compatible(num_kv_heads, ulysses_degree):
        raise ValueError(f"kv heads ({num_kv_heads}) and ulysses_degree ({ulysses_degree}) are incompatible: "
                         f"kv heads must be a multiple or a divisor of ulysses_degree")


def seq_to_head(xs: Sequence[Tensor], reps: Sequence[int], group: Any, world: int, ops: TorchOps,
                fp8: bool = False) -> Tensor:
    """Sequence shards -> head shards of the Ulysses group's sequence, several tensors in one all-to-all.

    Args:
        xs: ``(b, s, h_i, d)`` tensors of one dtype (e.g. q, k, v, or dout alone).
        reps: per tensor, its head replication (:func:`ds_usp.splits.kv_replication`).
        group: the Ulysses group.
        world: its size U.
        ops: the packing (native or twins).
        fp8: through the wire as float8 e4m3 messages (:func:`ds_usp.comm.all_to_all`).

    Returns:
        ``(b, U*s, Hp, d)``, ``Hp = sum_i h_i * reps_i / U``; split the tensors off with
        ``.split([...], dim=2)`` (see :func:`ds_usp.splits.head_split`).
    """
    send = ops.pack_seq_to_head(xs, reps, world)  # n x (b, s, h_i, d) -> (U, b, s, Hp, d)
    recv = all_to_all(send, group, fp8)
    del send  # freed before unpacking: one buffer fewer at the peak
    return ops.unpack_seq_to_head(recv)  # -> (b, U*s, Hp, d)


def head_to_seq(xs: Sequence[Tensor], heads: Sequence[int], reps: Sequence[int], group: Any, world: int,
                ops: TorchOps, fp8: bool = False) -> list[Tensor]:
    """Head shards -> sequence shards (inverse of :func:`seq_to_head`; replicated heads are summed).

    Args:
        xs: ``(b, U*s, h_i, d)`` tensors of one dtype.
        heads: ``h_i`` per tensor.
        reps: per tensor, its head replication.
        group: the Ulysses group.
        world: its size U.
        ops: the packing (native or twins).
        fp8: through the wire as float8 e4m3 messages.

    Returns:
        ``[(b, s, U * h_i / reps_i, d)]``.
    """
    send = ops.pack_head_to_seq(xs, world)  # n x (b, U*s, h_i, d) -> (U, b, s, sum h_i, d)
    recv = all_to_all(send, group, fp8)
    del send
    return ops.unpack_head_to_seq(recv, heads, reps)  # -> n x (b, s, U*h_i/rep_i, d)
