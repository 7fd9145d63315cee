"""Vision-language models under USP: the multimodal inputs resolved on the whole sequence, then sharded like text.

A VLM's body (``model.model``: Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA, Gemma 3, ...) embeds the tokens, runs its
vision tower, splices the visual features in at their placeholder tokens, computes the positions (Qwen's 3-D MRoPE from
the image and video grids) and then calls its language model with ``inputs_embeds`` and ``position_ids``. ds-usp runs
that body, the family's own code, on the whole sequence on every rank of the group, and shards at the language model's
door (:func:`sharded_language_model`): ``inputs_embeds``, ``position_ids`` (any leading dimensions: MRoPE's
``(3, b, S)``; in packed rows counted from each document's start, :func:`restart_per_document`) and what a layer
adds at visual positions (Qwen3-VL's deepstack: ``visual_pos_masks`` and the rows of ``deepstack_visual_embeds``
that belong to the rank's own visual positions) are cut to the rank's shard, the documents
passed as ``cu_seq_lens_q``. The decoder layers then run USP on the shard; the loss is the SP loss on the shard's
``shift_labels`` (:func:`ds_usp.shard_batch` shifts them over the whole sequence). The gradient reaching the vision
tower and the embeddings from each rank is its own positions' share; DeepSpeed's sum over the group is the whole.

The vision towers: :mod:`ds_usp.integration.models.vision`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from ds_usp.attention.checks import SPANS, agree_value
from ds_usp.integration.models.masks import HFMask
from ds_usp.sharding import normalize_docs, shard_sequence
from ds_usp.topology import USPTopology

BODY_SPANS_KEY = "ds_usp_body_spans"  # the body's bidirectional spans, passed on to the attention calls


def body_and_language_model(model: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
    """A VLM's body (the module that merges the visual features) and its language model; ``(None, None)`` for a
    text-only model."""
    body = getattr(model, "model", None)
    get_decoder = getattr(model, "get_decoder", None)
    candidates = [get_decoder() if callable(get_decoder) else None, getattr(body, "language_model", None),
                  getattr(body, "text_model", None)]  # Qwen-VL / LLaVA / Gemma 3: language_model; Idefics3: text_model
    children = list(body.children()) if isinstance(body, nn.Module) else []
    for language in candidates:
        if any(language is child for child in children) and \
                isinstance(getattr(language, "layers", None), nn.ModuleList):
            return body, language
    return None, None


def refuse_cross_attention(model: nn.Module) -> None:
    """Refuse a VLM whose text layers cross-attend to the image (Mllama): its keys are not the sequence's tokens.

    Raises:
        ValueError: naming the model and its cross-attention layers.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "cross_attention_layers", None)
    if layers:
        raise ValueError(f"{type(model).__name__} cross-attends from its text layers {list(layers)} to the image "
                         f"features: ds-usp shards self-attention over the sequence, not attention to another "
                         f"sequence, so cross-attention VLMs are not supported under \"sequence_parallel\" "
                         f"(self-attention VLMs are: docs/models.md)")


def _own_rows(mask: Tensor, topo: USPTopology, layout: str, docs: Any) -> tuple[Tensor, Tensor]:
    """``(mask_local, rows)``: for values holding one row per True of ``mask`` (``(b, S)``, row-major), the rows of
    this rank's own positions, in the order ``hidden[mask_local]`` enumerates them."""
    index = (mask.reshape(-1).long().cumsum(0) - 1).view_as(mask)
    local_mask = shard_sequence(mask, topo, dim=1, layout=layout, pad_value=False, doc_lens=docs)
    local_index = shard_sequence(index, topo, dim=1, layout=layout, pad_value=0, doc_lens=docs)
    return local_mask, local_index[local_mask]


