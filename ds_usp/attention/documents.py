"""A batch's packed documents as one immutable value, built once and read by every attention layer.

A model's attention layers all take the same documents (HF's ``cu_seq_lens_q``, a device tensor). Decoded in each
layer, they cost a host read per layer, each a wait for the device, in the forward and again in every recomputation.
:class:`Documents` holds what the layers need, made once per model call
(:func:`ds_usp.integration.data.batch.documents_of`): the lengths per row as tuples, the first position of every
document (:func:`ds_usp.sharding.normalize_docs`'s form) and the ring op's ``(b, n)`` lengths tensor, made once on the
host. :func:`ds_usp.attention.usp.attention` takes it as ``doc_lens``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from ds_usp.sharding import normalize_docs

Rows = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a batch's rows (equal, and hashed, by ``(rows, seq_len, lens)``).

    Attributes:
        rows: the batch's rows.
        seq_len: the real length of a row (every row's documents cover it).
        lens: per row, its document lengths; None when every row is one document.
        starts: per row, the first position of every document (:func:`ds_usp.sharding.normalize_docs`), or None.
        tensor: ``(rows, n)`` int64 CPU document lengths, zero-padded (the ring op's ``docs``), or None.
    """

    rows: int
    seq_len: int
    lens: Optional[Rows] = None
    starts: Optional[Rows] = field(init=False, default=None)
    tensor: Optional[Tensor] = field(init=False, default=None, repr=False)
    _hash: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        starts = normalize_docs(self.lens, self.rows, self.seq_len)  # the errors usp_attention gives doc_lens
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "tensor", None if starts is None else doc_tensor(starts, self.seq_len))
        object.__setattr__(self, "_hash", hash(self.key))

    @property
    def key(self) -> tuple[int, int, Optional[Rows]]:
        """``(rows, seq_len, lens)``: what the value is."""
        return self.rows, self.seq_len, self.lens

    def __eq__(self, other: Any) -> bool:
        return other is self or (isinstance(other, Documents) and other.key == self.key)

    def __hash__(self) -> int:
        return self._hash

    def fits(self, rows: int, seq_len: int) -> bool:
        """Whether these are documents of ``rows`` rows of ``seq_len`` real tokens.

        Args:
            rows: the batch's rows.
            seq_len: the real length.

        Returns:
            True when they are.
        """
        return self.rows == rows and self.seq_len == seq_len


def doc_tensor(docs: Rows, seq_len: int) -> Tensor:
    """Document starts per row -> ``(b, n)`` int64 CPU tensor of lengths, zero-padded (the ring op's argument).

    Args:
        docs: per row, the first position of every document.
        seq_len: the real length of a row.

    Returns:
        The lengths, rows padded with zeros.
    """
    lens = [[e - s for s, e in zip(row, row[1:] + (seq_len,))] for row in docs]
    n = max(len(x) for x in lens)
    return made_from(torch.tensor([x + [0] * (n - len(x)) for x in lens], dtype=torch.int64), tuple(map(tuple, docs)))


_MADE_FROM: dict[int, tuple[weakref.ref, Any]] = {}  # id(tensor) -> (the tensor, weakly; the value it was made from)


def made_from(tensor: Tensor, value: Any) -> Tensor:
    """``tensor`` (a host tensor an op takes for a Python value: the ring op's documents, spans, valid keys) recorded
    with the value it was made from, which the op's body reads back (:func:`value_made_from`) instead of reading the
    tensor: no ``.tolist()`` inside a layer. A custom op's body gets the same tensor object; the record holds it
    weakly and is dropped with it.

    Args:
        tensor: the tensor (not to be written).
        value: what it was made from, in the form its reader returns.

    Returns:
        ``tensor``.
    """
    key = id(tensor)
    _MADE_FROM[key] = (weakref.ref(tensor, lambda _, key=key: _MADE_FROM.pop(key, None)), value)
    return tensor


def value_made_from(tensor: Tensor) -> Any:
    """The value :func:`made_from` recorded for ``tensor``, or None (a tensor made elsewhere: read it).

    Args:
        tensor: the tensor.

    Returns:
        The value, or None.
    """
    found = _MADE_FROM.get(id(tensor))
    return found[1] if found is not None and found[0]() is tensor else None
