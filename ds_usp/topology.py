"""Process topology of USP: the Ulysses, ring, sequence-parallel and data-parallel groups.

Rank layout (``N = U * R`` sequence-parallel ranks, ``dp = world / N`` replicas)::

    rank = dp_index * N + ring_index * U + ulysses_index

* a Ulysses group is ``U`` contiguous ranks (one node when ``U`` divides the ranks per node),
* a ring group is ``R`` ranks with stride ``U`` (it crosses nodes),
* a sequence-parallel (SP) group is ``N`` contiguous ranks: one Ulysses x ring block,
* a data-parallel (DP) group holds the ranks at the same SP position in every replica,
* the sequence x data-parallel group (where ZeRO shards and reduces) is every rank.

:func:`group_ranks` is the pure part (rank lists only) and :meth:`USPTopology.build` turns the
rank lists into process groups: groups of different kinds over the same ranks are one process group (one
communicator: with one replica the SP and the sequence x data-parallel groups are the same ranks), the kinds over every
rank take the default group itself (:func:`shared_default_group`; never destroyed with a topology:
:meth:`USPTopology.own_groups`), and each group is warmed up as it is built (:func:`ds_usp.comm.warm_up`: one
all-reduce, and for a ring one exchange with every ring rank its forward and backward send to), so that ranks that
cannot reach each other fail there, with the group named. Each group carries a ``group_desc`` (:func:`group_descs`:
``ds_usp_ring_1``, ...) and is described to the collectives' watchdog (:func:`ds_usp.watchdog.name_group`: its kinds,
ranks and timeout, for the errors of its collectives); its creation is watched too (:func:`_new_group`: with a GPU
bound to the default group, NCCL sets up the communicator inside ``dist.new_group``). Groups travel as the frozen
:class:`USPTopology` value; no group is kept in module globals (but the one-rank group each rank shares,
:func:`_solo_group`).
"""
from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from ds_usp.comm import warm_up, watched_call
from ds_usp.config import ranks_per_node_and_source
from ds_usp.log import log_rank0, log_warning, say_once
from ds_usp.upstream.c10d import group_timeout
from ds_usp.watchdog import GroupInfo, name_group

Ranks = tuple[int, ...]
KINDS = ("ulysses", "ring", "sp", "dp", "sp_dp")  # the group kinds, in the order every rank builds them


_SOLO: dict[int, Any] = {}  # rank -> its one-rank group (see _solo_group)


def _solo_group(me: int, **kwargs: Any) -> Any:
    """This rank's group of itself alone (its model-parallel group: the model is replicated, not split), built once per
    rank and reused while it is registered, whatever the timeout of the topology asking (a one-rank group's
    collectives never wait on another rank).

    Only this rank takes part in creating it (``use_local_synchronization``), and torch names such a group by hashing
    its ranks with the number of groups alive: once any group has been destroyed, a second one for the same rank can
    get the name of one still alive and ``new_group`` refuses it ("The specified group name has already been
    created"). So every topology of this rank (a new SP size, a re-initialized engine, another timeout) shares the
    first one's."""
    from torch.distributed import distributed_c10d

    group = _SOLO.get(me)
    if group is None or group not in distributed_c10d._world.pg_map:
        group = _SOLO[me] = _new_group((me,), ("model_parallel",), f"ds_usp_model_parallel_{me}", me,
                                       use_local_synchronization=True, **kwargs)
    return group


