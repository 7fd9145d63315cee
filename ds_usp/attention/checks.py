"""Input checks of the USP attention: local ones (shapes, dtypes, devices, arguments) and one cross-rank one.

Everything here runs before the attention's first collective, so a bad call raises a ``ValueError``
on the rank that made it instead of leaving its partners waiting in an all-to-all.
"""
from __future__ import annotations

import math
import struct
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ds_usp.attention.ulysses import check_heads
from ds_usp.comm import all_gather_rows, backend_device_type, backend_device_types, group_device
from ds_usp.config import LAYOUTS
from ds_usp.sharding import per_row

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, ulysses_degree: int) -> None:
    """Shapes, dtypes and devices of this rank's q, k, v shards, and their heads against U.

    Args:
        q: ``(b, s_local, hq, d)``.
        k: ``(b, s_local, hkv, d)``.
        v: ``(b, s_local, hkv, dv)`` (``dv`` may differ from ``d``: MLA).
        ulysses_degree: U.

    Raises:
        ValueError: naming what is wrong.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same batch, length and heads "
                         f"(only their head dims may differ)")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local sequence length "
                         f"and head_dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[1] == 0 or q.shape[0] == 0:
        raise ValueError("the local sequence is empty" if q.shape[1] == 0 else "the batch is empty")
    check_heads(q.shape[2], k.shape[2], ulysses_degree)


def check_softcap(softcap: Any) -> float:
    """Validate an attention logit soft-cap and return it as a float (0: none).

    Args:
        softcap: None, 0 or a positive finite number (the scores become ``softcap * tanh(scores / softcap)``).

    Returns:
        The cap, 0.0 for none.

    Raises:
        ValueError: naming the value.
    """
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap ({softcap!r}) must be None, 0 or a positive finite number")
    return float(softcap)


def check_sinks(sinks: Any, num_heads: int, device: torch.device) -> None:
    """Validate attention sinks: one logit per query head (GPT-OSS ``s_aux``).

    Args:
        sinks: None or a ``(hq,)`` float tensor.
        num_heads: hq.
        device: the attention's device.

    Raises:
        ValueError: naming what is wrong.
    """
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or sinks.shape != (num_heads,) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float tensor of shape ({num_heads},) (one logit per query head), got "
                         f"{tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, q on {device}: put them on one device")


def _position_pairs(value: Any, batch: int, seq_len: int, name: str, what: str) -> list[list[tuple[int, int]]]:
    """Per row, the sorted ``(start, end)`` pairs of global positions of a per-row argument (spans, valid keys), each
    checked to be two integers with ``0 <= start <= end <= seq_len``; empty pairs are kept.

    Raises:
        ValueError: naming the argument, the row and the pair; or a row count that is not ``batch``.
    """
    rows = per_row(value, batch, name, what,
                   lambda rows: not rows or (isinstance(rows[0], (list, tuple)) and bool(rows[0]) and
                                             not isinstance(rows[0][0], (list, tuple))))
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"{name} row {i}: {row!r} is not a list of {what}")
        pairs = []
        for pair in row:
            ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in pair)
            if not ok or not 0 <= pair[0] <= pair[1] <= seq_len:
                raise ValueError(f"{name} row {i}: {pair!r} is not (start, end) with 0 <= start <= end <= {seq_len} "
                                 f"(the real length)")
            pairs.append((int(pair[0]), int(pair[1])))
        out.append(sorted(pairs))
    return out


def check_spans(spans: Any, batch: int, seq_len: int,
                docs: Optional[tuple[tuple[int, ...], ...]]) -> Optional[tuple[tuple[tuple[int, int], ...], ...]]:
    """Validate bidirectional spans and return them per row (``None``: no span in any row).

    Args:
        spans: ``None``; one list of ``(start, end)`` global positions for every row, or one list per row; or a
            ``(b, m, 2)`` integer tensor (rows padded with empty ``(0, 0)`` spans).
        batch: rows of the batch.
        seq_len: real global length.
        docs: document starts per row (``None``: one document), from :func:`ds_usp.sharding.normalize_docs`.

    Returns:
        Per row, the sorted non-empty spans.

    Raises:
        ValueError: a span that is not two integers with ``0 <= start < end <= seq_len``, spans that overlap, a span
            across a document boundary, or a row count that is not ``batch``.
    """
    if spans is None:
        return None
    out = []
    for i, row in enumerate(_position_pairs(spans, batch, seq_len, "spans", "(start, end) spans")):
        pairs = [pair for pair in row if pair[1] > pair[0]]
        for (a0, b0), (a1, _) in zip(pairs, pairs[1:]):
            if a1 < b0:
                raise ValueError(f"spans row {i}: {(a0, b0)} and the span starting at {a1} overlap")
        starts = docs[i] if docs else (0,)
        for a, b in pairs:
            inside = [d for d in starts if a < d < b]
            if inside:
                raise ValueError(f"spans row {i}: {(a, b)} crosses the document boundary at {inside[0]}; a "
                                 f"bidirectional span must lie inside one document")
        out.append(tuple(pairs))
    return tuple(out) if any(out) else None


def check_keys(keys: Any, batch: int, seq_len: int) -> Optional[tuple[tuple[tuple[int, int], ...], ...]]:
    """Validate the valid keys of each row and return them per row, sorted and merged (``None``: every key of every
    row is valid).

    Args:
        keys: ``None``; one list of ``(start, end)`` runs of global positions for every row, or one list per row; or a
            ``(b, m, 2)`` integer tensor (rows padded with empty ``(0, 0)`` runs).
        batch: rows of the batch.
        seq_len: real global length.

    Returns:
        Per row, the sorted, merged, non-empty runs; None when every row's runs cover ``[0, seq_len)``.

    Raises:
        ValueError: a run that is not two integers with ``0 <= start <= end <= seq_len``, a row without any valid key,
            or a row count that is not ``batch``.
    """
    if keys is None:
        return None
    out = []
    for i, row in enumerate(_position_pairs(keys, batch, seq_len, "keys", "(start, end) runs of valid keys")):
        runs: list[tuple[int, int]] = []
        for start, end in row:
            if end == start:
                continue
            if runs and start <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], end))
            else:
                runs.append((start, end))
        if not runs:
            raise ValueError(f"keys row {i}: no valid key at all; every query of the row would see nothing")
        out.append(tuple(runs))
    return None if all(row == ((0, seq_len),) for row in out) else tuple(out)


def check_scale(softmax_scale: Any) -> None:
    """Refuse a softmax scale that is not a positive finite number (None is fine: ``1/sqrt(head_dim)``).

    Args:
        softmax_scale: the value.

    Raises:
        ValueError: naming the value.
    """
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale ({softmax_scale!r}) must be a positive finite number or None "
                         f"(None: 1/sqrt(head_dim))")


def check_device(device: torch.device, group: Any) -> None:
    """Refuse tensors the groups' backend cannot move (NCCL needs CUDA tensors; gloo takes CPU ones, and CUDA ones
    through host memory: :func:`ds_usp.comm.backend_device_types`).

    Args:
        device: the tensors' device.
        group: the sequence-parallel group.

    Raises:
        ValueError: the device does not match the process groups' backend.
    """
    if dist.get_world_size(group) == 1:
        return
    wanted = backend_device_types(group)
    if wanted is not None and device.type not in wanted:
        names = " or ".join(sorted(wanted))
        raise ValueError(f"the tensors are on {device}, but the sequence-parallel groups use "
                         f"{dist.get_backend(group)}, which needs {names} tensors; move them with "
                         f".to('{backend_device_type(group)}') or initialize distributed with the other backend")


_SIGNATURE = ("batch", "local sequence length", "q heads", "kv heads", "head_dim", "v head_dim", "dtype", "causal",
              "layout", "seq_len", "softmax_scale", "documents, window, softcap and sinks (a hash)")
# what agree_value names the attention's own agreed values
DOCUMENTS, VALID_KEYS, SPANS = "documents", "valid keys", "bidirectional spans"
_SAME_SHARDS = ("every rank must pass its shard of the same sequences (shard them with ds_usp.shard_sequence / "
                "ds_usp.shard_batch) with the same arguments")


class Recent:
    """A set of at most ``size`` keys that forgets the one least recently seen (a bounded cache of agreements).

    Args:
        size: how many keys it keeps.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._keys: OrderedDict[Any, None] = OrderedDict()

    def seen(self, key: Any) -> bool:
        """Whether ``key`` is kept (then it becomes the most recent).

        Args:
            key: a hashable key.

        Returns:
            True when it is kept.
        """
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def add(self, key: Any) -> None:
        """Keep ``key`` as the most recent, forgetting the least recent beyond ``size``.

        Args:
            key: a hashable key.
        """
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)


