"""Sequence sharding of training batches and the sequence-parallel loss.

A batch of full sequences (identical on every rank of a sequence-parallel group; DeepSpeed's data
sampler already gives every SP rank of a replica the same batch) becomes this rank's shard:

* labels are shifted on the full sequence *before* sharding (``shift_labels[t] = labels[t + 1]``),
  so no target is lost at shard boundaries;
* positions stay global (RoPE needs them);
* the sequence is padded at its end to the layout's multiple (pad token, label ``-100``), which a
  causal model never attends to.

The loss of those shards, the whole sequence's token-weighted mean on every rank, is
:mod:`ds_usp.integration.step.loss`'s (``sp_cross_entropy``, or ``engine(..., shift_labels=...).loss``).
"""
from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ds_usp.attention.checks import mark_documents_agreed
from ds_usp.attention.documents import Documents
from ds_usp.comm import disagreements
from ds_usp.sharding import check_layout, gather_sequence, normalize_docs, shard_sequence
from ds_usp.topology import USPTopology

IGNORE_INDEX = -100
# Batch keys that make a batch multimodal: the inputs a VLM's body takes besides input_ids (passed to it unchanged).
VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
               "image_sizes", "pixel_attention_mask", "token_type_ids", "mm_token_type_ids", "image_position_ids")
MULTIMODAL_KEY = "multimodal"  # the shard's key holding the whole-sequence inputs of the body



def is_multimodal(batch: Any) -> bool:
    """Whether a batch carries visual inputs (:data:`VISUAL_KEYS`)."""
    return any(batch.get(k) is not None for k in VISUAL_KEYS)


def shift_labels(labels: Tensor, doc_lens: Optional[Sequence[Sequence[int]]] = None) -> Tensor:
    """Next-token targets of full sequences: ``out[:, t] = labels[:, t + 1]``; the last token of every document ignored.

    Args:
        labels: ``(b, S)`` token ids (``-100`` = ignored).
        doc_lens: per row, the lengths of its packed documents (``None``: one document per row);
            the target of a document's last token belongs to the next document, so it is ignored,
            as HF does.

    Returns:
        ``(b, S)`` shifted labels.
    """
    out = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    for row, lens in enumerate(doc_lens or ()):
        ends = torch.tensor(list(lens), device=labels.device).cumsum(0)[:-1] - 1  # last token of all but the last doc
        out[row, ends] = IGNORE_INDEX
    return out


def packed_doc_lens(batch: Mapping[str, Any], rows: int, seq: int) -> Optional[list[list[int]]]:
    """The documents of packed rows, the way HF's collators describe them; None for rows of one document.

    Read from, in this order: ``seq_lens`` (``(b, n)`` lengths, zero-padded, or a list per row),
    ``cu_seq_lens_q`` (cumulative lengths over the flattened batch, as ``DataCollatorWithFlattening``
    with ``return_flash_attn_kwargs`` gives them), or ``position_ids`` restarting at 0 inside a row
    (``DataCollatorWithFlattening``'s default).

    Args:
        batch: the batch of full sequences.
        rows: its rows.
        seq: its length.

    Returns:
        Per row, the document lengths (summing to ``seq``), or None.
    """
    if batch.get("seq_lens") is not None:
        lens = batch["seq_lens"]
        lens = lens.tolist() if isinstance(lens, Tensor) else list(lens)
        return [[int(x) for x in row if x] for row in (lens if lens and isinstance(lens[0], (list, tuple))
                                                       else [lens])]
    if batch.get("cu_seq_lens_q") is not None:
        return docs_from_cu_seq_lens(batch["cu_seq_lens_q"], rows)[1]
    positions = batch.get("position_ids")
    return None if positions is None else docs_from_positions(positions)


