"""Per-token log-probabilities of a sharded sequence, through ``lm_head`` chunk by chunk: the piece RL and preference
trainers (GRPO, RLOO, DPO) share.

A rank never holds the whole ``(S, V)`` logits, nor even its own ``(s_local, V)``: each chunk of ``chunk`` tokens is
projected, scaled by the model's logits tail and the sampling temperature, turned into the log-probability of its
target (and optionally its entropy), and dropped; the backward recomputes the chunk's logits
(``torch.utils.checkpoint``), so the memory held is one chunk's logits, whatever the length. Per-token values stay on
the rank that holds the token; :func:`sequence_sums` adds them over the whole sequence (the SP group), with each
rank's gradient its own tokens' share.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ds_usp.comm import sum_over_group
from ds_usp.integration.data import IGNORE_INDEX
from ds_usp.integration.loss import NO_TAIL, LogitsTail, gathered
from ds_usp.topology import USPTopology


def _chunk_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, temperature: float,
                    tail: LogitsTail, entropy: bool) -> tuple[Tensor, Tensor]:
    """``(log-prob of each target, entropy or zeros)`` of one chunk: ``(n, H)`` hidden states, ``(n,)`` targets."""
    logits = tail.apply(F.linear(hidden, weight, bias).float()) / temperature  # (n, V)
    logp = logits.log_softmax(-1)
    picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # (n,)
    ent = -(logp.exp() * logp).sum(-1) if entropy else torch.zeros_like(picked)
    return picked, ent


def token_logprobs(hidden: Tensor, lm_head: nn.Module, labels: Tensor, temperature: float = 1.0,
                   chunk: int = 1024, tail: LogitsTail = NO_TAIL,
                   entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Log-probability of each token's target under ``softmax(tail(lm_head(hidden)) / temperature)``, in chunks.

    Args:
        hidden: ``(b, s_local, H)`` final hidden states of this rank's tokens (after the model's last norm).
        lm_head: the output projection (``vocab x H`` weight, optional bias; gathered under ZeRO-3).
        labels: ``(b, s_local)`` targets of those tokens (``shift_labels`` of :func:`ds_usp.shard_batch`), ``-100``
            where there is none.
        temperature: the sampling temperature the logits are divided by (TRL's ``temperature``).
        chunk: tokens per logits chunk.
        tail: what the model applies to ``lm_head``'s output (Gemma's soft-cap, Granite's scaling).
        entropy: also return each token's entropy (TRL's entropy masking).

    Returns:
        ``(logprobs (b, s_local) fp32, entropies (b, s_local) fp32 or None)``; both 0 where the label is ``-100``.

    Raises:
        ValueError: shapes disagree, or a temperature or chunk that is not positive.
    """
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
    if not temperature > 0 or chunk < 1:
        raise ValueError(f"temperature ({temperature}) and chunk ({chunk}) must be positive")
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (b*s, H), (b*s,)
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    picked, ents = [], []
    with gathered([weight, bias]):
        for start in range(0, flat.shape[0], chunk):
            args = (flat[start:start + chunk], weight, bias, targets[start:start + chunk], temperature, tail, entropy)
            p, e = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args)
            picked.append(p)
            ents.append(e)
    valid = labels != IGNORE_INDEX
    logp = torch.cat(picked).view_as(labels) * valid
    return logp, (torch.cat(ents).view_as(labels) * valid if entropy else None)


def sequence_sums(per_token: Tensor, topo: Optional[USPTopology]) -> Tensor:
    """``(b,)`` sums of per-token values over each whole sequence (the SP group's shards): the same on every rank of
    the group, each rank's gradient its own tokens' share.

    Args:
        per_token: ``(b, s_local)`` values of this rank's tokens (0 where there is none).
        topo: the topology (None or SP size 1: the rank holds the whole sequence).

    Returns:
        ``(b,)`` fp32.
    """
    sums = per_token.float().sum(-1)
    return sum_over_group(sums, topo.sp_group) if topo is not None and topo.sp_size > 1 else sums
