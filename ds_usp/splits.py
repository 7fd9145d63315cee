"""Which (Ulysses, ring) splits fit a model: the one place the head rules live.

A sequence-parallel group of ``sp = U * R`` ranks runs attention as ``U`` ranks of one all-to-all (Ulysses: each
takes ``1/U`` of the heads) times ``R`` ranks of one K/V ring. Whether a Ulysses degree ``U`` fits a model is a
matter of head counts only:

- the query heads ``H`` are a multiple of the kv heads ``H_kv`` (:func:`gqa_compatible`) and of ``U``
  (:func:`query_heads_fit`);
- the kv heads are a multiple of ``U`` (split like the query heads) or a divisor of it (each replicated
  ``U / H_kv`` times before the all-to-all): :func:`kv_heads_compatible`, :func:`kv_replication`;
- a linear-attention layer's value heads are a multiple of ``U`` and its key heads follow the kv-heads rule
  (:func:`linear_heads_fit`).

Every function here is pure (integers in, integers or booleans out): the callers that refuse a split (the config,
the attention and linear layers, the cost model, the planner, the benchmarks) keep their own messages and ask here
whether the split fits. Imports nothing of ``ds_usp`` and no torch.
"""
from __future__ import annotations

import math
from typing import Optional


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (the sizes a group of ``n`` ranks splits into).

    Args:
        n: a positive integer.

    Returns:
        ``[1, ..., n]``, the ``d`` with ``n % d == 0``.
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n: int) -> list[tuple[int, int]]:
    """Every ``(U, R)`` with ``U * R == n``, Ulysses-heaviest first.

    Args:
        n: the sequence-parallel size.

    Returns:
        ``[(n, 1), ..., (1, n)]``.
    """
    return [(n // r, r) for r in divisors(n)]


def gqa_compatible(num_heads: int, num_kv_heads: int) -> bool:
    """Whether every kv head serves the same number of query heads (MHA, GQA, MQA).

    Args:
        num_heads: query heads (or a linear-attention layer's value heads).
        num_kv_heads: key/value heads (or its key heads).

    Returns:
        True when ``num_kv_heads`` divides ``num_heads``.
    """
    return num_heads % num_kv_heads == 0


def query_heads_fit(num_heads: int, ulysses_degree: int) -> bool:
    """Whether the query heads split evenly over a Ulysses group.

    Args:
        num_heads: query heads.
        ulysses_degree: U.

    Returns:
        True when ``U`` divides ``num_heads``.
    """
    return num_heads % ulysses_degree == 0


def kv_heads_compatible(num_kv_heads: int, ulysses_degree: int) -> bool:
    """Whether ``num_kv_heads`` KV heads can be spread over ``ulysses_degree`` ranks.

    Args:
        num_kv_heads: key/value heads of the model.
        ulysses_degree: ranks of one Ulysses group.

    Returns:
        True when the heads split evenly, or each head can be replicated a whole number of times.
    """
    return num_kv_heads % ulysses_degree == 0 or ulysses_degree % num_kv_heads == 0


def ulysses_fits(ulysses_degree: int, num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None) -> bool:
    """Whether a Ulysses degree fits these head counts (a count left None is not checked).

    Args:
        ulysses_degree: U.
        num_heads: query heads, when known.
        num_kv_heads: key/value heads, when known.

    Returns:
        True when :func:`query_heads_fit` and :func:`kv_heads_compatible` both hold.
    """
    return (num_heads is None or query_heads_fit(num_heads, ulysses_degree)) and \
        (num_kv_heads is None or kv_heads_compatible(num_kv_heads, ulysses_degree))


def linear_heads_fit(num_k_heads: int, num_v_heads: int, ulysses_degree: int) -> bool:
    """Whether a linear-attention layer's heads fit a Ulysses degree: each rank takes ``nv / U`` value heads and the
    key heads they belong to (whole key heads when ``U`` divides ``nk``, else each key head on ``U / nk`` ranks).

    Args:
        num_k_heads: nk, key (and query) heads.
        num_v_heads: nv, value heads.
        ulysses_degree: U.

    Returns:
        True when ``U`` divides ``nv`` and the key heads follow :func:`kv_heads_compatible`.
    """
    return num_v_heads % ulysses_degree == 0 and kv_heads_compatible(num_k_heads, ulysses_degree)


def kv_replication(num_kv_heads: int, ulysses_degree: int) -> int:
    """How often each KV head is sent: 1 when U divides the KV heads, else ``U / hkv``.

    Args:
        num_kv_heads: hkv (:func:`kv_heads_compatible` with ``U``); a linear layer's key heads alike.
        ulysses_degree: U.

    Returns:
        The replication factor.
    """
    return 1 if num_kv_heads % ulysses_degree == 0 else ulysses_degree // num_kv_heads


def sent_heads(num_kv_heads: int, ulysses_degree: int) -> int:
    """KV heads the Ulysses all-to-all carries per token, replicas included: ``max(H_kv, U)``.

    Args:
        num_kv_heads: H_kv (:func:`kv_heads_compatible` with ``U``); a linear layer's key heads alike.
        ulysses_degree: U.

    Returns:
        ``H_kv`` if U divides it, else ``U``.
    """
    return num_kv_heads if num_kv_heads % ulysses_degree == 0 else ulysses_degree


def local_heads(num_kv_heads: int, ulysses_degree: int) -> int:
    """KV heads each Ulysses rank holds after the all-to-all: ``H_kv * replication / U``.

    Args:
        num_kv_heads: H_kv (:func:`kv_heads_compatible` with ``U``).
        ulysses_degree: U.

    Returns:
        ``max(H_kv / U, 1)``.
    """
    return num_kv_heads * kv_replication(num_kv_heads, ulysses_degree) // ulysses_degree


def head_split(num_heads: int, num_kv_heads: int, ulysses_degree: int) -> list[int]:
    """Head columns of q, k, v in one rank's chunk of the packed q/k/v all-to-all.

    Args:
        num_heads: hq.
        num_kv_heads: hkv.
        ulysses_degree: U.

    Returns:
        ``[hq/U, hk, hk]`` with ``hk`` the :func:`local_heads`.
    """
    hk = local_heads(num_kv_heads, ulysses_degree)
    return [num_heads // ulysses_degree, hk, hk]


def key_head_offset(num_k_heads: int, ulysses_rank: int, ulysses_degree: int) -> int:
    """The first key head of a Ulysses rank's share (its value heads' key heads).

    Args:
        num_k_heads: nk (:func:`kv_heads_compatible` with ``U``).
        ulysses_rank: the rank's index in its Ulysses group.
        ulysses_degree: U.

    Returns:
        ``rank // replication * local_heads``.
    """
    return ulysses_rank // kv_replication(num_k_heads, ulysses_degree) * local_heads(num_k_heads, ulysses_degree)


def node_local_degrees(sequence_parallel_size: int, local_world_size: int) -> list[int]:
    """The Ulysses degrees whose all-to-alls stay inside a node, ascending.

    Args:
        sequence_parallel_size: ranks that share one sequence.
        local_world_size: ranks per node.

    Returns:
        The divisors of ``sequence_parallel_size`` that divide ``local_world_size``.
    """
    return [u for u in divisors(sequence_parallel_size) if local_world_size % u == 0]


def default_degrees(
    sequence_parallel_size: int,
    local_world_size: int,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
) -> tuple[int, int]:
    """(ulysses_degree, ring_degree) as the USP paper advises: Ulysses inside a node, ring across.

    Ulysses is made as large as possible such that it divides the sequence-parallel size and the ranks per node
    (so every all-to-all stays on one node) and fits the heads (:func:`ulysses_fits`); the rest of the
    sequence-parallel size becomes the ring.

    Args:
        sequence_parallel_size: ranks that share one sequence.
        local_world_size: ranks per node.
        num_heads: query heads, when known.
        num_kv_heads: key/value heads, when known.

    Returns:
        ``(ulysses_degree, ring_degree)`` with product ``sequence_parallel_size``.
    """
    best = max((u for u in node_local_degrees(sequence_parallel_size, local_world_size)
                if ulysses_fits(u, num_heads, num_kv_heads)), default=1)
    return best, sequence_parallel_size // best


def degree_split(ulysses_degree: int, degree: int, num_kv_heads: Optional[int] = None) -> tuple[int, int]:
    """``(U_d, R_d)`` of a smaller sequence-parallel degree ``degree`` cut from a topology with ``ulysses_degree``
    (dynamic SP): as much Ulysses as the full split has, ``gcd(U, d)`` (inside a node), the rest ring; Ulysses 1 where
    the kv heads would not fit it.

    Args:
        ulysses_degree: the full topology's U.
        degree: d.
        num_kv_heads: the model's kv heads (None: unknown).

    Returns:
        ``(U_d, d / U_d)``.
    """
    u = math.gcd(ulysses_degree, degree)
    if not ulysses_fits(u, num_kv_heads=num_kv_heads):
        u = 1
    return u, degree // u
