"""Dynamic sequence parallelism: each of a step's documents on the smallest SP degree its length needs.

Real data is long-tailed: most documents are short, a few are long. :func:`plan_step` packs one optimizer step's
documents into rows and micro batches: a document longer than ``tokens_per_rank`` goes to a row of the smallest degree
``d`` (a divisor of the SP size) with ``d * tokens_per_rank`` tokens, shorter ones fill the rows' free room (the
longest first, into the open row of the smallest degree with room, so a short document rides along in a long
document's row instead of paying a degree of its own), and the rows of one degree are cut into micro batches of
``sp / d`` rows, one per sub-group, rows of similar attention cost together (the slowest sub-group sets a micro batch's
time); a micro batch left with fewer rows than sub-groups (the last of its degree) runs them at the highest degree
that still gives each its own sub-group, instead of leaving ranks idle. :func:`micro_batch_shards` gives a rank its
sub-group's row of every micro batch, sharded (:func:`ds_usp.shard_batch` with that degree's groups,
``topo.degrees[d]``), and :func:`step_targets` counts the step's targets (each micro batch's loss is the sum of its
targets' losses over the whole SP group divided by them). The step itself, forward, backward and the optimizer step,
is :mod:`ds_usp.integration.step.dynamic`'s (``ds_usp.dynamic_sp_step`` and the HF Trainer's). Everything
here is decided from the lengths alone, so every rank of the group makes the same plan without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ds_usp.config import divisors
from ds_usp.integration.data.batch import IGNORE_INDEX, packed_doc_lens, right_padded_docs, shard_batch


@dataclass(frozen=True)
class MicroBatch:
    """One micro batch of a dynamic-SP step.

    Attributes:
        degree: the sequence-parallel degree its rows run at.
        rows: one row per sub-group (``sp / degree`` of them, in sub-group order): the indices of the step's documents
            packed into it, in order (empty: that sub-group runs a one-token row that holds no target).
    """

    degree: int
    rows: tuple[tuple[int, ...], ...]

    def row_of(self, sp_rank: int) -> tuple[int, ...]:
        """The documents of the row the rank at ``sp_rank`` (its position in the full SP group) runs."""
        return self.rows[sp_rank // self.degree]


def attention_cost(length: int, linear: float = 64.0) -> float:
    """The work of one document, in units of query-key pairs: causal attention (``n^2 / 2``) plus ``linear`` pairs'
    worth per token for everything else (projections, MLP)."""
    return length * length / 2 + linear * length


def plan_step(lengths: Sequence[int], sp_size: int, tokens_per_rank: int,
              degrees: Optional[Sequence[int]] = None) -> list[MicroBatch]:
    """Pack one step's documents into micro batches, each row on the smallest degree its longest document needs.

    Args:
        lengths: the tokens of every document of the step (all ranks of the SP group pass the same).
        sp_size: ranks of the SP group.
        tokens_per_rank: the most tokens one rank holds of a row (a degree-``d`` row holds ``d`` times this).
        degrees: the degrees rows may run at (default: every divisor of ``sp_size``; ``[sp_size]``: static SP, every
            row packed to ``sp_size * tokens_per_rank`` tokens on the whole group).

    Returns:
        The micro batches, the highest degree first.

    Raises:
        ValueError: a document longer than ``sp_size * tokens_per_rank``, or bad sizes.
    """
    if sp_size < 1 or tokens_per_rank < 1:
        raise ValueError(f"sp_size ({sp_size}) and tokens_per_rank ({tokens_per_rank}) must be positive")
    allowed = divisors(sp_size)
    if degrees is not None:
        wrong = [d for d in degrees if d not in allowed]
        if wrong or not degrees:
            raise ValueError(f"degrees {list(degrees)}: each must divide the SP size {sp_size}")
        allowed = sorted(degrees)
    degrees = allowed
    rows: list[list[Any]] = []  # [degree, free tokens, [document indices]]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        if n < 1:
            raise ValueError(f"document {i} has {n} tokens")
        need = next((d for d in degrees if n <= d * tokens_per_rank), None)
        if need is None:
            raise ValueError(f"document {i} has {n} tokens, more than the SP group holds ({sp_size} ranks x "
                             f"{tokens_per_rank} tokens per rank): raise tokens_per_rank or cut the document")
        fits = [row for row in rows if row[1] >= n]
        if fits:
            row = min(fits, key=lambda r: (r[0], r[1]))
        else:
            row = [need, need * tokens_per_rank, []]
            rows.append(row)
        row[1] -= n
        row[2].append(i)
    plan = []
    for d in sorted({row[0] for row in rows}, reverse=True):
        mine = sorted((row[2] for row in rows if row[0] == d),
                      key=lambda docs: -sum(attention_cost(int(lengths[i])) for i in docs))
        per = sp_size // d
        for start in range(0, len(mine), per):
            group = [tuple(sorted(docs)) for docs in mine[start:start + per]]
            # a micro batch with fewer rows than sub-groups (the last of its degree) spreads them over the ranks that
            # would sit idle: the highest allowed degree that still gives every row a sub-group of its own
            spread = max(e for e in degrees if e >= d and sp_size // e >= len(group))
            plan.append(MicroBatch(degree=spread, rows=tuple(group + [()] * (sp_size // spread - len(group)))))
    return plan


def pack_row(documents: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Documents (each ``input_ids`` and optional ``labels``, ``(1, n)`` or ``(n,)``) as one packed row whose
    ``position_ids`` restart at each document (HF's flattening convention); no documents: one padding token, marked
    as padding (``attention_mask`` 0) so that nothing counts it (the MoE router loss is a mean over real tokens)."""
    if not documents:
        return {"input_ids": torch.zeros(1, 1, dtype=torch.long), "labels": torch.full((1, 1), IGNORE_INDEX),
                "attention_mask": torch.zeros(1, 1, dtype=torch.long)}
    ids = [d["input_ids"].reshape(-1) for d in documents]
    labels = [d.get("labels", d["input_ids"]).reshape(-1) for d in documents]
    return {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
            "position_ids": torch.cat([torch.arange(len(x)) for x in ids])[None]}