# (SP group name, input signature) and (SP group name, what, value) every rank of that group has been checked to share
# (the values: a model call's documents, a DiT forward's key mask and the valid keys worked out of it, agree_value).
# A cache like the native op's: it only saves the check's all-gather on later calls with the same shapes. Bounded: a
# signature forgotten is checked again (the same on every rank, which make the same calls).
_AGREED = Recent(1024)


def _show(name: str, x: int) -> str:
    if name == "dtype":
        return str(DTYPES[x]).replace("torch.", "")
    if name == "layout":
        return LAYOUTS[x]
    if name == "softmax_scale":
        return f"{struct.unpack('<d', struct.pack('<q', x))[0]:g}"
    return str(bool(x)) if name == "causal" else str(x)


def _agree(sig: tuple[int, ...], names: tuple[str, ...], sp_group: Any, device: torch.device,
           caller: str = "usp_attention", advice: str = _SAME_SHARDS) -> None:
    """One all-gather of ``sig`` over the group; raise, the same on every rank, naming the values that differ
    (``caller`` was called with them; ``advice``: what to do)."""
    rows = [tuple(r.tolist()) for r in all_gather_rows(torch.tensor(sig, device=device), sp_group,
                                                          "usp_attention input check")]
    bad = [i for i in range(len(names)) if len({r[i] for r in rows}) > 1]
    if bad:
        ranks = dist.get_process_group_ranks(sp_group)
        diffs = "; ".join(names[i] + ": " + ", ".join(f"rank {ranks[p]}={_show(names[i], r[i])}"
                                                      for p, r in enumerate(rows)) for i in bad)
        raise ValueError(f"{caller} was called with different inputs on the ranks of one sequence-parallel "
                         f"group ({diffs}); {advice}")


