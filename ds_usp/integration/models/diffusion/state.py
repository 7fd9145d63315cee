"""What a sharded diffusion transformer knows during one forward (:class:`DiTCall`) and across its forwards
(:class:`DiTContext`): its token streams, the rank's part of each, the text's key mask, and the sequence the USP
attention sees.

A stream of ``n`` tokens is padded at its end to ``N * c`` tokens (``c = ceil(n / N)``, ``N`` the sequence-parallel
size) and SP rank ``p`` holds its tokens ``[p c, (p + 1) c)`` (:func:`ds_usp.shard_sequence`, ``"contiguous"``). An
attention module over streams ``X1, X2`` in that order sees on rank ``p`` the local sequence ``[X1_p, X2_p]``; the
USP attention's global sequence is those local sequences of ranks ``0 .. N-1`` one after the other, of length
``N (c1 + c2)``. Its valid keys are the real tokens of each stream that the model's key mask keeps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ds_usp.attention import AttentionRun
from ds_usp.sharding import gather_sequence, shard_sequence
from ds_usp.topology import USPTopology


@dataclass(frozen=True)
class Stream:
    """One token stream of a forward.

    Attributes:
        name: ``"image"`` or ``"text"``.
        length: its tokens in the whole sequence.
        chunk: tokens each rank holds (the last ranks' include padding).
        rank: this rank's place in the SP group.
    """

    name: str
    length: int
    chunk: int
    rank: int

    @property
    def start(self) -> int:
        """The stream index of this rank's first token."""
        return self.rank * self.chunk

    def prefix_count(self, count: int) -> int:
        """How many of the stream's first ``count`` tokens this rank holds (they are a prefix of its part)."""
        return max(0, min(count - self.start, self.chunk))


class DiTCall:
    """One forward of a sharded diffusion transformer (its backward and recomputations included).

    Args:
        topo: the topology the forward runs on.
        model_name: the model's class (named in errors).
    """

    def __init__(self, topo: USPTopology, model_name: str) -> None:
        self.topo, self.model_name = topo, model_name
        self.streams: dict[str, Stream] = {}
        self.masks: dict[str, Tensor] = {}  # stream -> (b, length) bool: keys the model's mask keeps
        self.gathered = False
        self.memory: Any = None  # the memory features of this forward (ds_usp.integration.step.dit)
        self._keys: dict[tuple, Optional[tuple]] = {}

    # ---- streams ------------------------------------------------------------------------------------------------
    def stream(self, name: str, length: int) -> Stream:
        """The stream ``name``, registered at its first cut with ``length`` tokens (later cuts must agree).

        Raises:
            ValueError: a tensor of the stream with another length (a plan that no longer fits the model).
        """
        known = self.streams.get(name)
        if known is None:
            if length < 1:
                raise ValueError(f"{self.model_name}: its {name} stream is empty")
            n = self.topo.sp_size
            known = Stream(name, length, -(-length // n), self.topo.sp_rank)
            self.streams[name] = known
        elif known.length != length:
            raise ValueError(f"{self.model_name}: a tensor of its {name} stream has {length} tokens, another "
                             f"{known.length}: ds-usp's plan for the family no longer fits it (docs/models.md)")
        return known

    def cut(self, x: Any, name: str, dim: int, pad: Any = 0) -> Any:
        """This rank's part of ``x`` (a tensor, or a tuple / list of them) along ``dim``, stream ``name``.

        Args:
            x: the whole tensor(s), the same on every rank of the group.
            name: the stream.
            dim: the token dimension.
            pad: the padding's value.

        Returns:
            ``x`` with ``chunk`` tokens along ``dim``; differentiable (its backward fills the other ranks' tokens
            with zeros).
        """
        if isinstance(x, (tuple, list)):
            return type(x)(self.cut(t, name, dim, pad) for t in x)
        self.stream(name, x.shape[dim])
        return shard_sequence(x, self.topo, dim=dim, layout="contiguous", pad_value=pad)

    def gather(self, x: Tensor, name: str, dim: int) -> Tensor:
        """The whole stream from every rank's part, padding dropped; the backward keeps this rank's part of the
        gradient (every rank computes the same loss from it)."""
        stream = self.streams.get(name)
        if stream is None or x.shape[dim] != stream.chunk:
            raise ValueError(f"{self.model_name}: the output to gather has {x.shape[dim]} tokens along dim {dim}, but "
                             f"this rank holds {stream.chunk if stream else 'no'} {name} tokens")
        self.gathered = True
        return gather_sequence(x, self.topo, dim=dim, layout="contiguous", seq_len=stream.length)

    def set_memory(self, features: Any) -> None:
        """The memory features this forward runs with (chosen at its first block)."""
        self.memory = features

    # ---- the attention's view -------------------------------------------------------------------------------------
    def record_mask(self, name: str, mask: Tensor) -> None:
        """The key mask the model gives its attention over stream ``name``: ``(b, length)``, True where kept.

        Raises:
            ValueError: a block given another mask than the blocks before it in this forward.
        """
        mask = mask.detach().to("cpu", torch.bool)
        known = self.masks.get(name)
        if known is not None and not torch.equal(known, mask):
            raise ValueError(f"{self.model_name}: its blocks are given different {name} key masks in one forward, "
                             f"which ds-usp does not shard (it records one per forward)")
        if known is None:
            self._keys.clear()  # valid keys worked out before this mask was known
        self.masks[name] = mask

    def local_length(self, order: tuple[str, ...]) -> int:
        """Tokens of one rank's local sequence over ``order``."""
        return sum(self.known(s).chunk for s in order)

    def keys(self, order: tuple[str, ...], batch: int) -> Optional[tuple]:
        """The valid keys of the attention's global sequence over ``order``, per row, as ``(start, end)`` runs (the
        form :func:`ds_usp.usp_attention` takes; None: every key is valid)."""
        cache = (order, batch)
        if cache not in self._keys:
            valid = self._valid(order, batch)  # (b, N, s)
            self._keys[cache] = None if bool(valid.all()) else tuple(_runs(row) for row in valid.flatten(1))
        return self._keys[cache]

    def local_mask(self, order: tuple[str, ...], batch: int) -> tuple[Tensor, Tensor]:
        """``(kept, real)``, each ``(b, s)``: which of this rank's local keys the model's masks keep, and which are
        real tokens (not padding), to check a mask the attention is given against."""
        kept = torch.cat([self._part(s, batch, self.topo.sp_rank) for s in order], dim=1)
        real = torch.cat([torch.arange(self.known(s).chunk) + self.known(s).start < self.known(s).length
                          for s in order])
        return kept, real.expand(batch, -1)

    def known(self, name: str) -> Stream:
        """The stream ``name``, which some tensor was already cut into.

        Raises:
            ValueError: none was (a plan that no longer fits the model).
        """
        stream = self.streams.get(name)
        if stream is None:
            raise ValueError(f"{self.model_name}: an attention over its {name} stream ran before any {name} tensor was "
                             f"cut: ds-usp's plan for the family no longer fits it (docs/models.md)")
        return stream

    def _part(self, name: str, batch: int, rank: int) -> Tensor:
        """``(b, chunk)``: the keys of stream ``name`` on SP rank ``rank`` that the model's mask keeps (padding: kept
        here, dropped by :meth:`_valid`)."""
        stream = self.known(name)
        mask = self.masks.get(name)
        if mask is None:
            return torch.ones(batch, stream.chunk, dtype=torch.bool)
        if mask.shape != (batch, stream.length):
            raise ValueError(f"{self.model_name}: its {name} key mask has shape {tuple(mask.shape)}, expected "
                             f"({batch}, {stream.length})")
        a = rank * stream.chunk
        part = mask[:, a:a + stream.chunk]
        return torch.cat([part, part.new_ones(batch, stream.chunk - part.shape[1])], dim=1)

    def _valid(self, order: tuple[str, ...], batch: int) -> Tensor:
        """``(b, N, s)``: the valid keys of every rank's local sequence over ``order``."""
        ranks = []
        for rank in range(self.topo.sp_size):
            parts = []
            for name in order:
                stream = self.known(name)
                real = torch.arange(stream.chunk) + rank * stream.chunk < stream.length
                parts.append(self._part(name, batch, rank) & real)
            ranks.append(torch.cat(parts, dim=1))
        return torch.stack(ranks, dim=1)


def _runs(row: Tensor) -> tuple[tuple[int, int], ...]:
    """The ``(start, end)`` runs of True in a 1-D bool tensor."""
    edges = torch.diff(torch.cat([row.new_zeros(1), row, row.new_zeros(1)]).to(torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return tuple(zip(starts, ends))


class DiTContext:
    """A sharded diffusion transformer's USP settings and its current forward.

    Args:
        topo: the topology.
        run: how the attention runs (its layout is always ``"contiguous"``: non-causal attention has no imbalance
            for zigzag to fix).
        model_name: the model's class.
    """

    def __init__(self, topo: USPTopology, run: AttentionRun, model_name: str) -> None:
        self.topo, self.run, self.model_name = topo, run, model_name
        self._call: Optional[DiTCall] = None
        self.inputs_checked = False

    @property
    def call(self) -> DiTCall:
        """The current forward.

        Raises:
            RuntimeError: a block or attention module ran outside the model's forward.
        """
        if self._call is None:
            raise RuntimeError(f"{self.model_name}: one of its blocks ran outside the model's own forward; ds-usp "
                               f"shards the token sequence in the model's forward, so call the model, not its blocks")
        return self._call

    def begin(self) -> DiTCall:
        """A forward starts: a new :class:`DiTCall` (it stays current through its backward)."""
        self._call = DiTCall(self.topo, self.model_name)
        return self._call

    def use(self, call: DiTCall) -> None:
        """Make ``call`` current again (a checkpointed block recomputed in the backward)."""
        self._call = call

    def checked_inputs(self) -> None:
        """The SP group's inputs were found equal (checked at the first forward)."""
        self.inputs_checked = True
