"""What mask a transformers model asks for, read from the mask function it hands the ``"usp"`` mask interface.

transformers builds each layer type's mask (``create_causal_mask``, ``create_sliding_window_causal_mask``,
``create_chunked_causal_mask``, ``create_bidirectional_mask``...) by composing small index functions
(``causal_mask_function``, ``sliding_window_overlay(w)``, ``chunked_overlay(c, left_padding)``, padding and
packed-sequence functions, a model's own overlays) and handing the composition to the attention implementation's
mask interface. The ``"usp"`` interface builds no ``(s x s)`` tensor: :func:`usp_mask` walks the composition and
returns an :class:`HFMask` that says what it means (causal or not, a window, chunks), which the model then passes
to every layer of that type as its ``attention_mask``. The attention honours it (:mod:`ds_usp.integration.models.attention`).

Bidirectional blocks (``blockwise_overlay(block_sequence_ids)`` or-ed onto the causal mask: Gemma 3's images,
PaliGemma's prefix, Gemma 4...) are read as spans of global positions (:attr:`HFMask.spans`), which the attention
passes to :func:`ds_usp.usp_attention` as ``spans``. A part ds-usp does not know (a model's own overlay, any
function that is not one of transformers' mask primitives) is kept by name in :attr:`HFMask.unsupported`, and the attention refuses it,
so a mask ds-usp cannot compute is never replaced by a plain causal one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ds_usp.attention.usp import spans_tensor

_HF_MASKS = "transformers.masking_utils"


@dataclass(frozen=True)
class HFMask:
    """The mask a transformers mask creator asked for, over global positions.

    Attributes:
        causal: a query sees no later key (``causal_mask_function``); False: bidirectional.
        window: a query at ``q`` sees keys ``k > q - window`` (``sliding_window_overlay``: HF's ``sliding_window``).
        both_sides: a query sees keys with ``|q - k| <= both_sides`` (``sliding_window_bidirectional_overlay``).
        chunk: a query sees keys of its own chunk of ``chunk`` tokens (``chunked_overlay``, Llama 4).
        spans: per batch row, the ``(start, end)`` global positions of each bidirectional block (``blockwise_overlay``
            or-ed onto the mask; a sliding window around the or still bounds them on the left, one inside it does not,
            which is the same while no block is longer than the window, else refused); None: none.
        unsupported: the parts ds-usp does not implement, by name (the attention refuses them).
    """

    causal: bool = True
    window: Optional[int] = None
    both_sides: Optional[int] = None
    chunk: Optional[int] = None
    spans: Optional[tuple[tuple[tuple[int, int], ...], ...]] = None
    unsupported: tuple[str, ...] = ()

    def __getitem__(self, index: Any) -> "HFMask":
        """Some attention modules slice their mask to the key length (``mask[:, :, :, :k]``): the same mask."""
        return self

    def __getattr__(self, name: str) -> Any:
        """A model that reads its mask as a tensor (``mask.dtype``, ``mask.shape``...) outside the attention
        interface (a sparse-attention indexer) gets an error that says why, not a bare ``AttributeError``."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"the model reads its attention mask as a tensor (mask.{name}) outside transformers' "
                             f"attention interface; with attn_implementation='usp' there is no mask tensor (the "
                             f"layers get an HFMask description), and ds-usp cannot shard such a model's attention")


def _cells(fn: Callable) -> dict[str, Any]:
    """The closure variables of ``fn`` by name."""
    closure = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in closure)))


def _is_zero(x: Any) -> bool:
    return not bool((x != 0).any()) if hasattr(x, "any") else x == 0