def step_targets(documents: Sequence[Mapping[str, Tensor]]) -> int:
    """The targets of a step's documents: each document's labels after its first token that are not ignored."""
    return sum(int((d.get("labels", d["input_ids"]).reshape(-1)[1:] != IGNORE_INDEX).sum()) for d in documents)


def documents_of_batch(batch: Mapping[str, Any]) -> list[dict[str, Tensor]]:
    """A collated batch's documents, each ``input_ids`` and ``labels`` ``(n,)``: every row's real tokens (the
    ``attention_mask``'s right padding dropped), packed rows cut into their documents (as HF's collators describe them:
    ``seq_lens``, ``cu_seq_lens_q`` or restarting ``position_ids``).

    Raises:
        ValueError: padding on the left or between real tokens.
    """
    ids = batch["input_ids"]
    rows, seq = ids.shape
    labels = batch.get("labels")
    labels = ids if labels is None else labels
    mask = batch.get("attention_mask")
    real = [seq] * rows if mask is None else [row[0] for row in right_padded_docs(mask)]
    packed = packed_doc_lens(batch, rows, seq) or [[seq]] * rows
    out = []
    for r in range(rows):
        start = 0
        for n in packed[r]:
            end = min(start + n, real[r])
            if end > start:
                out.append({"input_ids": ids[r, start:end], "labels": labels[r, start:end]})
            start += n
    return out


def micro_batch_shards(topo: Any, layout: str, documents: Sequence[Mapping[str, Tensor]], tokens_per_rank: int,
                       degrees: Optional[Sequence[int]] = None) -> list[dict[str, Any]]:
    """This rank's shard of every micro batch of :func:`plan_step` over ``documents`` (its sub-group's row, sharded
    over that degree's groups), in order.

    Args:
        topo: the full SP topology (an engine's ``engine.usp.topo``), with every degree's groups in ``topo.degrees``.
        layout: where each rank's tokens live (``engine.usp.layout``, see :func:`ds_usp.shard_batch`).
        documents: the step's documents, each ``input_ids`` and optional ``labels`` (the same on every rank of the SP
            group).
        tokens_per_rank: the most tokens a rank holds of a row.
        degrees: the degrees rows may run at (see :func:`plan_step`).

    Returns:
        One shard (the keyword arguments of the model's forward) per micro batch, the plan's order.

    Raises:
        ValueError: the topology has no dynamic-SP degrees, or a document does not fit (:func:`plan_step`).
    """
    if len(topo.degrees) <= 1 and topo.sp_size > 1 and list(degrees or ()) != [topo.sp_size]:
        raise ValueError("dynamic SP needs an engine built with \"usp\": {\"dynamic_sp\": true}")
    plan = plan_step([int(d["input_ids"].numel()) for d in documents], topo.sp_size, tokens_per_rank, degrees)
    return [shard_batch(pack_row([documents[i] for i in micro.row_of(topo.sp_rank)]),
                        topo.degrees.get(micro.degree, topo), layout=layout) for micro in plan]