def docs_from_positions(positions: Tensor) -> Optional[list[list[int]]]:
    """The documents of full rows whose ``position_ids`` restart at 0 where a document starts (HF's
    ``DataCollatorWithFlattening``); None when no row restarts.

    Args:
        positions: ``(b, S)`` positions of full rows.

    Returns:
        Per row, the document lengths (summing to ``S``), or None.
    """
    if positions.dim() != 2 or not bool((positions[:, 1:] == 0).any()):
        return None
    seq = positions.shape[1]
    out = []
    for row in positions:
        starts = [0] + (torch.nonzero(row[1:] == 0).flatten() + 1).tolist()
        out.append([b - a for a, b in zip(starts, starts[1:] + [seq])])
    return out


def documents_of_shard(positions: Tensor, topo: USPTopology, layout: str) -> Optional[Tensor]:
    """The documents of a sharded batch found from its ``position_ids``, for a model called without them.

    The README's loop, ``engine(input_ids=..., position_ids=..., shift_labels=...)``, passes no document boundaries:
    the positions of the whole rows are gathered over the SP group (one all-gather of ``b x S`` integers) and a
    document starts wherever they restart at 0, as HF's own packed path reads them; the end padding
    :func:`shard_batch` adds (position 0) is cut off as the real length.

    Args:
        positions: ``(b, s_local)`` this rank's positions (as :func:`shard_batch` returns them).
        topo: the topology.
        layout: the batch's layout.

    Returns:
        ``cu_seq_lens_q`` as :func:`shard_batch` would have returned it, or None when every row is one document
        over the whole padded length (nothing to tell the attention).

    Raises:
        ValueError: packed rows under the ``"balanced"`` layout, whose shards are placed by the documents, so the
            rows cannot be put back together without them (on every rank of the group alike).
    """
    full = gather_sequence(positions, topo, dim=1, layout=layout) if topo.sp_size > 1 else positions  # (b, L)
    full = full.cpu()  # one read of the device's values; everything below is on the host
    rows, padded = full.shape
    # the real length: up to the last non-zero position of any row (the trailing zeros are the end padding)
    last = int(((full != 0) * torch.arange(1, padded + 1, device=full.device)).max())
    real = last or padded
    docs = docs_from_positions(full[:, :real])
    if docs is not None and layout == "balanced" and topo.sp_size > 1:
        raise ValueError("the model was called with packed rows (position_ids restart at 0) but without their "
                         "documents, under the 'balanced' layout, which places each rank's tokens by the documents: "
                         "call engine(**shard) with everything ds_usp.shard_batch returned (its cu_seq_lens_q), or "
                         "use layout 'zigzag'")
    if docs is None and real == padded:
        return None
    cu = cu_seq_lens(docs, rows, real, positions.device)
    mark_documents_agreed(documents_of(cu, rows), topo.sp_group)  # found from the positions the ranks gathered
    return cu


def right_padded_docs(attention_mask: Tensor) -> list[list[int]]:
    """The rows of a right-padded batch as documents: the real tokens, then the padding as one more document.

    Raises:
        ValueError: a row padded on the left or between real tokens (naming the row).
    """
    real = attention_mask != 0
    lengths = real.sum(1)
    expected = torch.arange(real.shape[1], device=real.device) < lengths.unsqueeze(1)
    if not bool((real == expected).all()):
        row = int((real != expected).any(1).nonzero()[0])
        raise ValueError(f"attention_mask row {row} has padding between real tokens or on the left: under sequence "
                         f"parallelism a batch may be padded on the right only (padding_side='right'), or packed")
    seq = real.shape[1]
    return [[n, seq - n] if 0 < n < seq else [seq] for n in lengths.tolist()]


def docs_from_cu_seq_lens(cu: Tensor, rows: int) -> tuple[int, list[list[int]]]:
    """``(real length, document lengths per row)`` from cumulative lengths over ``rows`` flattened rows.

    Args:
        cu: 1-D cumulative lengths, ``0`` first, ``rows * S`` last.
        rows: the batch's rows.

    Returns:
        ``(S, [[lengths of row 0], ...])``.

    Raises:
        ValueError: the boundaries do not split into ``rows`` rows of equal length.
    """
    return _split_rows(host_bounds(cu), rows)


