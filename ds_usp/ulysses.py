"""The Ulysses step of USP: sequence shards -> head shards for q, k, v (one all-to-all) and back.

GQA/MQA: with ``hkv`` KV heads and Ulysses degree ``U``, KV heads are split when ``hkv % U == 0``
and otherwise (``U % hkv == 0``) each KV head is replicated ``U / hkv`` times *before* the
all-to-all, so each rank receives exactly the one KV head its query heads use; autograd sums the
replicas' gradients back. Nothing repeated ever travels around the ring.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from ds_usp.comm import head_to_seq, packed_seq_to_head, seq_to_head

if TYPE_CHECKING:
    from ds_usp.native import NativeOps


def check_heads(num_heads: int, num_kv_heads: int, ulysses_degree: int) -> None:
    """Check that q and kv head counts can be spread over a Ulysses group.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads.
        ulysses_degree: U.

    Raises:
        ValueError: naming the counts and what would be valid.
    """
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if num_heads % ulysses_degree != 0:
        raise ValueError(f"q heads ({num_heads}) must be divisible by ulysses_degree ({ulysses_degree}); "
                         f"use a ulysses_degree that divides {num_heads} and put the rest in ring_degree")
    if num_kv_heads % ulysses_degree != 0 and ulysses_degree % num_kv_heads != 0:
        raise ValueError(f"kv heads ({num_kv_heads}) and ulysses_degree ({ulysses_degree}) are incompatible: "
                         f"kv heads must be a multiple or a divisor of ulysses_degree")


def qkv_seq_to_head(q: Tensor, k: Tensor, v: Tensor, group: Any, ulysses_degree: int,
                    ops: Optional["NativeOps"] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Turn sequence-sharded q, k, v into head-sharded ones with a single all-to-all.

    Args:
        q: ``(b, s, hq, d)``.
        k: ``(b, s, hkv, d)``.
        v: ``(b, s, hkv, d)``.
        group: the Ulysses group.
        ulysses_degree: U (its size).
        ops: the native op, which replicates, interleaves and packs in one pass straight into the
            send buffer (same numbers); None for the PyTorch code below (its twin).

    Returns:
        ``(b, U*s, hq/U, d)`` and twice ``(b, U*s, max(hkv/U, 1), d)``.
    """
    if ulysses_degree == 1:
        return q, k, v
    u = ulysses_degree
    hq, hkv = q.shape[2], k.shape[2]
    if ops is not None:
        rep = 1 if hkv % u == 0 else u // hkv
        # 3 x (b, s, h_i, d) -> (U, b, s, (hq + 2 hk)/U, d) -> all-to-all -> 3 x (b, U*s, h_i/U, d)
        qh, kh, vh = packed_seq_to_head([q, k, v], [1, rep, rep], group, ops)
        return qh, kh, vh
    hk = hkv if hkv % u == 0 else u  # kv heads after replication
    heads = seq_to_head(interleave_qkv(q, k, v, u), group)  # (b, U*s, (hq + 2 hk)/U, d)
    return heads.split([hq // u, hk // u, hk // u], dim=2)


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, ulysses_degree: int) -> Tensor:
    """Replicate kv heads as far as needed and interleave q, k, v per destination rank (the PyTorch twin).

    Args:
        q: ``(b, s, hq, d)``.
        k: ``(b, s, hkv, d)``.
        v: ``(b, s, hkv, d)``.
        ulysses_degree: U; ``hkv % U == 0`` or ``U % hkv == 0``.

    Returns:
        ``(b, s, hq + 2 hk, d)`` where head block ``i`` of size ``(hq + 2 hk)/U`` is rank ``i``'s q, k, v.
    """
    u = ulysses_degree
    b, s, _, d = q.shape
    hkv = k.shape[2]
    if hkv % u != 0:  # U % hkv == 0 (checked): give each rank its own copy of the one kv head it needs
        k = k.repeat_interleave(u // hkv, dim=2)  # (b, s, hkv, d) -> (b, s, U, d)
        v = v.repeat_interleave(u // hkv, dim=2)
    # 3 x (b, s, U, h_i/U, d) -> (b, s, U, (hq + 2 hk)/U, d) -> (b, s, hq + 2 hk, d)
    return torch.cat([x.reshape(b, s, u, x.shape[2] // u, d) for x in (q, k, v)], dim=3).reshape(b, s, -1, d)


def out_head_to_seq(out: Tensor, group: Any, ulysses_degree: int, ops: Optional["NativeOps"] = None) -> Tensor:
    """Turn the head-sharded attention output back into this rank's sequence shard.

    Args:
        out: ``(b, U*s, hq/U, d)``.
        group: the Ulysses group.
        ulysses_degree: U.
        ops: the native op for the packing, or None for the PyTorch twin.

    Returns:
        ``(b, s, hq, d)``.
    """
    return out if ulysses_degree == 1 else head_to_seq(out, group, ops)