def _read(fn: Callable, found: dict[str, Any]) -> None:
    """Add what mask function ``fn`` (an intersection of constraints, for the ``and`` at the top) requires: the reader
    of :data:`_READERS` for the transformers primitive it comes from; anything else is kept as unsupported."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if getattr(fn, "__module__", None) != _HF_MASKS or not hasattr(fn, "__code__"):
        found["unsupported"].append(f"{getattr(fn, '__module__', '?')}.{name}")
        return
    reader = _READERS.get(name.split(".")[0])
    if reader is None:  # blockwise_overlay alone, and whatever transformers adds next
        found["unsupported"].append(name.replace(".<locals>", ""))
    else:
        reader(_cells(fn), found)


def _set(key: str, cell: Optional[str] = None) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """A reader that records ``found[key]``: the closure variable ``cell``, or True."""
    def read(cells: dict[str, Any], found: dict[str, Any]) -> None:
        found[key] = True if cell is None else cells[cell]
    return read


def _read_all(cells: dict[str, Any], found: dict[str, Any]) -> None:
    for part in cells["mask_functions"]:
        _read(part, found)


def _read_chunks(cells: dict[str, Any], found: dict[str, Any]) -> None:
    found["chunk"] = cells["chunk_size"]
    if not _is_zero(cells["left_padding"]):
        found["unsupported"].append("chunked_overlay with left padding")


def _read_offsets(cells: dict[str, Any], found: dict[str, Any]) -> None:
    if not (_is_zero(cells["q_offset"]) and _is_zero(cells["kv_offset"])):
        found["unsupported"].append("a mask with cache offsets (generation with a cache)")
    _read(cells["mask_function"], found)


def _read_or(cells: dict[str, Any], found: dict[str, Any]) -> None:
    """A model's overlay widening the mask: one mask or-ed with bidirectional blocks (Gemma 3's images...)."""
    parts = cells["mask_functions"]
    blocks = [f for f in parts if _is_primitive(f, "blockwise_overlay")]
    others = [f for f in parts if not _is_primitive(f, "blockwise_overlay")]
    if len(blocks) != 1 or len(others) != 1 or found["spans"] is not None:
        names = ", ".join(getattr(f, "__qualname__", "?").split(".")[0] for f in parts)
        found["unsupported"].append(f"or_masks({names})")
        return
    window = found["window"]
    _read(others[0], found)
    _read_blocks(_cells(blocks[0])["block_sequence_ids"], found)
    if found["window"] != window and found["spans"]:  # or(window, blocks): no window bounds the blocks, which
        longest = max(b - a for row in found["spans"] for a, b in row)  # is the same while none is longer
        if longest > found["window"]:
            found["unsupported"].append(f"bidirectional blocks or-ed onto a sliding window of {found['window']} "
                                        f"tokens, one of them {longest} tokens long")


# transformers' mask primitive (the function's name, or the factory whose closure it is) -> what it requires
_READERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "and_masks": _read_all,
    "causal_mask_function": _set("causal"),
    "bidirectional_mask_function": _set("bidirectional"),
    "sliding_window_overlay": _set("window", "sliding_window"),
    "sliding_window_bidirectional_overlay": _set("both_sides", "sliding_window"),
    "chunked_overlay": _read_chunks,
    # the end padding and the documents reach the attention as cu_seq_lens_q (ds_usp.shard_batch)
    "padding_mask_function": lambda cells, found: None,
    "packed_sequence_mask_function": lambda cells, found: None,
    # positions counted from each document's start: as ds-usp does
    "remap_positions_for_packed_sequence": lambda cells, found: _read(cells["mask_function"], found),
    "add_offsets_to_mask_function": _read_offsets,
    "or_masks": _read_or,
}


def _is_primitive(fn: Callable, name: str) -> bool:
    """``fn`` is transformers' mask primitive ``name`` (or a closure it returned)."""
    return getattr(fn, "__module__", None) == _HF_MASKS and \
        getattr(fn, "__qualname__", "").split(".")[0] == name and hasattr(fn, "__code__")


def _read_blocks(ids: Any, found: dict[str, Any]) -> None:
    """``block_sequence_ids`` (``(b, S)``: a block's number at its tokens, -1 elsewhere) -> spans per row."""
    ids = ids.detach().cpu().long()
    rows = []
    for i, row in enumerate(ids):
        change = torch.ones_like(row, dtype=torch.bool)
        change[1:] = row[1:] != row[:-1]
        starts = change.nonzero().flatten().tolist() + [row.numel()]
        values = row[starts[:-1]].tolist()
        spans = [(a, b) for a, b, v in zip(starts, starts[1:], values) if v >= 0]
        numbers = [v for v in values if v >= 0]
        if len(set(numbers)) != len(numbers):
            found["unsupported"].append(f"blockwise_overlay with a block in two pieces (row {i}): a block must be one "
                                        f"run of tokens")
            return
        rows.append(tuple(spans))
    found["spans"] = tuple(rows) if any(rows) else None
    if found["spans"] is not None:  # the op's tensor of them, made here once per call, found by every layer
        spans_tensor(found["spans"])


def read_mask_function(mask_function: Callable) -> HFMask:
    """What a transformers mask function means.

    Args:
        mask_function: ``(batch_idx, head_idx, q_idx, kv_idx) -> bool`` as the mask creators compose it.

    Returns:
        The :class:`HFMask` (its ``unsupported`` names the parts ds-usp cannot compute).
    """
    found: dict[str, Any] = {"causal": False, "bidirectional": False, "window": None, "both_sides": None,
                             "chunk": None, "spans": None, "unsupported": []}
    _read(mask_function, found)
    if found["causal"] == found["bidirectional"]:
        found["unsupported"].append("a mask that is neither causal nor bidirectional")
    return HFMask(causal=found["causal"], window=found["window"], both_sides=found["both_sides"],
                  chunk=found["chunk"], spans=found["spans"], unsupported=tuple(found["unsupported"]))


def usp_mask(*args: Any, mask_function: Optional[Callable] = None, **kwargs: Any) -> Optional[HFMask]:
    """The ``"usp"`` mask interface: what the mask means, not an ``(s x s)`` tensor (see the module doc).

    Args:
        *args: what transformers passes positionally (nothing today).
        mask_function: the composed mask function.
        **kwargs: the sizes, the 2D padding mask, dtype, device, config (unused: the attention takes the real
            length and the documents from ``cu_seq_lens_q``).

    Returns:
        The :class:`HFMask`, or None when no mask function is given.
    """
    return None if mask_function is None else read_mask_function(mask_function)