def check_same_across_ranks(q: Tensor, k: Tensor, v: Tensor, sp_group: Any, causal: bool, layout: str, seq_len: int,
                            scale: float, mask: Any = None) -> None:
    """Check once per input signature that every rank of the SP group calls with the same one.

    A mismatch would otherwise deadlock or garble the all-to-all and the ring. The check is one
    small all-gather the first time a signature is seen on this group (later calls with the same
    shapes cost nothing: a per-call check would force a host sync per layer on GPUs). A rank whose
    shapes change while the others reuse a signature they already checked is caught by the group
    timeout instead.

    Args:
        q: this rank's q shard.
        k: this rank's k shard.
        v: this rank's v shard.
        sp_group: the sequence-parallel group.
        causal: the mask.
        layout: the sharding layout.
        seq_len: the real global length.
        scale: the softmax scale.
        mask: anything else that must agree (documents, window, softcap, sinks present), compared by its hash.

    Raises:
        ValueError: the same message on every rank of the group, naming each differing value per rank.
    """
    if dist.get_world_size(sp_group) == 1:
        return
    sig = (*q.shape[:3], k.shape[2], q.shape[3], v.shape[3], DTYPES.index(q.dtype), int(causal), LAYOUTS.index(layout),
           seq_len, struct.unpack("<q", struct.pack("<d", scale))[0], hash(mask))
    key = (sp_group.group_name, sig)
    if _AGREED.seen(key):
        return
    _agree(sig, _SIGNATURE, sp_group, q.device)
    _AGREED.add(key)