def _new_group(members: Ranks, kinds: Sequence[str], desc: str, me: int, **kwargs: Any) -> Any:
    """``dist.new_group(members, group_desc=desc, **kwargs)``, watched by the collectives' watchdog while it runs
    (:func:`ds_usp.watchdog.issuing`, when ``kwargs`` has a timeout): with a GPU bound to the default group NCCL sets up
    the new communicator in it (a split of the default group's, which every rank takes part in), and gloo connects the
    group's ranks in it, so a rank that never comes hangs it. A call that has not returned within the timeout is named
    in this rank's log (its kinds, ranks and ``group_desc``, "while being created"), as a collective would be; one
    that fails, or returns past the timeout, raises that name.

    Args:
        members: the group's global ranks, sorted.
        kinds: the kinds it serves.
        desc: its ``group_desc``.
        me: this rank.
        **kwargs: ``dist.new_group``'s other arguments (``timeout``, ``use_local_synchronization``).

    Returns:
        The process group (``dist.new_group``'s value).

    Raises:
        USPCommError: the creation failed, or took longer than the timeout.
    """
    timeout = kwargs.get("timeout")
    info = GroupInfo(tuple(kinds), tuple(members), desc, None if timeout is None else timeout.total_seconds(),
                     wait_blocks=False)  # a creation is watched whatever the backend
    return watched_call("creation of the process group", info, "while being created (dist.new_group)", me,
                        lambda: dist.new_group(list(members), group_desc=desc, **kwargs))


