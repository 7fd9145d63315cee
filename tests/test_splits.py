"""ds_usp.splits, the one answer to "which (Ulysses, ring) split fits this model", against brute force.

Each rule is checked against an enumeration that knows nothing of the formulas: query heads handed out to the
Ulysses ranks in contiguous blocks, each query head reading the kv head of its group, and a split fitting when every
rank can be sent exactly the kv heads its query heads read, as whole copies. Then every refusing wrapper (the
attention and linear checks, the config, the shape's split refusal, the cost model, the benchmarks) must refuse
exactly the splits the module says do not fit.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest

from ds_usp import splits
from ds_usp.attention.ulysses import check_heads
from ds_usp.config import USPConfigError, load_usp_config
from ds_usp.cost import ModelShape, sent_kv_heads
from ds_usp.integration.models.shape import split_refusal
from ds_usp.linear import check_linear_heads

ROOT = Path(__file__).resolve().parent.parent
HEADS = range(1, 25)
DEGREES = range(1, 17)


def _gqa_pairs(limit: int = 24) -> list[tuple[int, int]]:
    """Every ``(H, H_kv)`` with ``H_kv`` dividing ``H`` up to ``limit`` heads."""
    return [(h, kv) for h in range(1, limit + 1) for kv in range(1, h + 1) if h % kv == 0]


def _needed(heads: int, kv_heads: int, rank: int, u: int) -> list[int]:
    """The kv heads the query heads of Ulysses rank ``rank`` read (query heads in contiguous blocks of ``H / U``)."""
    per = heads // u
    return sorted({j // (heads // kv_heads) for j in range(rank * per, (rank + 1) * per)})


@functools.lru_cache(maxsize=None)
def _brute_placement(kv_heads: int, u: int) -> list[list[int]] | None:
    """The kv heads each Ulysses rank receives when every kv head is sent ``rep`` whole times, in order, and the
    send buffer is cut in ``U`` equal chunks; None when no ``rep`` gives whole chunks with no head cut apart."""
    for rep in range(1, u + 1):
        sent = [i for i in range(kv_heads) for _ in range(rep)]
        if len(sent) % u:
            continue
        chunk = len(sent) // u
        ranks = [sent[r * chunk:(r + 1) * chunk] for r in range(u)]
        if all(len(set(c)) == len(c) for c in ranks):  # no rank holds a head twice: the smallest replication
            return ranks
    return None


@functools.lru_cache(maxsize=None)
def _brute_fits(heads: int, kv_heads: int, u: int) -> bool:
    """A Ulysses degree fits when the query heads split into whole blocks and each rank receives exactly the kv
    heads its block reads."""
    if heads % u:
        return False
    placement = _brute_placement(kv_heads, u)
    return placement is not None and all(placement[r] == _needed(heads, kv_heads, r, u) for r in range(u))


@pytest.mark.parametrize("heads,kv_heads", _gqa_pairs())
def test_ulysses_fits_is_the_brute_force_placement(heads, kv_heads):
    for u in DEGREES:
        brute = _brute_fits(heads, kv_heads, u)
        assert splits.ulysses_fits(u, heads, kv_heads) == brute, (heads, kv_heads, u)
        assert (splits.query_heads_fit(heads, u) and splits.kv_heads_compatible(kv_heads, u)) == brute
        if brute:
            placement = _brute_placement(kv_heads, u)
            assert splits.kv_replication(kv_heads, u) * kv_heads == sum(map(len, placement))
            assert splits.sent_heads(kv_heads, u) == sum(map(len, placement)) == max(kv_heads, u)
            assert splits.local_heads(kv_heads, u) == len(placement[0])
            assert splits.head_split(heads, kv_heads, u) == [heads // u, len(placement[0]), len(placement[0])]


def test_kv_heads_compatible_is_split_or_replicated():
    for kv, u in itertools.product(HEADS, DEGREES):
        whole_split = kv % u == 0
        replicated = any(kv * rep == u for rep in range(1, u + 1))
        assert splits.kv_heads_compatible(kv, u) == (whole_split or replicated), (kv, u)


@pytest.mark.parametrize("nv,nk", _gqa_pairs(16))
def test_linear_heads_fit_and_key_heads_go_with_their_value_heads(nv, nk):
    for u in DEGREES:
        brute = _brute_fits(nv, nk, u)  # value heads play the query heads, key heads the kv heads
        assert splits.linear_heads_fit(nk, nv, u) == brute, (nk, nv, u)
        if brute:
            for rank in range(u):
                first = splits.key_head_offset(nk, rank, u)
                assert list(range(first, first + splits.local_heads(nk, u))) == _needed(nv, nk, rank, u)


def test_divisors_and_factorizations_are_every_product():
    for n in range(1, 65):
        assert splits.divisors(n) == [d for d in range(1, n + 1) if any(d * e == n for e in range(1, n + 1))]
        pairs = [(u, r) for u in range(n, 0, -1) for r in range(1, n + 1) if u * r == n]
        assert splits.factorizations(n) == pairs


def test_default_degrees_is_the_largest_node_local_fitting_ulysses():
    for sp, local in itertools.product(range(1, 17), (1, 2, 4, 6, 8)):
        assert splits.node_local_degrees(sp, local) == [u for u in range(1, sp + 1) if sp % u == 0 and local % u == 0]
        for heads, kv in [(None, None)] + _gqa_pairs(12):
            best = max(u for u, r in itertools.product(range(1, sp + 1), repeat=2) if u * r == sp and local % u == 0
                       and (heads is None or _brute_fits(heads, kv, u)))
            assert splits.default_degrees(sp, local, heads, kv) == (best, sp // best), (sp, local, heads, kv)
        for kv in HEADS:  # kv heads alone (query heads unknown)
            best = max(u for u in range(1, sp + 1) if sp % u == 0 and local % u == 0
                       and _brute_placement(kv, u) is not None)
            assert splits.default_degrees(sp, local, num_kv_heads=kv) == (best, sp // best)


def test_degree_split_keeps_the_common_ulysses_when_the_kv_heads_fit():
    for u, d, kv in itertools.product(range(1, 17), range(1, 17), [None, *HEADS]):
        common = max(x for x in range(1, min(u, d) + 1) if u % x == 0 and d % x == 0)
        if kv is not None and not splits.kv_heads_compatible(kv, common):
            common = 1
        assert splits.degree_split(u, d, kv) == (common, d // common)
        assert common == 1 or common == math.gcd(u, d)


# ------------------------------------------------------------------------------ the wrappers agree with it


def _refuses(call) -> bool:
    try:
        call()
    except ValueError:
        return True
    return False


def _benchmarks_common():
    spec = importlib.util.spec_from_file_location("_bench_common_for_splits", ROOT / "benchmarks" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


def test_the_refusing_wrappers_refuse_exactly_what_does_not_fit():
    bench = _benchmarks_common()
    for (heads, kv), u in itertools.product(_gqa_pairs(16), range(1, 9)):
        fits = splits.ulysses_fits(u, heads, kv)
        assert _refuses(lambda: check_heads(heads, kv, u)) == (not fits)
        assert (bench.split_refusal(heads, kv, u) is not None) == (not fits)
        shape = ModelShape(name="m", hidden=64, attention_layers=2, heads=heads, kv_heads=kv, head_dim=8,
                           v_head_dim=8, vocab=32, mlp_width=64, params=1, active_params=1)
        assert (split_refusal(shape, u, 1, 1 << 20) is None) == fits
        cfg = {"sequence_parallel": "usp", "sequence_parallel_size": u, "usp": {"ulysses_degree": u}}
        assert _refuses(lambda: load_usp_config(cfg, u, num_heads=heads, num_kv_heads=kv)) == (not fits)
        assert _refuses(lambda: sent_kv_heads(kv, u)) == (not splits.kv_heads_compatible(kv, u))
        linear = ModelShape(name="m", hidden=64, attention_layers=0, heads=1, kv_heads=1, head_dim=8, v_head_dim=8,
                            vocab=32, mlp_width=64, params=1, active_params=1, linear_layers=2, linear_k_heads=kv,
                            linear_v_heads=heads)
        fits_linear = splits.linear_heads_fit(kv, heads, u)
        assert _refuses(lambda: check_linear_heads(kv, heads, u)) == (not fits_linear)
        assert (split_refusal(linear, u, 1, 1 << 20) is None) == fits_linear
    assert bench.splits(12) == splits.factorizations(12)


def test_the_config_keeps_its_messages_and_chooses_as_the_module():
    with pytest.raises(USPConfigError, match=r"usp.ulysses_degree \(4\) must divide the number of attention heads "
                                             r"\(6\); valid values: 1, 2"):
        load_usp_config({"sequence_parallel": "usp", "sequence_parallel_size": 4, "usp": {"ulysses_degree": 4}}, 4,
                        num_heads=6)
    with pytest.raises(USPConfigError, match=r"usp.ulysses_degree \(4\) is incompatible with 6 kv heads"):
        load_usp_config({"sequence_parallel": "usp", "sequence_parallel_size": 4, "usp": {"ulysses_degree": 4}}, 4,
                        num_heads=12, num_kv_heads=6)
    for sp, heads, kv in itertools.product((1, 2, 4, 8), (8, 12, 24), (1, 2, 3, 4, 6, 8)):
        if heads % kv:
            continue
        c = load_usp_config({"sequence_parallel": "usp", "sequence_parallel_size": sp}, sp, local_world_size=sp,
                            num_heads=heads, num_kv_heads=kv)
        assert (c.ulysses_degree, c.ring_degree) == splits.default_degrees(sp, sp, heads, kv)
        assert c.degrees_chosen_automatically
