"""The (Ulysses, ring) degrees when the config leaves them out: the paper's rule (Ulysses inside a node) unless the
cost model prices another split clearly faster."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ds_usp.config import USPConfig
from ds_usp.cost import Hardware, ModelShape, StepSettings, step_time
from ds_usp.integration.models.shape import split_refusal
from ds_usp.log import log_rank0
from ds_usp.splits import node_local_degrees

NOMINAL_TOKENS_PER_RANK = 16384  # the length "auto" degrees are priced at (the length is not known yet)


def choose_degrees(cfg: USPConfig, shape: ModelShape, zero: int, per_node: int,
                   max_positions: Optional[int] = None) -> USPConfig:
    """Degrees left out: the paper's rule (Ulysses inside a node) unless the cost model prices another split of the
    sequence-parallel ranks, whose all-to-alls stay inside a node, at least 10% faster; the choice is logged.

    The length is not known yet: it is priced at :data:`NOMINAL_TOKENS_PER_RANK` per rank, or at the model's
    ``max_position_embeddings`` when that is shorter (a model is not trained beyond the length it declares)."""
    sp, dp = cfg.sequence_parallel_size, cfg.data_parallel_size
    hw = Hardware(nodes=max(1, cfg.world_size // per_node), gpus_per_node=per_node)
    seq = NOMINAL_TOKENS_PER_RANK * sp
    if isinstance(max_positions, int) and not isinstance(max_positions, bool) and 2 * sp <= max_positions < seq:
        seq = max_positions

    prices = {u: step_time(shape, StepSettings(u, sp // u, dp, zero), seq, hw).total
              for u in node_local_degrees(sp, per_node) if split_refusal(shape, u, sp // u, seq) is None}
    rule = cfg.ulysses_degree
    best = min(prices, key=prices.get, default=rule)
    pick = best if rule not in prices or prices[best] < 0.9 * prices[rule] else rule
    log_rank0(f"usp degrees: ulysses_degree={pick} x ring_degree={sp // pick} (the cost model at S={seq}: "
              + ", ".join(f"{u}x{sp // u} {t:.3g} s" for u, t in prices.items()) + "; see python -m ds_usp.plan)")
    return replace(cfg, ulysses_degree=pick, ring_degree=sp // pick)