@dataclass(frozen=True)
class GroupRanks:
    """Every group of every kind, as tuples of global ranks (a pure function of the degrees).

    Attributes:
        ulysses_degree: ranks per Ulysses group (U).
        ring_degree: ranks per ring (R).
        world_size: all ranks.
        ulysses: the ``world / U`` Ulysses groups.
        ring: the ``world / R`` rings.
        sp: the ``dp`` sequence-parallel groups.
        dp: the ``U * R`` data-parallel groups.
        sp_dp: the one sequence x data-parallel group.
    """

    ulysses_degree: int
    ring_degree: int
    world_size: int
    ulysses: tuple[Ranks, ...]
    ring: tuple[Ranks, ...]
    sp: tuple[Ranks, ...]
    dp: tuple[Ranks, ...]
    sp_dp: tuple[Ranks, ...]

    @property
    def sp_size(self) -> int:
        """Ranks that share one sequence (U x R)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def dp_size(self) -> int:
        """Number of model replicas that see different data."""
        return self.world_size // self.sp_size

    def member_of(self, kind: str, rank: int) -> Ranks:
        """Return the group of ``kind`` (``"ulysses"``, ``"ring"``, ``"sp"``, ``"dp"``, ``"sp_dp"``) holding ``rank``.

        Args:
            kind: the group kind.
            rank: a global rank.

        Returns:
            The ranks of that group, in group-rank order.

        Raises:
            ValueError: unknown kind or rank outside the world.
        """
        if kind not in ("ulysses", "ring", "sp", "dp", "sp_dp"):
            raise ValueError(f"unknown group kind {kind!r}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        return next(g for g in getattr(self, kind) if rank in g)


def validate_degrees(ulysses_degree: int, ring_degree: int, world_size: int) -> None:
    """Check that ``ulysses_degree x ring_degree`` divides ``world_size``.

    Args:
        ulysses_degree: ranks per Ulysses group.
        ring_degree: ranks per ring.
        world_size: all ranks.

    Raises:
        ValueError: a degree is not a positive integer, or their product does not divide the world.
    """
    for name, val in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree), ("world_size", world_size)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} ({val!r}) must be a positive integer")
    sp = ulysses_degree * ring_degree
    if world_size % sp != 0:
        raise ValueError(f"ulysses_degree ({ulysses_degree}) x ring_degree ({ring_degree}) = {sp} must divide "
                         f"the world size ({world_size})")


def group_ranks(ulysses_degree: int, ring_degree: int, world_size: int) -> GroupRanks:
    """Compute every group's ranks for a USP layout (no communication).

    Args:
        ulysses_degree: ranks per Ulysses group (U).
        ring_degree: ranks per ring (R).
        world_size: all ranks; must be a multiple of ``U * R``.

    Returns:
        The :class:`GroupRanks`.

    Raises:
        ValueError: see :func:`validate_degrees`.
    """
    validate_degrees(ulysses_degree, ring_degree, world_size)
    u, r = ulysses_degree, ring_degree
    sp = u * r
    dp = world_size // sp

    def rank(d: int, ri: int, ui: int) -> int:
        return d * sp + ri * u + ui

    return GroupRanks(
        ulysses_degree=u,
        ring_degree=r,
        world_size=world_size,
        ulysses=tuple(tuple(rank(d, ri, ui) for ui in range(u)) for d in range(dp) for ri in range(r)),
        ring=tuple(tuple(rank(d, ri, ui) for ri in range(r)) for d in range(dp) for ui in range(u)),
        sp=tuple(tuple(range(d * sp, (d + 1) * sp)) for d in range(dp)),
        dp=tuple(tuple(rank(d, ri, ui) for d in range(dp)) for ri in range(r) for ui in range(u)),
        sp_dp=(tuple(range(world_size)),),
    )


def ulysses_across_nodes(ranks: GroupRanks) -> Optional[str]:
    """Why a layout's Ulysses groups cross nodes (each layer's all-to-all then goes over the network), from the
    launcher's ranks per node (:func:`ds_usp.config.ranks_per_node_and_source`), or None when they stay inside nodes.

    Args:
        ranks: the layout.

    Returns:
        A message naming ``usp.ulysses_degree``, the ranks per node and the variable that said so; None when every
        Ulysses group is inside one node.
    """
    per_node, said_by = ranks_per_node_and_source(ranks.world_size)
    crossing = [g for g in ranks.ulysses if len({r // per_node for r in g}) > 1]
    if not crossing:
        return None
    return (f"usp.ulysses_degree={ranks.ulysses_degree} (given or chosen) puts Ulysses groups across nodes "
            f"({per_node} ranks per node from {said_by}; ranks {list(crossing[0])} are one group): every layer's "
            f"all-to-all then goes over the network. Give usp.ulysses_degree a divisor of {per_node} and the rest to "
            f"usp.ring_degree, or leave both out (ds-usp keeps Ulysses inside a node)")


def group_descs(ranks: GroupRanks, kinds: Sequence[str] = KINDS) -> dict[Ranks, str]:
    """The ``group_desc`` of each distinct group (sorted ranks): ``ds_usp_`` and every kind it serves with the group's
    index among that kind's, in :data:`KINDS` order, e.g. ``ds_usp_ring_1`` or ``ds_usp_ulysses_0+sp_0+sp_dp_0`` (kinds
    over the same ranks are one process group). torch shows it in NCCL's logs and flight-recorder dumps; the group over
    every rank is the default group (:func:`shared_default_group`), whose own ``group_desc`` (``default_pg``) torch
    shows instead, and which the watchdog's errors still name by this one.

    Args:
        ranks: the layout.
        kinds: the kinds to name (default: all).

    Returns:
        ``{sorted ranks: description}``.
    """
    return {key: "ds_usp_" + "+".join(f"{kind}_{index}" for kind, index in served)
            for key, served in _served(ranks, kinds).items()}


def _served(ranks: GroupRanks, kinds: Sequence[str]) -> dict[Ranks, list[tuple[str, int]]]:
    """Each distinct group (sorted ranks) and the ``(kind, index among that kind's groups)`` it serves, in ``kinds``
    order."""
    served: dict[Ranks, list[tuple[str, int]]] = {}
    for kind in kinds:
        for index, members in enumerate(getattr(ranks, kind)):
            served.setdefault(tuple(sorted(members)), []).append((kind, index))
    return served


def shared_default_group(timeout: Optional[datetime.timedelta]) -> Any:
    """The default process group, as the group of every kind whose ranks are the whole world (with one replica the
    SP and the sequence x data-parallel groups, with U = 1 or R = 1 the ring or Ulysses one too; the data-parallel one
    when SP is 1): one communicator, not a second one beside ``dist.group.WORLD`` (NCCL keeps buffers for each).
    None when its timeout is not ``timeout``: a group's timeout is fixed at creation, so those kinds then get a group
    of their own with ``usp.timeout_seconds`` (said once, on rank 0, with how to share it).

    The default group is never destroyed by ds-usp: :meth:`USPTopology.own_groups` leaves it out.

    Args:
        timeout: the timeout the topology's groups are to have (None: any, the caller asked for none).

    Returns:
        ``dist.group.WORLD``, or None.
    """
    world = dist.group.WORLD
    if timeout is None:
        return world
    own = group_timeout(world)
    if own == timeout:
        return world
    said = "unknown" if own is None else f"{own.total_seconds():g} s"
    seconds = f"{timeout.total_seconds():g}"
    say_once(("the default group's timeout", own, timeout),
             f"ds_usp: the default process group's timeout ({said}) is not usp.timeout_seconds ({seconds} s), so the "
             f"USP groups over every rank are a communicator of their own beside it; start distributed with "
             f"init_process_group(timeout=datetime.timedelta(seconds={seconds})) (or let ds_usp.initialize start it) "
             f"to share one", log_rank0)
    return None


def _name_groups(ranks: GroupRanks, me: int, mine: dict[str, Any], descs: dict[Ranks, str],
                 timeout: Optional[datetime.timedelta]) -> None:
    """Tell the watchdog (:func:`ds_usp.watchdog.name_group`) what each of this rank's groups is: its kinds, ranks,
    description and timeout (the default group's own, which is its collectives'), and whether its backend's wait
    blocks (gloo)."""
    world = dist.group.WORLD
    for group in {id(g): g for g in mine.values()}.values():
        kinds = [kind for kind in KINDS if mine.get(kind) is group]
        members = tuple(sorted(ranks.member_of(kinds[0], me)))
        limit = (group_timeout(group) or timeout) if group is world else timeout
        name_group(group, kinds, members, descs[members], None if limit is None else limit.total_seconds(),
                   wait_blocks=dist.get_backend(group) == "gloo")


def _build_groups(ranks: GroupRanks, me: int, given: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """This rank's group of each kind, created in one fixed order on every rank; kinds over the same ranks share one
    process group (named by :func:`group_descs`, told to the watchdog), kinds over every rank take the default group
    (:func:`shared_default_group`), and each group of more than one rank is warmed up (:func:`ds_usp.comm.warm_up`)
    once. The kinds in ``given`` take the group given (a parent topology's, already named and warmed): none is built,
    named or warmed for them."""
    made: dict[Ranks, Any] = {}
    mine: dict[str, Any] = dict(given)
    built = [kind for kind in KINDS if kind not in given]
    descs = group_descs(ranks, built)
    served = _served(ranks, built)  # each group's kinds, for the watchdog's name of its creation
    everyone = tuple(range(ranks.world_size))
    for kind in built:
        for members in getattr(ranks, kind):
            key = tuple(sorted(members))
            if key not in made:
                world = shared_default_group(kwargs.get("timeout")) if key == everyone else None
                made[key] = world if world is not None else _new_group(key, [kind for kind, _ in served[key]],
                                                                       descs[key], me, **kwargs)
            if me in members:
                mine[kind] = made[key]
    _name_groups(ranks, me, {kind: mine[kind] for kind in built}, descs, kwargs.get("timeout"))
    warmed: set[int] = set()  # the ring comes before every kind it can share a group with (sp when U = 1)
    for kind in built:
        group, members = mine[kind], ranks.member_of(kind, me)
        if len(members) > 1 and id(group) not in warmed:
            warmed.add(id(group))
            warm_up(group, f"{kind} group", ring=(members, members.index(me)) if kind == "ring" else None)
    return mine


def _of_ranks(name: str, doc: str) -> property:
    """A property of :class:`USPTopology`: ``self.ranks.<name>`` (an ``int`` of :class:`GroupRanks`)."""

    def get(self: "USPTopology") -> int:
        return getattr(self.ranks, name)

    return property(get, doc=doc)


def _my_group(kind: str, doc: str) -> property:
    """A property of :class:`USPTopology`: the global ranks of this rank's group of ``kind``."""

    def get(self: "USPTopology") -> Ranks:
        return self.ranks.member_of(kind, self.rank)

    return property(get, doc=doc)


@dataclass(frozen=True)
class USPTopology:
    """This rank's USP groups. Build it with :meth:`USPTopology.build` after ``deepspeed.init_distributed()``.

    Attributes:
        ranks: the rank lists of every group.
        rank: this process's global rank.
        ulysses_group, ring_group, sp_group, dp_group, sp_dp_group: this rank's process groups.
        model_parallel_group: a group of this rank alone (the model is replicated, not split),
            handed to DeepSpeed through :attr:`mpu`.
        default_positions: how the model numbers the tokens of a full sequence ``(b, S)`` when it is given no
            ``position_ids`` (``ds_usp.initialize`` sets it from the model, see
            :func:`ds_usp.integration.models.checks.default_positions`; ``None``: ``0..S-1``).
            :func:`ds_usp.shard_batch` uses it, so a model numbering from ``padding_idx + 1`` (RoBERTa) gets its own
            positions.
        parent_sp_group: for a dynamic-SP degree (:meth:`with_degrees`), the SP group of the topology it was cut from:
            a micro batch's loss is averaged over that whole group's tokens, whichever sub-group holds which row
            (``None``: this topology's own SP group).
        degrees: the topologies of smaller sequence-parallel degrees cut from this one, by degree (dynamic SP, empty
            unless ``usp.dynamic_sp``); every one is built on every rank at ``ds_usp.initialize``.
    """

    ranks: GroupRanks
    rank: int
    ulysses_group: Any = field(repr=False)
    ring_group: Any = field(repr=False)
    sp_group: Any = field(repr=False)
    dp_group: Any = field(repr=False)
    sp_dp_group: Any = field(repr=False)
    model_parallel_group: Any = field(repr=False)
    default_positions: Optional[Callable[[Any], Any]] = field(default=None, repr=False, compare=False)
    parent_sp_group: Any = field(default=None, repr=False, compare=False)
    degrees: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, ulysses_degree: int, ring_degree: int, *,
              timeout: Optional[datetime.timedelta] = None) -> "USPTopology":
        """Create the process groups of a ``ulysses_degree x ring_degree`` layout.

        Every rank must call this with the same degrees (groups are created collectively, in one
        fixed order). Degrees are validated before any group is created.

        Args:
            ulysses_degree: ranks per Ulysses (all-to-all) group.
            ring_degree: ranks per K/V ring.
            timeout: timeout of every collective on these groups (``None``: the default of
                ``torch.distributed``). The kinds over every rank take the default group where its timeout is this
                one (or none is given), else a group of their own.

        Returns:
            This rank's :class:`USPTopology`.

        Raises:
            RuntimeError: ``torch.distributed`` is not initialized.
            ValueError: the degrees do not fit the world size.
        """
        return _built(cls, ulysses_degree, ring_degree, timeout, {})

    # ---- sizes and this rank's coordinates (all derived from the rank lists) ----
    ulysses_degree = _of_ranks("ulysses_degree", "Ranks per Ulysses group (U).")
    ring_degree = _of_ranks("ring_degree", "Ranks per ring (R).")
    sp_size = _of_ranks("sp_size", "Sequence-parallel size N = U x R.")
    dp_size = _of_ranks("dp_size", "Data-parallel size.")
    ulysses_ranks = _my_group("ulysses", "Global ranks of this rank's Ulysses group.")
    ring_ranks = _my_group("ring", "Global ranks of this rank's ring, in ring order.")
    sp_ranks = _my_group("sp", "Global ranks of this rank's sequence-parallel group.")
    dp_ranks = _my_group("dp", "Global ranks of this rank's data-parallel group.")

    @property
    def ulysses_rank(self) -> int:
        """Position in the Ulysses group."""
        return self.rank % self.ulysses_degree

    @property
    def ring_rank(self) -> int:
        """Position in the ring."""
        return (self.rank % self.sp_size) // self.ulysses_degree

    @property
    def sp_rank(self) -> int:
        """Position in the sequence-parallel group (``ring_rank * U + ulysses_rank``)."""
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        """Index of this rank's model replica."""
        return self.rank // self.sp_size

    @property
    def group_names(self) -> tuple[str, str, str]:
        """The names of the Ulysses, ring and SP groups, which the attention's custom ops take (see
        :func:`ds_usp.comm.resolve_group`)."""
        return self.ulysses_group.group_name, self.ring_group.group_name, self.sp_group.group_name

    @property
    def loss_group(self) -> Any:
        """The group whose tokens one micro batch's loss averages over: the SP group, or a degree's parent's."""
        return self.sp_group if self.parent_sp_group is None else self.parent_sp_group

    @property
    def loss_group_size(self) -> int:
        """Ranks of :attr:`loss_group`."""
        return self.sp_size if self.parent_sp_group is None else dist.get_world_size(self.parent_sp_group)

    def with_degrees(self, degrees: dict[int, tuple[int, int]], *,
                     timeout: Optional[datetime.timedelta] = None) -> "USPTopology":
        """This topology with the sub-topologies of smaller sequence-parallel degrees (dynamic SP).

        A degree ``d`` (dividing the SP size) cuts every SP group into ``sp / d`` groups of ``d`` consecutive ranks,
        each with its own ``(U_d, R_d)`` Ulysses and ring groups: rows that need fewer ranks run on a sub-group while
        the other sub-groups run their own rows. Collective: every rank calls it with the same degrees.

        Args:
            degrees: ``{d: (U_d, R_d)}`` with ``U_d * R_d == d``, ``d`` a proper divisor of the SP size.
            timeout: timeout of every collective on the new groups.

        Returns:
            A copy whose :attr:`degrees` holds every sub-topology (and this one under its own size).

        Raises:
            ValueError: a degree that does not divide the SP size or whose split does not multiply to it.
        """
        for d, (u, r) in sorted(degrees.items()):
            if d >= self.sp_size or self.sp_size % d or u * r != d:
                raise ValueError(f"dynamic SP degree {d} with split {u}x{r}: a degree must be a proper divisor of "
                                 f"the SP size {self.sp_size} and U x R must equal it")
        # a degree's own Ulysses, ring and SP groups; every group over the whole world or the replicas stays this
        # topology's (ranks at different degrees meet in them: one group object, or they would wait on each other),
        # given to the degree's build: none is built for them (a degree's own would be a communicator never used),
        # and the watchdog's names of this topology's groups stay (the default group's kinds are this topology's)
        shared = {"dp": self.dp_group, "sp_dp": self.sp_dp_group}
        subs = {d: replace(_built(USPTopology, u, r, timeout, shared), parent_sp_group=self.sp_group,
                           model_parallel_group=self.model_parallel_group, default_positions=self.default_positions)
                for d, (u, r) in sorted(degrees.items())}
        topo = replace(self, degrees={})
        topo.degrees.update(subs)
        topo.degrees[self.sp_size] = topo
        return topo

    def own_groups(self) -> list[Any]:
        """The process groups this topology (and its degrees) made, each once: what may be destroyed when it is torn
        down. Never the default group (the kinds over every rank use it: destroying it ends torch.distributed) nor
        the one-rank model-parallel group (shared by every topology of this rank); a degree's data-parallel and
        sequence x data-parallel groups are this topology's.

        Returns:
            The groups, in :data:`KINDS` order.
        """
        keep = {id(dist.group.WORLD), id(self.model_parallel_group)}
        found: dict[int, Any] = {}
        for topo in [self, *(t for t in self.degrees.values() if t is not self)]:
            for kind in KINDS:
                group = getattr(topo, f"{kind}_group")
                if id(group) not in keep:
                    found.setdefault(id(group), group)
        return list(found.values())

    @property
    def mpu(self) -> "USPMpu":
        """The duck-typed model-parallel unit to pass as ``deepspeed.initialize(mpu=...)``."""
        return USPMpu(self)

    def describe(self) -> str:
        """One line that says where this rank sits, for logs."""
        return (f"rank {self.rank}: U={self.ulysses_degree} R={self.ring_degree} dp={self.dp_size} | "
                f"ulysses {list(self.ulysses_ranks)} ring {list(self.ring_ranks)} sp {list(self.sp_ranks)} "
                f"dp {list(self.dp_ranks)}")


def _built(cls: type, ulysses_degree: int, ring_degree: int, timeout: Optional[datetime.timedelta],
           given: dict[str, Any]) -> USPTopology:
    """:meth:`USPTopology.build`, the kinds in ``given`` taking the groups given (see :func:`_build_groups`)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("USPTopology.build needs an initialized process group: call "
                           "deepspeed.init_distributed() (or torch.distributed.init_process_group) first")
    ranks = group_ranks(ulysses_degree, ring_degree, dist.get_world_size())
    me = dist.get_rank()
    kwargs = {} if timeout is None else {"timeout": timeout}
    crossing = ulysses_across_nodes(ranks)
    if crossing and me == 0:
        log_warning(crossing)
    groups = _build_groups(ranks, me, given, **kwargs)
    solo = _solo_group(me, **kwargs)
    return cls(ranks=ranks, rank=me, ulysses_group=groups["ulysses"], ring_group=groups["ring"],
               sp_group=groups["sp"], dp_group=groups["dp"], sp_dp_group=groups["sp_dp"],
               model_parallel_group=solo)


class USPMpu:
    """What DeepSpeed asks of ``mpu`` (see ``deepspeed/utils/groups.py``), answered from a :class:`USPTopology`.

    * data parallel = replicas only (the batch size and the data sampler count these),
    * sequence data parallel = every rank (ZeRO partitions and reduces gradients here),
    * sequence parallel = the U x R ranks of one sequence,
    * model parallel = this rank alone: USP replicates the model, it does not split it.

    It deliberately has no ``initialize_sequence_parallel`` attribute: DeepSpeed takes that as the
    sign of its own Ulysses ``mpu`` and then ignores the data-parallel group.
    """

    def __init__(self, topo: USPTopology) -> None:
        self.topo = topo

    def _answer(self, get: Callable[[USPTopology], Any]) -> Any:
        """DeepSpeed's question, answered with ``get(topology)``."""
        return get(self.topo)

    # each of DeepSpeed's questions and its answer
    get_data_parallel_group = functools.partialmethod(_answer, lambda t: t.dp_group)  # the replicas
    get_data_parallel_world_size = functools.partialmethod(_answer, lambda t: t.dp_size)
    get_data_parallel_rank = functools.partialmethod(_answer, lambda t: t.dp_rank)  # this replica
    get_data_parallel_group_ranks = functools.partialmethod(_answer, lambda t: list(t.dp_ranks))
    get_sequence_parallel_group = functools.partialmethod(_answer, lambda t: t.sp_group)  # one sequence's ranks
    get_sequence_parallel_world_size = functools.partialmethod(_answer, lambda t: t.sp_size)  # U x R
    get_sequence_parallel_rank = functools.partialmethod(_answer, lambda t: t.sp_rank)
    # every rank: where ZeRO shards its state and reduces gradients
    get_sequence_data_parallel_group = functools.partialmethod(_answer, lambda t: t.sp_dp_group)
    get_sequence_data_parallel_world_size = functools.partialmethod(_answer, lambda t: t.sp_size * t.dp_size)
    get_sequence_data_parallel_rank = functools.partialmethod(_answer, lambda t: t.rank)
    # this rank alone: the model is not split
    get_model_parallel_group = functools.partialmethod(_answer, lambda t: t.model_parallel_group)
    get_model_parallel_world_size = functools.partialmethod(_answer, lambda t: 1)
    get_model_parallel_rank = functools.partialmethod(_answer, lambda t: 0)
    # DeepSpeed's ZeRO-1/2 universal-checkpoint loader asks for the tensor-parallel names directly (the same answers)
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