def value_agreed(value: Any, sp_group: Any, what: str) -> bool:
    """Whether every rank of the SP group was shown to hold ``value`` as its ``what`` (:func:`agree_value`, or
    :func:`mark_value_agreed` after a check that implies it); a group of one always agrees.

    Args:
        value: a hashable value.
        sp_group: the sequence-parallel group.
        what: what the value is (:data:`DOCUMENTS`, :data:`VALID_KEYS`, ...): a value agreed as one thing is not
            agreed as another.

    Returns:
        True when it was (the attention then leaves it out of its per-layer signature).
    """
    return dist.get_world_size(sp_group) == 1 or _AGREED.seen((sp_group.group_name, what, value))


def mark_value_agreed(value: Any, sp_group: Any, what: str) -> None:
    """Record that every rank of the SP group holds ``value`` as its ``what`` (its caller compared it across the ranks,
    or compared what it is a deterministic function of).

    Args:
        value: a hashable value.
        sp_group: the sequence-parallel group.
        what: what the value is, as for :func:`value_agreed`.
    """
    if dist.get_world_size(sp_group) > 1:
        _AGREED.add((sp_group.group_name, what, value))


def agree_value(value: Any, sp_group: Any, what: str, facts: tuple[tuple[str, int], ...] = (),
                caller: str = "usp_attention", advice: str = _SAME_SHARDS) -> None:
    """Check that every rank of the SP group holds the same ``value``: once per model call, before its first layer,
    with one small all-gather of ``facts`` and the value's hash unless it was shown to agree before (a bounded cache,
    :data:`_AGREED`); a group of one: nothing.

    Args:
        value: a hashable value whose hash is the same in every process for the same value (ints and tuples of them;
            not strings, whose hash each process salts).
        sp_group: the sequence-parallel group.
        what: what the value is, as for :func:`value_agreed`; the hash is named ``"<what> (a hash)"`` in the error.
        facts: ``(name, int)`` pairs compared beside the hash and named in the error (a batch, a length).
        caller: what was called with the value (named in the error).
        advice: what to do, the error's end.

    Raises:
        ValueError: the same message on every rank of the group, naming each differing value per rank.
    """
    if value_agreed(value, sp_group, what):
        return
    _agree((*(x for _, x in facts), hash(value)), (*(name for name, _ in facts), f"{what} (a hash)"), sp_group,
           group_device(sp_group), caller, advice)
    mark_value_agreed(value, sp_group, what)


def documents_agreed(documents: Any, sp_group: Any) -> bool:
    """Whether every rank of the SP group was shown to hold ``documents`` (:func:`agree_documents`, or
    :func:`mark_documents_agreed` after a check of the whole batch): :func:`value_agreed` of them.

    Args:
        documents: a :class:`ds_usp.attention.documents.Documents`.
        sp_group: the sequence-parallel group.

    Returns:
        True when they were (the attention then leaves them out of its per-layer signature).
    """
    return value_agreed(documents, sp_group, DOCUMENTS)


def mark_documents_agreed(documents: Any, sp_group: Any) -> None:
    """Record that every rank of the SP group holds ``documents`` (its caller compared them across the ranks):
    :func:`mark_value_agreed` of them.

    Args:
        documents: a :class:`ds_usp.attention.documents.Documents`.
        sp_group: the sequence-parallel group.
    """
    mark_value_agreed(documents, sp_group, DOCUMENTS)


def agree_documents(documents: Any, sp_group: Any) -> None:
    """Check that every rank of the SP group holds the same documents: once per model call, before its first layer
    (:func:`agree_value` of them, with their batch and length).

    Args:
        documents: a :class:`ds_usp.attention.documents.Documents`.
        sp_group: the sequence-parallel group.

    Raises:
        ValueError: the same message on every rank of the group, naming each differing value per rank.
    """
    agree_value(documents, sp_group, DOCUMENTS, (("batch", documents.rows), ("seq_len", documents.seq_len)))