def restart_per_document(positions: Tensor, starts: Optional[tuple[tuple[int, ...], ...]]) -> Tensor:
    """Positions of packed rows numbered from each document's start, as each document alone would be.

    The body numbers a packed row as one sequence (Qwen's MRoPE: text tokens one apart, an image or video at the
    running position plus its grid offsets, in each of the three dimensions alike); a document's positions alone are
    those minus the position at its first token (where all dimensions agree).

    Args:
        positions: ``(..., b, S)`` the body's positions of whole rows (MRoPE's leading 3).
        starts: per row, the first position of every document (None: one document per row).

    Returns:
        The positions with every document counted from 0.
    """
    if starts is None or all(len(row) == 1 for row in starts):
        return positions
    out = positions.clone()
    lead = (0,) * (positions.dim() - 2)
    for row, firsts in enumerate(starts):
        for a, b in zip(firsts[1:], firsts[2:] + (positions.shape[-1],)):
            out[..., row, a:b] -= positions[lead + (row, a)]
    return out


def _shard_call(kwargs: dict, topo: USPTopology, layout: str, documents: dict) -> dict:
    """The language model's keyword arguments, whole sequence -> this rank's shard."""
    embeds = kwargs.get("inputs_embeds")
    if embeds is None or kwargs.get("input_ids") is not None:
        raise ValueError("ds-usp shards a VLM's language model at its inputs_embeds; this family passes input_ids")
    rows, seq = embeds.shape[:2]
    docs = documents["docs"]
    positions = kwargs.get("position_ids")
    if positions is None:  # the language model would number the shard from 0
        positions = torch.arange(seq, device=embeds.device).expand(rows, seq)
    positions = restart_per_document(positions, normalize_docs(docs, rows, seq))
    shard = dict(kwargs)
    shard["inputs_embeds"] = shard_sequence(embeds, topo, dim=1, layout=layout, pad_value=0, doc_lens=docs)
    shard["position_ids"] = shard_sequence(positions, topo, dim=positions.dim() - 1, layout=layout, pad_value=0,
                                           doc_lens=docs)
    mask = kwargs.get("attention_mask")
    # the body's masks made by the "usp" mask interface (Gemma 3's image blocks as spans of global positions): a dict
    # per layer type is kept (the language model takes it as made); one mask, which the language model would make
    # again without the blocks (PaliGemma's prefix), is dropped and its spans travel beside cu_seq_lens_q to every
    # attention call. A padding tensor is dropped: documents and the real length travel as cu_seq_lens_q.
    described = isinstance(mask, dict) and mask and all(isinstance(m, HFMask) for m in mask.values())
    shard["attention_mask"] = mask if described else None
    if isinstance(mask, HFMask) and mask.spans:
        shard[BODY_SPANS_KEY] = mask.spans
    for made in (mask.values() if described else [mask] if isinstance(mask, HFMask) else []):
        if made.spans:  # agreed here, once per call: the layers' checks then leave them out (no all-gather inside one)
            agree_value(made.spans, topo.sp_group, SPANS, (("batch", len(made.spans)),),
                        caller=f"the VLM's language model ({rows} rows of {seq} tokens)")
    mask = kwargs.get("visual_pos_masks")
    if mask is not None:  # Qwen3-VL's deepstack: features added at the visual positions of the first layers
        shard["visual_pos_masks"], rows = _own_rows(mask, topo, layout, docs)
        if kwargs.get("deepstack_visual_embeds") is not None:
            shard["deepstack_visual_embeds"] = [features[rows] for features in kwargs["deepstack_visual_embeds"]]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        shard[key] = documents[key]
    return shard


@contextlib.contextmanager
def sharded_language_model(language: nn.Module, topo: USPTopology, layout: str, documents: dict) -> Iterator[None]:
    """While the block runs, ``language`` (a VLM's language model) takes the whole sequence's ``inputs_embeds`` and
    positions from its body and runs on this rank's shard (see the module docstring)."""
    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            raise ValueError(f"{type(module).__name__} is called with positional arguments; ds-usp shards its keyword "
                             f"inputs_embeds")
        return args, _shard_call(kwargs, topo, layout, documents)

    handle = language.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
