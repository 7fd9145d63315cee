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
from ds_usp.attention.checks import VALID_KEYS, agree_value, check_keys, mark_value_agreed
from ds_usp.attention.usp import spans_tensor
from ds_usp.sharding import gather_sequence
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

    The model's key mask reaches the host once per forward, in the model's own forward before its first block
    (:meth:`expect_mask`: the plan names the parameter the blocks' masks are made from), as ``(start, end)`` runs of
    kept tokens from which every attention's valid keys are worked out in Python (:meth:`keys`). The runs are then
    agreed across the SP group, in the model's forward too (:meth:`agree_mask`), and as soon as the streams of an
    attention's order are known outside the blocks (cut in the model's forward or out of its RoPE module, or the
    mask's stream, whose length is the parameter's), its valid keys are worked out, marked agreed and made into the
    attention's tensor (:meth:`_prepare`), so the attention's entry finds both (no all-gather, no tensor made in a
    block). Inside the blocks nothing is read: each block's mask is compared with that parameter on the device, once
    per mask object (a block given the object a block before it was given, or recomputed with it, gets its part back
    from a cache), and so is the mask each attention is given; the comparisons are read together at the forward's end
    (:meth:`finish`).

    Args:
        topo: the topology the forward runs on.
        model_name: the model's class (named in errors).
        orders: the stream orders of the model's attention modules (:attr:`DiTContext.orders`), whose valid keys are
            prepared before the blocks.
    """

    def __init__(self, topo: USPTopology, model_name: str, orders: tuple[tuple[str, ...], ...] = ()) -> None:
        self.topo, self.model_name, self.orders = topo, model_name, orders
        self.streams: dict[str, Stream] = {}
        # stream -> per row, the (start, end) runs of its tokens the model's mask keeps (host; absent, or no block
        # given a mask over the stream yet: every token)
        self.runs: dict[str, tuple[tuple[tuple[int, int], ...], ...]] = {}
        self.gathered = False
        self.closed = False  # the forward returned: what its recomputations check again is not read
        self.memory: Any = None  # the memory features of this forward (ds_usp.integration.step.dit)
        self._keys: dict[tuple, Optional[tuple]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}  # stream -> the shape of the mask its runs were read from
        self._root: Optional[tuple[Any, Tensor]] = None  # (the plan's RootMask, the parameter), read this forward
        self.runs_agreed = False  # the runs were read from the parameter and agreed across the SP group (agree_mask)
        self._prepared: set[tuple] = set()  # (order, batch) whose valid keys were prepared (_prepare)
        self._reference: dict[str, Tensor] = {}  # stream -> (b, length) bool on the device: the first block's mask
        self._local: dict[str, Tensor] = {}  # stream -> (b, chunk) bool on the device: the rank's part of it
        self._local_masks: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._cuts: dict[tuple, tuple[Tensor, int, Tensor]] = {}  # (id, order) -> (mask, its version, its part)
        self._handed: dict[int, tuple[Tensor, int, tuple[str, ...]]] = {}  # id -> (a part handed on, version, order)
        self._pending: list[tuple[Tensor, str]] = []  # (a check's result on the device, the error if it failed)

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
            known = self._new_stream(name, length)
            self.streams[name] = known
            self._prepare()  # an order whose streams are now all known
        elif known.length != length:
            raise ValueError(f"{self.model_name}: a tensor of its {name} stream has {length} tokens, another "
                             f"{known.length}: ds-usp's plan for the family no longer fits it (docs/models.md)")
        return known

    def _new_stream(self, name: str, length: int) -> Stream:
        return Stream(name, length, -(-length // self.topo.sp_size), self.topo.sp_rank)

    def cut(self, x: Any, name: str, dim: int, pad: Any = 0) -> Any:
        """This rank's part of ``x`` (a tensor, or a tuple / list of them) along ``dim``, stream ``name``: its tokens
        ``[start, start + chunk)``, padded with ``pad`` past the stream's end (:func:`ds_usp.shard_sequence`'s
        ``"contiguous"`` shard, made without an index tensor: a slice, no copy from the host).

        Args:
            x: the whole tensor(s), the same on every rank of the group.
            name: the stream.
            dim: the token dimension.
            pad: the padding's value.

        Returns:
            ``x`` with ``chunk`` tokens along ``dim``, in new storage; differentiable (its backward fills the other
            ranks' tokens with zeros).
        """
        if isinstance(x, (tuple, list)):
            return type(x)(self.cut(t, name, dim, pad) for t in x)
        stream = self.stream(name, x.shape[dim])
        take = max(0, min(stream.chunk, stream.length - stream.start))
        part = x.narrow(dim, min(stream.start, stream.length), take)
        if take == stream.chunk:
            return part.clone(memory_format=torch.contiguous_format)
        shape = list(x.shape)
        shape[dim] = stream.chunk - take
        return torch.cat([part, x.new_full(shape, pad)], dim=dim)

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

    # ---- the key mask ---------------------------------------------------------------------------------------------
    def expect_mask(self, root: Any, value: Tensor) -> None:
        """The model's mask parameter that its blocks' key masks are made from (the plan's
        :class:`~ds_usp.integration.models.diffusion.plans.RootMask`), given to the model's forward: read to the host
        here, before the first block (the forward's one read of the mask), as runs of kept tokens.

        Args:
            root: the plan's ``RootMask``.
            value: ``(b, tokens)``; another form is left to the blocks (each mask read where first given).
        """
        if value.dim() != 2:
            return
        host = value.detach().to("cpu")  # the one copy of the mask to the host in this forward
        if root.form == "prefix":
            runs = tuple(((0, c),) if c > 0 else () for c in host.sum(dim=1, dtype=torch.int).tolist())
        else:
            runs = tuple(_runs(row) for row in host != 0)
        self.runs[root.stream] = runs
        self._shapes[root.stream] = tuple(value.shape)
        self._root = (root, value)

    def agree_mask(self, advice: str) -> None:
        """Check that every rank of the SP group read the same runs of the mask parameter (:meth:`expect_mask`; one
        small all-gather of its shape and their hash, in the model's forward, unless these runs were agreed before; a
        group of one: nothing), then prepare the valid keys of the orders whose streams are known (:meth:`_prepare`).
        Nothing without a parameter read this forward.

        Args:
            advice: what to do when they differ (the error's end).

        Raises:
            ValueError: the same message on every rank of the group, naming the values that differ per rank.
        """
        if self._root is None:
            return
        root, _ = self._root
        batch, tokens = self._shapes[root.stream]
        agree_value((self._shapes[root.stream], self.runs[root.stream]), self.topo.sp_group, root.parameter,
                    (("batch", batch), (f"{root.parameter} tokens", tokens)), self.model_name, advice)
        self.runs_agreed = True
        self._prepare()

    def _prepare(self) -> None:
        """Work out the valid keys of each of :attr:`orders` whose streams are known (the mask's stream: its length is
        the parameter's), as the blocks' masks made of the parameter give them, mark them agreed across the SP group
        and make their tensor (:func:`ds_usp.attention.usp.spans_tensor`, a cache by value), once per order: the
        attention's entry then neither gathers them across the ranks nor makes a tensor of them inside a block. Only
        once the runs were agreed (:meth:`agree_mask`); keys that will not be the attention's (a parameter whose
        length is not its stream's, or blocks given no mask) are left to the attention, which works them out at the
        block as before."""
        if not self.runs_agreed or not self.orders:
            return
        root, _ = self._root
        batch, tokens = self._shapes[root.stream]
        for order in self.orders:
            if (order, batch) in self._prepared:
                continue
            streams = [self.streams.get(name) or (self._new_stream(name, tokens) if name == root.stream else None)
                       for name in order]
            if None in streams:
                continue  # a stream cut only in a block: its keys are worked out at the attention (keys)
            self._prepared.add((order, batch))
            if root.stream in order and streams[order.index(root.stream)].length != tokens:
                continue  # the attention refuses the mask's shape (_kept_runs)
            kept = [self.runs[s.name] if s.name == root.stream else ((((0, s.length),),) * batch) for s in streams]
            keys = _global_keys(streams, kept, batch, self.topo.sp_size)
            try:
                keys = check_keys(keys, batch, sum(s.chunk for s in streams) * self.topo.sp_size)
            except ValueError:
                continue  # a row without any valid key: the attention raises it, at the block as before
            if keys is not None:
                self._agreed(keys)
                spans_tensor(keys)

    def _agreed(self, keys: tuple) -> None:
        """Mark valid keys agreed across the SP group when the runs they are worked out of were agreed. Keys are a
        deterministic function of the streams' runs and lengths: the runs were agreed (:meth:`agree_mask`; a stream
        without runs keeps every token), and the lengths are the shapes of the whole inputs every rank gives, checked
        equal across the group at the first call (``DiTForward``) and carried, as the local and global lengths, in
        the attention's per-call signature; so agreed runs imply agreed keys, and the attention leaves them out of
        its per-call check (:func:`ds_usp.attention.checks.value_agreed`)."""
        if self.runs_agreed:
            mark_value_agreed(keys, self.topo.sp_group, VALID_KEYS)

    def cut_of(self, mask: Tensor, order: tuple[str, ...]) -> Optional[Tensor]:
        """The rank's part of a key mask over ``order`` already cut in this forward (the same object, unchanged
        since), or None."""
        hit = self._cuts.get((id(mask), order))
        return hit[2] if hit is not None and hit[0] is mask and hit[1] == _version(mask) else None

    def hand_on(self, mask: Tensor, order: tuple[str, ...], part: Tensor) -> Tensor:
        """Remember ``part``, the rank's part of ``mask`` over ``order``, and return it (:meth:`cut_of`,
        :meth:`handed`)."""
        self._cuts[(id(mask), order)] = (mask, _version(mask), part)
        self._handed[id(part)] = (part, _version(part), order)
        return part

    def handed(self, mask: Tensor, order: tuple[str, ...]) -> bool:
        """Whether ``mask`` is a part of a key mask over ``order`` that ds-usp handed on, unchanged since."""
        hit = self._handed.get(id(mask))
        return hit is not None and hit[0] is mask and hit[1] == _version(mask) and hit[2] == order

    def take_mask(self, name: str, kept: Tensor) -> None:
        """A block's key mask over stream ``name`` (registered): ``(b, length)`` bool on the model's device, True
        where kept. The forward's first is compared on the device with the mask parameter it is made from
        (:meth:`expect_mask`; without one it is read to the host here), and later ones with the first; the rank's part
        is kept for the attention's check (:meth:`local_mask`).

        Raises:
            ValueError: a mask of another shape than the first's or the parameter's (at once), or of other values
                (at the forward's end, :meth:`finish`).
        """
        stream = self.known(name)
        reference = self._reference.get(name)
        if reference is not None:
            if kept.shape != reference.shape:
                raise self._differ(name)
            if not self.closed:
                self.defer((kept == reference).all(), str(self._differ(name)))
            return
        self._reference[name] = kept
        self._local[name] = self.cut(kept, name, 1, pad=False)
        self._local_masks.clear()
        self._keys.clear()  # valid keys worked out before a block was given this mask
        if self._root is not None:
            root, value = self._root
            if name != root.stream:
                made = None  # a stream the parameter does not mask: every token kept
            elif root.form == "prefix":
                made = torch.arange(stream.length, device=value.device) < value.sum(dim=1, dtype=torch.int)[:, None]
            else:
                made = value != 0
            if made is not None and made.shape != kept.shape:
                raise ValueError(f"{self.model_name}: its {name} key mask has shape {tuple(kept.shape)}, expected "
                                 f"{tuple(made.shape)} (its {root.parameter})")
            if not self.closed:
                self.defer(kept.all() if made is None else (kept == made).all(),
                           f"{self.model_name}: its blocks are given a {name} key mask that is not the one ds-usp "
                           f"makes of its {root.parameter} ({'every token kept' if made is None else root.form}): "
                           f"ds-usp's plan for the family no longer fits it (docs/models.md)")
            return
        host = kept.detach().to("cpu", torch.bool)  # no parameter to read it from: read where first given
        self.runs[name] = tuple(_runs(row) for row in host)
        self._shapes[name] = tuple(host.shape)

    def _differ(self, name: str) -> ValueError:
        return ValueError(f"{self.model_name}: its blocks are given different {name} key masks in one forward, which "
                          f"ds-usp does not shard (it records one per forward)")

    # ---- checks on the device -------------------------------------------------------------------------------------
    def defer(self, ok: Tensor, error: str) -> None:
        """A check made on the device (``ok``: a bool scalar, True when it passed), read with the forward's others at
        its end (:meth:`finish`), where ``ValueError(error)`` is raised if it failed. Once the forward returned (a
        recomputation in the backward, repeating what the forward checked) it is dropped."""
        if not self.closed:
            self._pending.append((ok, error))

    def finish(self) -> None:
        """The forward ends (before its output is returned): its checks on the device are read, in one read.

        Raises:
            ValueError: the first check that failed.
        """
        self.closed = True
        pending, self._pending = self._pending, []
        if pending:
            for passed, (_, error) in zip(torch.stack([ok for ok, _ in pending]).tolist(), pending):
                if not passed:
                    raise ValueError(error)

    # ---- the attention's view -------------------------------------------------------------------------------------
    def local_length(self, order: tuple[str, ...]) -> int:
        """Tokens of one rank's local sequence over ``order``."""
        return sum(self.known(s).chunk for s in order)

    def keys(self, order: tuple[str, ...], batch: int) -> Optional[tuple]:
        """The valid keys of the attention's global sequence over ``order``, per row, as ``(start, end)`` runs (the
        form :func:`ds_usp.usp_attention` takes; None: every key is valid), worked out on the host from the streams'
        runs (no tensor)."""
        cache = (order, batch)
        if cache not in self._keys:
            kept = [self._kept_runs(name, batch) for name in order]
            keys = _global_keys([self.known(name) for name in order], kept, batch, self.topo.sp_size)
            if keys is not None:
                self._agreed(keys)  # the keys _prepare made, or ones worked out only at the block
            self._keys[cache] = keys
        return self._keys[cache]

    def local_mask(self, order: tuple[str, ...], batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(kept, real)``, each ``(b, s)`` on ``device``: which of this rank's local keys the model's masks keep
        (the parts ds-usp handed on), and which are real tokens (not padding), to check a mask the attention is given
        against; made on the device, once per forward, order and batch."""
        cache = (order, batch, device)
        if cache not in self._local_masks:
            kept, real = [], []
            for name in order:
                stream = self.known(name)
                part = self._local.get(name)
                if part is None:
                    part = torch.ones(batch, stream.chunk, dtype=torch.bool, device=device)
                elif part.shape[0] != batch:
                    raise ValueError(f"{self.model_name}: its {name} key mask has shape "
                                     f"{tuple(self._reference[name].shape)}, expected ({batch}, {stream.length})")
                kept.append(part)
                real.append(torch.arange(stream.chunk, device=device) + stream.start < stream.length)
            self._local_masks[cache] = torch.cat(kept, dim=1), torch.cat(real).expand(batch, -1)
        return self._local_masks[cache]

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

    def _kept_runs(self, name: str, batch: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per row, the runs of stream ``name``'s tokens the model's mask keeps (stream positions, maybe past its
        end: the caller clips); every token while no block was given a mask over it."""
        stream = self.known(name)
        runs = self.runs.get(name)
        if runs is None or name not in self._reference:
            return (((0, stream.length),),) * batch
        shape = self._shapes[name]
        if shape != (batch, stream.length):
            raise ValueError(f"{self.model_name}: its {name} key mask has shape {shape}, expected "
                             f"({batch}, {stream.length})")
        return runs


def _global_keys(streams: list[Stream], kept: list[tuple], batch: int, ranks: int) -> Optional[tuple]:
    """The valid keys of the attention's global sequence over ``streams`` (in order) on ``ranks`` ranks, per row, as
    ``(start, end)`` runs (None: every key is valid), from each stream's kept runs per row (stream positions, maybe
    past its end: clipped here)."""
    local, rows = sum(s.chunk for s in streams), []
    for row in range(batch):
        runs: list[tuple[int, int]] = []
        for rank in range(ranks):
            at = rank * local  # the rank's local sequence in the global one
            for stream, stream_runs in zip(streams, kept):
                lo, hi = rank * stream.chunk, min((rank + 1) * stream.chunk, stream.length)
                for a, b in stream_runs[row]:
                    a, b = max(a, lo) - lo + at, min(b, hi) - lo + at
                    if a >= b:
                        continue
                    if runs and runs[-1][1] == a:
                        runs[-1] = (runs[-1][0], b)
                    else:
                        runs.append((a, b))
                at += stream.chunk
        rows.append(tuple(runs))
    whole = ((0, ranks * local),)
    return None if all(row == whole for row in rows) else tuple(rows)


def _version(t: Tensor) -> int:
    """``t``'s version counter (-1 for an inference tensor, which keeps none)."""
    return -1 if t.is_inference() else t._version


def _runs(row: Tensor) -> tuple[tuple[int, int], ...]:
    """The ``(start, end)`` runs of True in a 1-D bool tensor on the host."""
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
        self.orders: list[tuple[str, ...]] = []  # the stream orders its attention modules attend over (attends)

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
        self._call = DiTCall(self.topo, self.model_name, tuple(self.orders))
        return self._call

    def attends(self, order: tuple[str, ...]) -> None:
        """An attention module of the model attends over ``order`` (its route, at install): each forward prepares the
        valid keys of every order before the blocks (:meth:`DiTCall.agree_mask`)."""
        if order not in self.orders:
            self.orders.append(order)

    def use(self, call: DiTCall) -> None:
        """Make ``call`` current again (a checkpointed block recomputed in the backward)."""
        self._call = call

    def checked_inputs(self) -> None:
        """The SP group's inputs were found equal (checked at the first forward)."""
        self.inputs_checked = True