def _split_rows(bounds: Sequence[int], rows: int) -> tuple[int, list[list[int]]]:
    """:func:`docs_from_cu_seq_lens` of boundaries already on the host."""
    total = bounds[-1]
    if total % rows or bounds[0] != 0:
        raise ValueError(f"cu_seq_lens ({list(bounds[:6])}...) does not describe {rows} rows of one length")
    seq = total // rows
    cuts = sorted(set(bounds) | {r * seq for r in range(rows + 1)})
    docs = [[b - a for a, b in zip(cuts, cuts[1:]) if r * seq <= a < (r + 1) * seq] for r in range(rows)]
    return seq, docs


class _Read:
    """What :func:`host_bounds` read of one tensor: the tensor (weakly), its version and storage when read, the
    values, and the :class:`Documents` decoded from them per row count."""

    def __init__(self, t: Tensor, stamp: tuple[int, int], bounds: tuple[int, ...]) -> None:
        self.ref, self.stamp, self.bounds = weakref.ref(t), stamp, bounds
        self.documents: dict[int, Documents] = {}


# id(tensor) -> what was read of it: the boundaries a model's call gives all its layers, read once, not per layer.
# Bounded (least recently used first out); an entry is valid while the same tensor object holds the same values.
_READS: OrderedDict[int, _Read] = OrderedDict()
_READS_SIZE = 32


def _stamp(t: Tensor) -> Optional[tuple[int, int]]:
    """``(version, data pointer)``: in-place writes bump the version (None: an inference tensor, which has none)."""
    try:
        return t._version, t.data_ptr()
    except (RuntimeError, NotImplementedError):  # an inference tensor, a tensor subclass without storage
        return None


def _read(t: Tensor) -> Optional[_Read]:
    """The cached read of ``t`` when it is still valid (and then the most recent), else None."""
    entry = _READS.get(id(t))
    if entry is None or entry.ref() is not t or entry.stamp != _stamp(t):
        return None
    _READS.move_to_end(id(t))
    return entry


def _remember(t: Tensor, bounds: tuple[int, ...]) -> _Read:
    """Cache ``bounds`` as the values of ``t`` (no entry while compiling or for an inference tensor)."""
    stamp = None if torch.compiler.is_compiling() else _stamp(t)
    entry = _Read(t, stamp, bounds)
    if stamp is not None:
        _READS[id(t)] = entry
        _READS.move_to_end(id(t))
        while len(_READS) > _READS_SIZE:
            _READS.popitem(last=False)
    return entry


def _entry(t: Tensor) -> _Read:
    """What was read of ``t``: cached, or read now (one host read) and cached."""
    entry = None if torch.compiler.is_compiling() else _read(t)
    return entry if entry is not None else _remember(t, tuple(int(x) for x in t.flatten().tolist()))


def host_bounds(cu: Tensor) -> tuple[int, ...]:
    """The values of ``cu`` (flattened) on the host, read once per tensor object: the model's call and every layer
    it runs, recomputations included, get the same tuple without a second read (and none for a ``cu_seq_lens``
    ds-usp made, :func:`cu_seq_lens`).

    Args:
        cu: cumulative document lengths (HF's ``cu_seq_lens_q``) or any integer tensor of boundaries.

    Returns:
        Its values as Python ints.
    """
    return _entry(cu).bounds


def documents_of(cu: Optional[Tensor], rows: int) -> Optional[Documents]:
    """The documents ``cu_seq_lens`` describes over ``rows`` rows, as one immutable value decoded once per tensor
    object (:func:`host_bounds`): every attention layer of a model's call reads the same value.

    Args:
        cu: cumulative lengths over the flattened rows (HF's ``cu_seq_lens_q``), or None.
        rows: the batch's rows.

    Returns:
        The :class:`Documents` (its ``lens`` None when every row is one document), or None when ``cu`` is.

    Raises:
        ValueError: the boundaries do not split into ``rows`` rows of equal length, or describe empty documents.
    """
    if cu is None:
        return None
    entry = _entry(cu)
    documents = entry.documents.get(rows)
    if documents is None:
        seq, docs = _split_rows(entry.bounds, rows)
        lens = None if all(len(row) == 1 for row in docs) else tuple(tuple(row) for row in docs)
        documents = entry.documents[rows] = Documents(rows, seq, lens)
    return documents


