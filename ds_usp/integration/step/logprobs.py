"""Per-token log-probabilities of a sharded sequence, through ``lm_head`` chunk by chunk: the piece RL and preference
trainers (GRPO, RLOO, DPO) share.

A rank never holds the whole ``(S, V)`` logits, nor even its own ``(s_local, V)``: each chunk of ``chunk`` tokens is
projected, scaled by the model's logits tail and the sampling temperature, turned into the log-probability of its
target (and its entropy and TRL's other per-token statistics), and dropped; the backward recomputes the chunk's logits
(``torch.utils.checkpoint``), so the memory held is one chunk's logits, whatever the length.

:func:`fused_forward` is what ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)`` (TRL's fused LM head,
``trl.trainer.utils.add_fused_lm_head``, called by ``GRPOTrainer``, ``RLOOTrainer`` and ``DPOTrainer``) becomes under
sequence parallelism: every rank of the SP group passes the same whole batch, each runs the model on its own shard, and
the per-token results are gathered over the group into the whole ``(b, S - 1)`` tensors TRL reads (a few floats per
token), each rank's gradient its own tokens' share. TRL's loss code then runs unchanged on the same tensors on every
rank of the group.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ds_usp.comm import sum_over_group
from ds_usp.integration.data.batch import IGNORE_INDEX, packed_documents, shard_batch
from ds_usp.integration.data.batch import shift_labels as shift_labels_of
from ds_usp.integration.step.loss import NO_TAIL, LogitsTail, gathered
from ds_usp.sharding import gather_sequence, shard_sequence
from ds_usp.topology import USPTopology


class TokenStats(NamedTuple):
    """Per-token statistics of the next-token distribution (TRL's ``FusedCausalLMOutput`` fields), each shaped like
    the labels and 0 where the label is ``-100``."""

    log_probs: Tensor  # log p(target), differentiable
    entropy: Tensor  # differentiable
    log_sum_sq_probs: Tensor  # log sum_v p_v^2, no gradient
    mean_logits: Tensor  # mean over the vocabulary of the temperature-scaled logits, no gradient
    is_top1: Tensor  # bool: the target is the (first) most likely token


def _chunk_stats(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, temperature: float,
                 tail: LogitsTail, fp32: bool) -> tuple[Tensor, ...]:
    """The :class:`TokenStats` of one chunk: ``(n, H)`` hidden states, ``(n,)`` targets."""
    if fp32:
        hidden, weight = hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
    logits = tail.apply(F.linear(hidden, weight, bias).float()) / temperature  # (n, V)
    logp = logits.log_softmax(-1)
    targets = labels.clamp_min(0).unsqueeze(-1)
    picked = logp.gather(-1, targets).squeeze(-1)  # (n,)
    entropy = -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        sum_sq = torch.logsumexp(2 * logp, dim=-1)
        mean = logits.mean(-1)
        top1 = logits.argmax(-1) == targets.squeeze(-1)
    return picked, entropy, sum_sq, mean, top1


def token_logprobs(hidden: Tensor, lm_head: nn.Module, labels: Tensor, temperature: float = 1.0,
                   chunk: int = 1024, tail: LogitsTail = NO_TAIL, fp32: bool = False) -> TokenStats:
    """Log-probability (and entropy, ...) of each token's target under ``softmax(tail(lm_head(hidden)) / temperature)``,
    in chunks.

    Args:
        hidden: ``(b, s_local, H)`` final hidden states of this rank's tokens (after the model's last norm).
        lm_head: the output projection (``vocab x H`` weight, optional bias; gathered under ZeRO-3).
        labels: ``(b, s_local)`` targets of those tokens (``shift_labels`` of :func:`ds_usp.shard_batch`), ``-100``
            where there is none.
        temperature: the sampling temperature the logits are divided by (TRL's ``temperature``).
        chunk: tokens per logits chunk.
        tail: what the model applies to ``lm_head``'s output (Gemma's soft-cap, Granite's scaling).
        fp32: project in float32 (TRL's ``cast_lm_head_to_fp32``).

    Returns:
        :class:`TokenStats`, fp32 (``is_top1`` bool), each ``(b, s_local)``, 0 where the label is ``-100``.

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
    parts = []
    with gathered([weight, bias]):
        for start in range(0, flat.shape[0], chunk):
            args = (flat[start:start + chunk], weight, bias, targets[start:start + chunk], temperature, tail, fp32)
            parts.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args))
    valid = labels != IGNORE_INDEX
    return TokenStats(*(torch.cat(column).view_as(labels) * valid for column in zip(*parts)))


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


# ------------------------------------------------------------------------------ TRL's fused LM head under SP


FUSED_HEAD_ATTR = "_ds_usp_fused_head"


class FusedHead(NamedTuple):
    """What TRL's ``add_fused_lm_head`` baked into the model, which ds-usp's forward needs to reproduce it (set by the
    RL trainers, :mod:`ds_usp.integration.trainers.rl`, as the model's :data:`FUSED_HEAD_ATTR`)."""

    temperature: float = 1.0
    fp32: bool = False


