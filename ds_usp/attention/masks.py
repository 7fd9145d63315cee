"""Which (query, key) pairs may meet, decided per ring block in one place: causal, documents, windows, padding.

A :class:`MaskSpec` describes the mask over the *global* sequence: causal or not, the real length
(positions past it are padding and meet nothing), the documents of each batch row (a query sees only
keys of its own document), a sliding window ``(left, right)`` (a query at ``q`` sees keys
``q - left ... q + right``) and bidirectional spans (an image's tokens under Gemma 3 or PaliGemma's prefix:
a query inside a span also sees the later keys of its span; the window's left bound still holds) and the valid keys
of each row (a key outside them is seen by no query: a padded or masked-out token in the middle of the sequence, as
a diffusion transformer's joint text and image segments have). :func:`block_parts` turns it, for one block (this rank's ring piece of
queries against a source rank's piece of keys, both lists of position runs, see
:func:`ds_usp.sharding.piece_runs`), into :class:`Part` rectangles that hold every allowed pair:
a rectangle with no allowed pair is never produced (no kernel call), and inside a rectangle the
allowed pairs are a band ``lo <= k - q <= hi`` of local indices, which a kernel takes as a full
block, a causal block or a band (:func:`ds_usp.kernels.forward_pieces`). No ``S x S`` tensor exists anywhere.
:func:`needed_steps` says how many ring steps any rank needs, so the ring stops early when a whole
tail of it is masked (a window shorter than the pieces with the contiguous layout).
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ds_usp.sharding import Docs, Runs

Spans = tuple[tuple[int, int], ...]  # (start, end) of global positions, sorted, disjoint


class RowMask(NamedTuple):
    """What a group of batch rows shares: the first position of every document, the bidirectional spans and the
    valid keys (None: every key up to the real length)."""

    starts: tuple[int, ...]
    spans: Spans = ()
    keys: Optional[Spans] = None


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask over the global sequence.

    Attributes:
        causal: a query sees no later key.
        seq_len: real tokens; later positions are padding and meet nothing.
        docs: per batch row, the first position of every document (``None``: one document).
        window: ``(left, right)`` in tokens (``None``: unlimited); ``right`` is 0 when causal.
        spans: per batch row, bidirectional spans inside documents (``None``: none): a query in a span sees every
            key of its span that the window's left bound allows, later ones included.
        keys: per batch row, the ``(start, end)`` runs of positions whose keys may be seen at all (``None``: every
            key before ``seq_len``); every other rule still applies inside them.
    """

    causal: bool
    seq_len: int
    docs: Optional[Docs] = None
    window: Optional[tuple[int, int]] = None
    spans: Optional[tuple[Spans, ...]] = None
    keys: Optional[tuple[Spans, ...]] = None

    def row_groups(self, batch: int) -> list[tuple[slice, RowMask]]:
        """Batch rows that share one document layout and spans, as ``(rows, RowMask)``.

        Args:
            batch: rows of the batch.

        Returns:
            One group for all rows when they share them, else one group per row.
        """
        rows = self.rows(batch)
        if len(set(rows)) == 1:
            return [(slice(None), rows[0])]
        return [(slice(i, i + 1), row) for i, row in enumerate(rows)]

    def rows(self, batch: int) -> list[RowMask]:
        """Every row's :class:`RowMask`."""
        return [RowMask(self.docs[i] if self.docs else (0,), self.spans[i] if self.spans else (),
                        self.keys[i] if self.keys else None) for i in range(batch)]

    def bounds(self) -> tuple[Optional[int], Optional[int]]:
        """``(L, R)``: a query at ``q`` may see keys ``q - L ... q + R`` (None: no bound on that side)."""
        left, right = self.window if self.window is not None else (None, None)
        return left, (0 if self.causal else right)


def chunk_docs(docs: Optional[Docs], batch: int, seq_len: int, chunk: int) -> Optional[Docs]:
    """Documents cut into chunks of ``chunk`` tokens counted from each document's start (chunked attention,
    Llama 4: a query sees only keys of its own chunk), as document starts per row.

    Args:
        docs: per row, the first position of every document (``None``: one document per row).
        batch: rows of the batch.
        seq_len: real tokens per row.
        chunk: tokens per chunk; 0: no chunking (``docs`` is returned as is).

    Returns:
        The starts of every chunk of every document, per row.
    """
    if chunk <= 0:
        return docs
    rows = docs if docs is not None else ((0,),) * batch
    return tuple(tuple(p for start, end in zip(row, row[1:] + (seq_len,)) for p in range(start, end, chunk))
                 for row in rows)


@dataclass(frozen=True)
class Part:
    """A rectangle of one block: query rows ``q`` of this rank's piece, key rows ``k`` of the source piece.

    Attributes:
        q: rows of the query piece.
        k: rows of the key piece.
        lo: a query at local index ``i`` sees keys ``j`` with ``j - i >= lo`` (None: no such bound).
        hi: ``j - i <= hi`` (None: no such bound). ``(None, None)``: every pair; ``(None, 0)`` on a
            square part: the causal lower triangle.
    """

    q: slice
    k: slice
    lo: Optional[int] = None
    hi: Optional[int] = None

    @property
    def causal(self) -> bool:
        """A square part whose band is exactly the causal lower triangle."""
        return self.lo is None and self.hi == 0 and self.q.stop - self.q.start == self.k.stop - self.k.start

    @property
    def full(self) -> bool:
        """Every pair of the part meets."""
        return self.lo is None and self.hi is None