def packed_documents(cu: Optional[Tensor], rows: int) -> tuple[Optional[int], Optional[list[list[int]]]]:
    """``(real length, document lengths per row)`` from ``cu_seq_lens`` (:func:`documents_of`: read once per tensor),
    the documents None when every row is one document (nothing packed); ``(None, None)`` when ``cu`` is None."""
    documents = documents_of(cu, rows)
    if documents is None:
        return None, None
    return documents.seq_len, None if documents.lens is None else [list(row) for row in documents.lens]


def cu_seq_lens(doc_lens: Optional[Sequence[Sequence[int]]], rows: int, seq: int, device: Any) -> Tensor:
    """Cumulative document lengths over the flattened rows (int32), HF's ``cu_seq_lens_q/k`` convention.

    Args:
        doc_lens: per row, its document lengths (``None``: one document of ``seq`` per row).
        rows: the batch's rows.
        seq: the real length of a row.
        device: where to put it.

    Returns:
        ``[0, ...]`` ending at ``rows * seq``.
    """
    lens = [x for row in (doc_lens or [[seq]] * rows) for x in row]
    out = torch.tensor([0] + lens, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
    _remember(out, tuple(itertools.accumulate([0] + [int(x) for x in lens])))  # its values, known without a read
    return out


def check_same_batch(tensors: Mapping[str, Tensor], topo: USPTopology) -> None:
    """Check that every rank of the SP group holds the same full batch (one small all-gather of checksums).

    A data loader that gives the ranks of one sequence different samples would make them train on a
    patchwork of sequences without any error; this makes it loud.

    Args:
        tensors: the batch's tensors by name (same shapes on every rank).
        topo: the topology.

    Raises:
        ValueError: on every rank of the group, naming the ranks that hold another batch.
    """
    if topo.sp_size == 1:
        return
    differ = disagreements(tensors, topo.sp_group, "batch check")
    ranks = list(topo.sp_ranks)
    odd = sorted({r for holders in differ.values() for others in list(holders.values())[1:] for r in others})
    if odd:
        raise ValueError(f"the ranks of one sequence-parallel group {ranks} got different batches (ranks {odd} differ "
                         f"from rank {ranks[0]}): every rank of a sequence-parallel group must get the same batch "
                         f"of full sequences; split the data over replicas only (DeepSpeed's loader does, or a "
                         f"DistributedSampler with num_replicas=dp_size and rank=dp_rank), or wrap a loader whose "
                         f"DistributedSampler spans every rank in ds_usp.USPDataLoader, which trains the group's "
                         f"batches in turn")


def shard_batch(batch: Mapping[str, Any], topo: USPTopology, layout: str = "zigzag",
                pad_token_id: int = 0) -> dict[str, Any]:
    """This rank's shard of a batch of full sequences, packed documents included.

    Args:
        batch: ``input_ids`` ``(b, S)`` (required); optional ``labels`` ``(b, S)`` (default: the
            input ids), ``position_ids`` ``(b, S)`` (default: ``0..S-1``, or the
            model's own numbering, ``topo.default_positions``), ``attention_mask`` (1 on real
            tokens; padding on the right only, labels -100 there: it becomes a document no real token sees), and packed
            documents as HF's collators describe them (see :func:`packed_doc_lens`).
        topo: the topology.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``; must match the attention's layout.
        pad_token_id: token used to pad the sequence end.

    Returns:
        ``input_ids``, ``position_ids``, ``shift_labels`` and ``attention_mask`` (1 on real tokens, 0 on
        the end padding; the ``"usp"`` attention builds no mask from it), each ``(b, padded_S / (U*R))``, and the
        documents over the global sequence as HF's ``cu_seq_lens_q``/``cu_seq_lens_k`` and
        ``max_length_q``/``max_length_k`` (one document per row when not packed: they also tell the
        attention the real length). Call ``engine(**shard)``: the model's attention reads the
        documents, and the loss uses ``shift_labels``. Given a dynamic-SP degree's topology
        (``engine.usp.topo.degrees[d]``) and the rows of this rank's sub-group, the shard also says ``sp_degree``.

    Raises:
        ValueError: missing or malformed keys, an attention mask padded elsewhere than on the right, documents that do
            not cover the rows, a bad layout, or ranks of the SP group holding different batches (see
            :func:`check_same_batch`).
    """
    check_layout(layout)
    if "input_ids" not in batch:
        raise ValueError(f"batch has no 'input_ids' (keys: {sorted(batch)})")
    ids = batch["input_ids"]
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor (batch, seq), got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    b, s = ids.shape
    if s == 0:
        raise ValueError("input_ids holds an empty sequence")
    for key in ("labels", "position_ids", "attention_mask"):
        if key in batch and batch[key] is not None and tuple(batch[key].shape) != (b, s):
            raise ValueError(f"{key} has shape {tuple(batch[key].shape)}, expected {(b, s)} like input_ids")
    mask = batch.get("attention_mask")
    padded = mask is not None and not bool((mask != 0).all())
    labels = batch.get("labels")
    labels = ids if labels is None else labels
    if padded:  # right padding (a collator's padding_side="right"): the padding is a document no real token sees
        docs = right_padded_docs(mask)
        if packed_doc_lens(batch, b, s) is not None:
            raise ValueError("a batch with both packed documents and attention_mask padding: pack or pad, not both")
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX) if batch.get("labels") is None else labels
        if bool((labels[mask == 0] != IGNORE_INDEX).any()):
            raise ValueError("labels at padded positions (attention_mask 0) must be -100: HF's loss would score them "
                             "from padding, which ds-usp keeps apart")
    else:
        docs = packed_doc_lens(batch, b, s)
    normalize_docs(docs, b, s)  # lengths that do not cover the rows are refused here, before any collective
    positions = batch.get("position_ids")
    if positions is None:  # the model's own numbering of a full sequence (RoBERTa: from padding_idx + 1)
        rule = topo.default_positions
        positions = torch.arange(s, device=ids.device).expand(b, s) if rule is None else rule(ids)
    cu = cu_seq_lens(docs, b, s, ids.device)
    check_same_batch({"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seq_lens": cu}, topo)
    mark_documents_agreed(documents_of(cu, b), topo.sp_group)  # the check above compared them across the ranks

    def shard(x: Tensor, pad: float = 0) -> Tensor:
        return shard_sequence(x, topo, dim=1, layout=layout, pad_value=pad, doc_lens=docs)

    longest = max(max(row) for row in docs) if docs else s
    extra = {}
    if is_multimodal(batch):  # a VLM: its body resolves the visual inputs on the whole sequence, then shards
        extra[MULTIMODAL_KEY] = {"input_ids": ids, "docs": docs, "attention_mask": mask if padded else None,
                                 **{k: batch[k] for k in VISUAL_KEYS if batch.get(k) is not None}}
    if topo.parent_sp_group is not None:  # a dynamic-SP degree: the model runs this batch on that sub-group
        extra["sp_degree"] = topo.sp_size
    return {**extra,
        "input_ids": shard(ids.long(), pad_token_id),
        "position_ids": shard(positions.long()),  # padding gets position 0: it belongs to no document, meets nothing
        "shift_labels": shard(shift_labels(labels.long(), docs), IGNORE_INDEX),
        "attention_mask": shard(mask.long() if padded else torch.ones_like(ids, dtype=torch.long), 0),  # 0: padding
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
    }