def padded_rows(attention_mask: Tensor) -> list[list[int]]:
    """The rows of a TRL batch as documents: left padding (prompts) is a document of its own, the rest one document.

    Causal attention over ``[pad..., tokens..., pad...]`` with the padding masked out is attention over the document
    ``tokens... pad...`` (the right padding is seen by no real token): so a row needs no key mask, only its documents.

    Args:
        attention_mask: ``(b, S)`` 1 on real tokens.

    Returns:
        Per row, the document lengths.

    Raises:
        ValueError: a row with padding between real tokens (that needs a key mask, which ds-usp does not take).
    """
    mask = attention_mask != 0
    seq = mask.shape[1]
    real = mask.any(1)
    lead = torch.where(real, mask.float().argmax(1), torch.full_like(real, seq, dtype=torch.long))  # first real token
    after = torch.arange(seq, device=mask.device) >= lead.unsqueeze(1)
    body = mask & after
    holes = (body[:, 1:] & ~body[:, :-1]) & after[:, :-1]  # a real token right after a masked one, past the start
    if bool(holes.any()):
        row = int(holes.any(1).nonzero()[0])
        raise ValueError(f"attention_mask row {row} has padding between real tokens; under sequence parallelism a row "
                         f"may be padded on the left and on the right only (as TRL pads prompts and completions)")
    return [[int(n), seq - int(n)] if 0 < int(n) < seq else [seq] for n in lead.tolist()]


def fused_forward(run_decoder: Callable[..., Tensor], head: nn.Module, tail: LogitsTail, topo: USPTopology,
                  layout: str, fused: FusedHead, input_ids: Tensor, attention_mask: Optional[Tensor],
                  position_ids: Optional[Tensor], labels: Optional[Tensor], shift_labels: Optional[Tensor],
                  num_items_in_batch: Optional[Tensor], chunk: Callable[[int], int]) -> dict[str, Any]:
    """TRL's ``model(..., labels=..., fused_lm_head=True)`` on a whole batch that every rank of the SP group holds.

    Args:
        run_decoder: ``run_decoder(shard, real_mask_shard) -> (b, s_local, H)`` hidden states of a shard of
            :func:`ds_usp.shard_batch`'s form (the caller adds the router loss when it needs ``real_mask_shard``).
        head: ``lm_head``.
        tail: the model's logits tail.
        topo: the topology.
        layout: the sequence layout.
        fused: TRL's temperature and fp32 choice.
        input_ids: ``(b, S)``, the same on every rank of the group (checked).
        attention_mask: ``(b, S)``, padding on the left and right only (:func:`padded_rows`), or None.
        position_ids: ``(b, S)`` or None (``0..S-1``, as the model numbers a batch it is not given positions for).
        labels: ``(b, S)`` unshifted, ``-100`` where not scored (the output then has ``S - 1`` positions).
        shift_labels: ``(b, S)`` already shifted (the output has ``S`` positions); one of the two is given.
        num_items_in_batch: the loss's divisor (default: the number of scored tokens).
        chunk: tokens per logits chunk, given the rank's token count (read after the decoder ran).

    Returns:
        ``FusedCausalLMOutput``'s fields: ``loss``, ``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``,
        ``is_top1``, ``label_mask``, each ``(b, S - 1)`` (or ``(b, S)``), the same on every rank of the group.
    """
    if input_ids is None or (labels is None) == (shift_labels is None):
        raise ValueError("fused_lm_head=True under sequence parallelism needs input_ids and labels (or shift_labels)")
    rows, seq = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    # padded rows (TRL's prompts and completions) are documents by their mask; padding-free rows (TRL's SFT packing)
    # by their position_ids, which shard_batch reads
    packed = attention_mask is None and position_ids is not None
    docs = None if packed else padded_rows(mask)
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).expand(rows, seq)
    if shift_labels is None:
        targets = shift_labels_of(labels)  # (b, S): next-token targets, the last one ignored
        out_len = seq - 1
    else:
        targets, out_len = shift_labels, seq
    batch = {"input_ids": input_ids, "position_ids": position_ids, **({} if packed else {"seq_lens": docs})}
    shard = shard_batch(batch, topo, layout=layout)
    if packed:
        docs = packed_documents(shard["cu_seq_lens_q"], rows)[1]
    local_targets = shard_sequence(targets.long(), topo, dim=1, layout=layout, pad_value=IGNORE_INDEX, doc_lens=docs)
    real = shard_sequence(mask, topo, dim=1, layout=layout, pad_value=0, doc_lens=docs)
    hidden = run_decoder(shard, real)
    stats = token_logprobs(hidden, head, local_targets, fused.temperature, chunk(local_targets.numel()), tail, fused.fp32)
    full = [gather_sequence(x, topo, dim=1, layout=layout, seq_len=seq, doc_lens=docs)[:, :out_len] for x in stats]
    label_mask = (targets != IGNORE_INDEX)[:, :out_len]
    count = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return dict(loss=-full[0].sum() / count, **dict(zip(TokenStats._fields, full)), label_mask=label_mask)