def _with_offsets(runs: Runs, keep: Optional[Spans] = None) -> list[tuple[int, int, int]]:
    """``(first position, length, row of the piece where the run starts)`` per run; with ``keep``, only the parts of
    the runs inside those ``(start, end)`` runs of positions (each with its own row)."""
    out, row = [], 0
    for start, length in runs:
        if keep is None:
            out.append((start, length, row))
        else:
            for a, b in keep[max(bisect.bisect_right(keep, (start, start)) - 1, 0):]:
                if a >= start + length:
                    break
                lo, hi = max(a, start), min(b, start + length)
                if lo < hi:
                    out.append((lo, hi - lo, row + lo - start))
        row += length
    return out


@functools.lru_cache(maxsize=4096)
def block_parts(spec: MaskSpec, row: RowMask, q_runs: Runs, k_runs: Runs) -> tuple[Part, ...]:
    """The rectangles of one block that hold all its allowed pairs (empty: skip the block).

    Args:
        spec: the mask.
        row: the documents and spans of the rows at hand (from :meth:`MaskSpec.row_groups`).
        q_runs: the query piece's runs.
        k_runs: the key piece's runs.

    Returns:
        The parts, in query order; adjacent full parts are joined.
    """
    left, right = spec.bounds()
    doc_starts = row.starts
    ends = list(doc_starts[1:]) + [spec.seq_len]
    parts: list[Part] = []
    for qa, qn, qrow in _with_offsets(q_runs):
        q_end = min(qa + qn, spec.seq_len)
        for ka, kn, krow in _with_offsets(k_runs, row.keys):
            k_end = min(ka + kn, spec.seq_len)
            if qa >= q_end or ka >= k_end:
                continue

            def rect(q0: int, q1: int, k0: int, k1: int, right: Optional[int]) -> None:
                # keep only keys some query of [q0, q1) sees, and queries that see some key of [k0, k1)
                if left is not None:
                    k0, q1 = max(k0, q0 - left), min(q1, k1 + left)
                if right is not None:
                    k1, q0 = min(k1, q1 + right), max(q0, k0 - right)
                if q0 >= q1 or k0 >= k1:
                    return
                lo = None if left is None or q0 - k0 - left <= -(q1 - q0 - 1) else q0 - k0 - left
                hi = None if right is None or q0 - k0 + right >= k1 - k0 - 1 else q0 - k0 + right
                parts.append(Part(slice(qrow + q0 - qa, qrow + q1 - qa), slice(krow + k0 - ka, krow + k1 - ka), lo, hi))

            first = max(bisect.bisect_right(doc_starts, max(qa, ka)) - 1, 0)
            for d in range(first, len(doc_starts)):
                ds, de = doc_starts[d], ends[d]
                if ds >= min(q_end, k_end):
                    break
                q0, q1 = max(qa, ds), min(q_end, de)
                k0, k1 = max(ka, ds), min(k_end, de)
                for s0, s1, span in _query_segments(q0, q1, row.spans):
                    if span is None:
                        rect(s0, s1, k0, k1, right)
                    else:  # a span's queries: the usual bounds outside it, no right bound inside it
                        a, b = span
                        rect(s0, s1, k0, min(k1, a), right)
                        rect(s0, s1, max(k0, a), min(k1, b), None)
                        rect(s0, s1, max(k0, b), k1, right)
    return tuple(_join(parts))


def _query_segments(q0: int, q1: int, spans: Spans) -> list[tuple[int, int, Optional[tuple[int, int]]]]:
    """``[q0, q1)`` cut at the edges of the spans it meets: ``(start, end, span or None)`` in order."""
    out, at = [], q0
    for a, b in spans[max(bisect.bisect_right(spans, (q0, q0)) - 1, 0):]:
        if a >= q1:
            break
        if b <= at:
            continue
        if a > at:
            out.append((at, a, None))
        out.append((max(at, a), min(b, q1), (a, b)))
        at = min(b, q1)
    if at < q1:
        out.append((at, q1, None))
    return out


def _join(parts: list[Part]) -> list[Part]:
    """Join full parts that share keys and have adjacent query rows, then full parts sharing queries with
    adjacent keys (the two runs of a zigzag piece against one key run become one kernel call)."""
    out: list[Part] = []
    for p in sorted(parts, key=lambda p: (p.k.start, p.q.start)):
        last = out[-1] if out else None
        if last and last.full and p.full and last.k == p.k and last.q.stop == p.q.start:
            out[-1] = Part(slice(last.q.start, p.q.stop), p.k)
        else:
            out.append(p)
    joined: list[Part] = []
    for p in sorted(out, key=lambda p: (p.q.start, p.k.start)):
        last = joined[-1] if joined else None
        if last and last.full and p.full and last.q == p.q and last.k.stop == p.k.start:
            joined[-1] = Part(p.q, slice(last.k.start, p.k.stop))
        else:
            joined.append(p)
    return joined


@functools.lru_cache(maxsize=256)
def needed_steps(spec: MaskSpec, ring_degree: int, pieces: tuple[Runs, ...]) -> int:
    """How many ring steps the ranks need: one more than the furthest step at which any rank has a part.

    Args:
        spec: the mask.
        ring_degree: R.
        pieces: every ring rank's runs.

    Returns:
        A number from 1 to R; every rank computes the same.
    """
    rows = set(spec.rows(max(len(spec.docs or ()), len(spec.spans or ()), len(spec.keys or ()), 1)))
    last = 0
    for r in range(ring_degree):
        for t in range(ring_degree - 1, last, -1):
            if any(block_parts(spec, row, pieces[r], pieces[(r - t) % ring_degree]) for row in rows):
                last = t
                break
    return last + 1
