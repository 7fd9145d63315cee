"""The collectives of USP, one function each. Groups are always passed in (or named, for custom ops).

* :func:`all_to_all`: the Ulysses exchange of one packed buffer (packing is :mod:`ds_usp.native`).
* :func:`fp8_encode` / :func:`fp8_decode`: ``usp.comm_dtype = "fp8"``, activations on the wire as float8
  e4m3 with one fp32 scale per row of the last dim, in one ``uint8`` message.
* :func:`ring_shift`: non-blocking send to the next ring rank and receive from the previous one,
  returning a ``wait`` callable (the ring algorithm computes while it is in flight); :func:`ring_exchange`: several
  of them as one batched exchange. On a backend whose send and recv take host memory only (gloo) a ring exchange of
  CUDA tensors is staged through pinned host buffers of a pool (:func:`staging_stats`; decided once per group;
  :func:`stage_point_to_point` forces it for tests). gloo's collectives take CUDA tensors themselves.
* :func:`gather_seq`: all-gather of sequence shards, autograd-aware (backward keeps this rank's
  slice: the gathered tensor is assumed to feed the same computation on every rank). It is a
  ``torch.library`` custom op, like the attention (:mod:`ds_usp.attention.usp`): an autograd function
  that fills an ``empty_like`` buffer through a collective gets a silently zero gradient under
  ``torch.compile``; an op with a registered backward does not.
* :func:`sum_over_group`: the SP loss's sum over the group, gradient passed through (a custom op).
* :func:`all_reduce_sum_`, :func:`all_reduce_max_` (:func:`all_reduce_max_int`), :func:`all_gather_rows`,
  :func:`all_gather_objects` and :func:`barrier`: small collectives (token counts, agreed sizes, gathers over
  replicas, checkpoint commits); :func:`disagreements`: which ranks hold which value of facts that must agree
  (configs, batches, rollouts), by :func:`checksum` for tensors; :func:`warm_up`: a new group's first collective
  and, for a ring, one exchange with every ring peer its forward and backward use, at build, so that a group whose
  ranks cannot reach each other fails there, named.

These functions are not autograd-aware themselves: the attention's forward and backward are each one
custom op that calls them (:mod:`ds_usp.attention.usp`).

A collective that fails (a peer rank died, or stalled past the group's timeout) raises
:class:`USPCommError` naming the collective, the ranks and kinds of its group, and the layer and the training step it
ran in. Each is watched by :mod:`ds_usp.watchdog` from before the call that issues it (asynchronously) until it has
run, so that one that does not complete is named on every backend, NCCL included (whose ``wait()`` returns before the
collective has run, and whose first collective on a group sets up the group's communicator inside the issuing call):
the next collective raises it (or the issuing call, should it return), and a rank stuck in a device sync or in the
issuing call is ended.
"""
from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ds_usp.upstream.c10d import process_group_named
from ds_usp.watchdog import GroupInfo, describe_group, forget, issued, issuing, overdue, waited, watch, where


class USPCommError(RuntimeError):
    """A USP collective failed: a rank of its group died, stalled past the timeout, or called another collective."""


@contextmanager
def _named(what: str, group: Any) -> Iterator[None]:
    """Raise a collective the watchdog named (one issued earlier that has not completed in its group's timeout), then
    re-raise a failing collective's error as :class:`USPCommError` that names it, its group and where it ran."""
    message = overdue()
    if message is not None:
        raise USPCommError(message)
    try:
        yield
    except USPCommError:
        raise
    except RuntimeError as e:
        raise USPCommError(f"the {what} over {describe_group(group)} failed on rank {dist.get_rank()}{where()}: {e}\n"
                           f"A rank of this group died, stalled longer than the group timeout (usp.timeout_seconds), "
                           f"or called a different collective; see the other ranks' logs.") from e


def _cuda(device: torch.device) -> Optional[torch.device]:
    """``device`` when it is a CUDA device (where the watchdog waits for an event), else None."""
    return device if device.type == "cuda" else None


def _waited(works: Sequence[Any], token: Optional[int], device: Optional[torch.device]) -> None:
    """Wait for ``works`` (watched under ``token``); where the backend's wait returns before they have run (NCCL), the
    watchdog keeps watching them on ``device`` (their tensors' CUDA device, or None)."""
    try:
        for work in works:
            work.wait()
    except BaseException:
        forget(token)
        raise
    waited(token, device)


def _issue(what: str, group: Any, issue: Callable[[], Any]) -> tuple[Sequence[Any], Optional[int]]:
    """``issue()`` (a collective with ``async_op=True``, returning its work or a list of works), watched from before
    the call (:func:`ds_usp.watchdog.issuing`: a call that hangs, NCCL setting up the group's communicator, is named
    "while being issued"), then by its works: the works and the watchdog's token. A call that returned past its
    group's timeout raises the error the watchdog named for it. Called inside :func:`_named`."""
    token = issuing(what, group)
    try:
        works = issue()
    except BaseException:
        forget(token)
        raise
    token = issued(token, works if isinstance(works, list) else (works,))
    message = overdue()
    if message is not None:
        raise USPCommError(message)
    return works, token


def watched_call(what: str, info: GroupInfo, hung: str, me: int, call: Callable[[], Any]) -> Any:
    """``call()``, a blocking call that makes a group (``dist.new_group``, ``init_process_group``: with a GPU bound,
    NCCL sets up the communicator in it, and gloo connects the ranks), watched by the watchdog while it runs
    (:func:`ds_usp.watchdog.issuing` with ``info``, when it has a timeout): one that has not returned within the timeout
    is named in this rank's log (``what`` over the group's kinds, ranks and ``group_desc``, ``hung``), as a collective
    would be; one that fails, or returns past the timeout, raises that name.

    Args:
        what: the call's name in errors (``"creation of the process group"``).
        info: the group it makes.
        hung: what the error says the call hung in (``"while being created (dist.new_group)"``).
        me: this rank (named in a failure).
        call: the call.

    Returns:
        What ``call`` returned.

    Raises:
        USPCommError: the call failed, or took longer than the timeout.
    """
    token = issuing(what, None, info, hung=hung)
    try:
        made = call()
    except RuntimeError as e:
        forget(token)
        raise USPCommError(f"the {what} over {info.text()} failed on rank {me}: {e}\nA rank of this group died, "
                           f"stalled longer than the group timeout (usp.timeout_seconds), or cannot reach this one; "
                           f"see the other ranks' logs.") from e
    except BaseException:
        forget(token)
        raise
    message = overdue()  # named while it ran: it returned past its timeout
    forget(token)
    if message is not None:
        raise USPCommError(message)
    return made


def _run(what: str, group: Any, issue: Callable[[], Any], device: torch.device) -> None:
    """``issue()`` (a collective with ``async_op=True``, returning its work, on tensors of ``device``), watched from
    before the call, waited for, named."""
    with _named(what, group):
        work, token = _issue(what, group, issue)
        _waited((work,), token, _cuda(device))


def resolve_group(name: str) -> Any:
    """The process group called ``name`` (``group.group_name``), from torch.distributed's own registry.

    Custom operators cannot take a process group as an argument (their schema has no such type), so the
    USP operators take group names and look the groups up here; nothing is kept by ds-usp itself (the lookup is
    torch's private one, a registered patch: :mod:`ds_usp.upstream.c10d`).

    Args:
        name: the group's ``group_name``.

    Returns:
        The process group.
    """
    return process_group_named(name)


FP8 = torch.float8_e4m3fn
FP8_SCALE_BYTES = 4  # one fp32 scale per row of the last dim travels beside the row's e4m3 values


def fp8_encode(x: Tensor) -> Tensor:
    """``x`` as float8 e4m3 with one fp32 scale per row of its last dim, packed as one ``uint8`` message.

    Each row is divided by ``absmax / 448`` (e4m3's largest finite value), so its largest element is exact up to
    e4m3's 3 mantissa bits (relative error <= 2**-4) and no row saturates or underflows as a whole.

    Args:
        x: ``(..., d)`` floating tensor.

    Returns:
        ``(..., d + 4)`` contiguous ``uint8``: ``d`` e4m3 bytes, then the row's fp32 scale.
    """
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).div_(torch.finfo(FP8).max).clamp_min_(torch.finfo(torch.float32).tiny)
    values = (xf / scale).to(FP8)
    del xf
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)  # (..., d) + (..., 4)


def fp8_decode(msg: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`fp8_encode`.

    Args:
        msg: ``(..., d + 4)`` ``uint8`` from :func:`fp8_encode`.
        dtype: the dtype to return.

    Returns:
        ``(..., d)`` in ``dtype``.
    """
    d = msg.shape[-1] - FP8_SCALE_BYTES
    scale = msg[..., d:].contiguous().view(torch.float32)  # (..., 4) uint8 -> (..., 1) fp32
    return (msg[..., :d].view(FP8).float() * scale).to(dtype)


def all_to_all(send: Tensor, group: Any, fp8: bool = False) -> Tensor:
    """The Ulysses all-to-all: chunk ``i`` of ``send`` (dim 0) goes to group rank ``i``.

    Args:
        send: ``(U, ...)`` contiguous, ``U`` the group size.
        group: the Ulysses process group.
        fp8: send the chunks as :func:`fp8_encode` messages (``usp.comm_dtype = "fp8"``); this rank's own chunk,
            which never leaves it, is kept exact.

    Returns:
        ``recv`` of ``send``'s shape and dtype: chunk ``i`` came from group rank ``i``.

    Raises:
        USPCommError: the collective failed.
    """
    msg = fp8_encode(send) if fp8 else send
    recv = torch.empty_like(msg)
    _run("Ulysses all-to-all", group, lambda: dist.all_to_all_single(recv, msg, group=group, async_op=True), recv.device)
    if not fp8:
        return recv
    del msg
    out = fp8_decode(recv, send.dtype)
    me = dist.get_rank(group)
    out[me] = send[me]
    return out


@torch.library.custom_op("ds_usp::gather_seq", mutates_args=())
def _gather_seq(x: Tensor, group_name: str, dim: int) -> Tensor:
    group = resolve_group(group_name)
    return torch.cat(all_gather_rows(x.contiguous(), group, "sequence all-gather"), dim=dim)


@_gather_seq.register_fake
def _(x: Tensor, group_name: str, dim: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(resolve_group(group_name))
    return x.new_empty(shape)


def _gather_seq_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, group_name, dim = inputs
    ctx.rank, ctx.dim, ctx.n = dist.get_rank(resolve_group(group_name)), dim, x.shape[dim]


def _gather_seq_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n), None, None


torch.library.register_autograd("ds_usp::gather_seq", _gather_seq_backward, setup_context=_gather_seq_setup)


def gather_seq(x: Tensor, group: Any, dim: int) -> Tensor:
    """Concatenate the group's shards along ``dim`` in group-rank order (a custom op: safe under ``torch.compile``).

    The backward returns this rank's slice of the incoming gradient, which is exact when every
    rank feeds the gathered tensor into the same (replicated) computation, e.g. a loss.

    Args:
        x: this rank's shard (same shape on every rank).
        group: the process group.
        dim: the dimension to concatenate (non-negative).

    Returns:
        The concatenation of all shards.
    """
    return _gather_seq(x, group.group_name, dim)


class _SumGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce_sum_(grad.contiguous().clone(), ctx.group, "gradient all-reduce"), None


def sum_grads_over_group(x: Tensor, group: Any) -> Tensor:
    """``x`` unchanged; in the backward, its gradient summed over ``group``.

    Put after :func:`gather_seq` when every rank uses the gathered tensor differently (its own share of a loss): the
    gather's backward then keeps this rank's slice of the group's whole gradient.

    Args:
        x: a tensor every rank of ``group`` holds alike.
        group: the process group.

    Returns:
        ``x`` (a view).
    """
    return _SumGrads.apply(x, group)


@torch.library.custom_op("ds_usp::sum_over_group", mutates_args=())
def _sum_over_group(x: Tensor, group_name: str) -> Tensor:
    return all_reduce_sum_(x.clone(), resolve_group(group_name), "SP loss all-reduce")


@_sum_over_group.register_fake
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x)


torch.library.register_autograd("ds_usp::sum_over_group", lambda ctx, grad: (grad, None),
                                setup_context=lambda ctx, inputs, output: None)


def sum_over_group(x: Tensor, group: Any) -> Tensor:
    """The sum of ``x`` over ``group``, whose gradient reaches this rank's ``x`` unchanged (a custom op).

    Every rank of the group then holds the same value (e.g. the loss of a whole sequence) and, when
    each rank backpropagates it, each rank's own contribution gets exactly its gradient: summed over
    the ranks (as DeepSpeed sums gradients) that is the gradient of the sum.

    Args:
        x: this rank's part (same shape on every rank).
        group: the process group.

    Returns:
        The sum, a new tensor.

    Raises:
        USPCommError: the collective failed.
    """
    return _sum_over_group(x, group.group_name)


def ring_shift(send: Tensor, group: Any, ring_ranks: Sequence[int], ring_rank: int,
               hop: int = 1) -> Callable[[], Tensor]:
    """Start sending ``send`` ``hop`` ranks ahead in the ring and receiving from ``hop`` ranks behind.

    ``send`` must not be modified until the returned ``wait`` has been called. Where the group's backend cannot send
    ``send``'s device (gloo and CUDA tensors), the exchange is staged through host buffers (:func:`ring_exchange`).

    Args:
        send: the tensor to pass on (contiguous); the received tensor has its shape and dtype.
        group: the ring process group.
        ring_ranks: global ranks of the ring, in ring order.
        ring_rank: this rank's position in the ring.
        hop: how far ahead (1: the next rank).

    Returns:
        ``wait()``, which blocks until both transfers are done and returns the received tensor.

    Raises:
        USPCommError: the exchange failed.
    """
    wait = ring_exchange([(send, hop)], group, ring_ranks, ring_rank)
    return lambda: wait()[0]


def all_reduce_sum_(x: Tensor, group: Any, what: str) -> Tensor:
    """Sum ``x`` over ``group`` in place.

    Args:
        x: the tensor (same shape on every rank).
        group: the process group (None: every rank).
        what: a name for error messages (e.g. ``"SP loss all-reduce"``).

    Returns:
        ``x``.

    Raises:
        USPCommError: the collective failed.
    """
    return _all_reduce_(x, group, what, dist.ReduceOp.SUM)


def all_reduce_max_(x: Tensor, group: Any, what: str) -> Tensor:
    """:func:`all_reduce_sum_` taking the element-wise maximum instead of the sum."""
    return _all_reduce_(x, group, what, dist.ReduceOp.MAX)


def _all_reduce_(x: Tensor, group: Any, what: str, op: Any) -> Tensor:
    _run(what, group, lambda: dist.all_reduce(x, op=op, group=group, async_op=True), x.device)
    return x


def all_reduce_max_int(value: int, group: Any, what: str, device: Optional[torch.device] = None) -> int:
    """The largest of every rank's ``value`` over ``group`` (e.g. a count the ranks must agree on).

    Args:
        value: this rank's integer.
        group: the process group (None: every rank).
        what: a name for error messages.
        device: where the one-element tensor travels (default: :func:`group_device`).

    Returns:
        The maximum, the same on every rank.

    Raises:
        USPCommError: the collective failed.
    """
    t = torch.tensor([int(value)], dtype=torch.int64, device=device if device is not None else group_device(group))
    return int(all_reduce_max_(t, group, what))


def barrier(group: Any, what: str) -> None:
    """Wait until every rank of ``group`` (None: every rank) has reached this call.

    Raises:
        USPCommError: the collective failed.
    """
    _run(what, group, lambda: dist.barrier(group=group, async_op=True), group_device(group))


def warm_up(group: Any, what: str, ring: Optional[tuple[Sequence[int], int]] = None) -> None:
    """A new group's first collective (one one-element all-reduce) and, for a ring, its first exchange with every ring
    rank its forward and backward talk to, waited for, so that the backend connects the group's ranks now: a group
    whose ranks cannot reach each other fails here, named, not inside the first training step.

    The ring's forward sends each K/V block one hop ahead; its backward sends step ``t``'s dK/dV home ``R - t`` hops
    ahead (:func:`ds_usp.attention.ring.ring_backward`), so with ``R > 2`` a rank sends to and receives from every
    other rank of its ring, and NCCL connects each peer on its first transfer. The warm-up sends one element every hop
    ``1 .. R - 1`` in one batched :func:`ring_exchange` (the ring's own path: staged through host buffers where the
    ring's tensors will be, CUDA on gloo, :func:`ring_device`), and checks that each came from the rank it should.

    Args:
        group: the process group (of more than one rank).
        what: its name for error messages (e.g. ``"ulysses group"``).
        ring: ``(ring ranks in ring order, this rank's position)`` when ``group`` is a ring.

    Raises:
        USPCommError: a collective failed, the all-reduce did not count the group's ranks, or a ring peer's element
            did not come from it.
    """
    size = dist.get_world_size(group)
    x = torch.ones(1, dtype=torch.float32, device=group_device(group))
    with _named(f"warm-up all-reduce of the {what}", group):
        _all_reduce_(x, group, f"warm-up all-reduce of the {what}", dist.ReduceOp.SUM)
        got = x.item()  # waits: an asynchronous backend reports its failure here (or the watchdog names it)
    if got != size:
        raise USPCommError(f"the warm-up all-reduce of the {what} over ranks {dist.get_process_group_ranks(group)} "
                           f"counted {got:g} ranks, not {size}: the group does not connect its ranks")
    if ring is None:
        return
    ranks, position = ring
    n = len(ranks)
    mine = torch.full((1,), float(position), dtype=torch.float32, device=ring_device(group))
    with _named(f"warm-up exchange of the {what} with every ring peer", group):
        try:
            came = torch.cat(ring_exchange([(mine, hop) for hop in range(1, n)], group, ranks, position)()).tolist()
        except USPCommError as e:  # named by the exchange itself: say it was the warm-up, at build
            raise USPCommError(f"the warm-up exchange of the {what} with every ring peer, at build: {e}") from e
    want = [float((position - hop) % n) for hop in range(1, n)]
    if came != want:
        raise USPCommError(f"the warm-up exchange of the {what} over ranks {list(ranks)} gave rank {ranks[position]} "
                           f"{came} from the ring positions {want}: the group does not connect its ranks")


def ring_device(group: Any) -> torch.device:
    """Where a ring's blocks are exchanged on ``group``, for its warm-up: the backend's device (:func:`group_device`),
    except on gloo in a process that uses CUDA (ranks sharing a GPU), whose blocks are CUDA tensors staged through host
    buffers (:func:`ring_exchange`).

    Args:
        group: the process group.

    Returns:
        The device.
    """
    device = group_device(group)
    if device.type == "cpu" and dist.get_backend(group) == "gloo" and torch.cuda.is_available() \
            and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return device


_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}  # the tensors each backend moves natively (for ours)
_BACKEND_DEVICES = {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu", "cuda"})}  # what this module takes on each


def backend_device_type(group: Any) -> Optional[str]:
    """The device type ``group``'s backend moves natively: ``"cuda"`` for NCCL, ``"cpu"`` for gloo, None for others
    (where :func:`group_device` puts small tensors; :func:`backend_device_types` is every device type this module
    moves on the group).

    Args:
        group: the process group.

    Returns:
        The device type, or None when the backend is not one of those two.
    """
    return _BACKEND_DEVICE.get(dist.get_backend(group))


def backend_device_types(group: Any) -> Optional[frozenset]:
    """Every device type whose tensors this module's collectives move on ``group``: CUDA for NCCL; the CPU and CUDA
    for gloo (ranks sharing a GPU: gloo's collectives copy CUDA tensors through pinned host memory themselves, and
    :func:`ring_exchange` stages the point-to-point transfers, which gloo takes in host memory only); None for other
    backends.

    Args:
        group: the process group.

    Returns:
        The device types, or None when the backend is not NCCL or gloo.
    """
    return _BACKEND_DEVICES.get(dist.get_backend(group))


def group_device(group: Any) -> torch.device:
    """The device a small tensor must be on to go through ``group`` (this rank's GPU for NCCL, else CPU).

    Args:
        group: the process group.

    Returns:
        The device.
    """
    if backend_device_type(group) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(x: Tensor, group: Any, what: str) -> list[Tensor]:
    """Every rank's ``x`` (same shape everywhere), in group-rank order.

    Args:
        x: this rank's tensor.
        group: the process group.
        what: a name for error messages.

    Returns:
        One tensor per rank of ``group``.

    Raises:
        USPCommError: the collective failed.
    """
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _run(what, group, lambda: dist.all_gather(parts, x, group=group, async_op=True), x.device)
    return parts


def all_gather_objects(obj: Any, group: Any, what: str) -> list[Any]:
    """:func:`all_gather_rows` for any picklable ``obj`` (tensors of any shape travel on the CPU): one per rank of
    ``group``, in group-rank order; ``USPCommError`` when the collective fails."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    with _named(what, group):
        token = watch(None, what, group)  # no work: the call is watched until it returns
        try:
            dist.all_gather_object(parts, obj, group=group)
        finally:
            forget(token)
    return parts


def checksum(t: Tensor) -> tuple[tuple[int, ...], float, float]:
    """An order-sensitive fingerprint of ``t``: its shape, the sum of its elements and their sum weighted by position
    (integers and booleans exactly in int64 on ``t``'s device, floating values in float64 on the CPU).

    Args:
        t: any tensor.

    Returns:
        ``(shape, sum, weighted sum)``.
    """
    flat = t.detach().reshape(-1)
    flat = flat.double().cpu() if flat.is_floating_point() else flat.long()
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=flat.dtype)
    return tuple(t.shape), flat.sum().item(), (flat * weights).sum().item()


def disagreements(facts: Mapping[str, Any], group: Any, what: str) -> dict[str, dict[str, list[int]]]:
    """Which ranks of ``group`` hold which value of each fact the ranks disagree on (one all-gather of objects).

    Tensors are compared by their :func:`checksum`, other values by their JSON text (``str`` for what JSON cannot
    write).

    Args:
        facts: this rank's values by name (the same names on every rank).
        group: the process group (None: every rank).
        what: a name for error messages.

    Returns:
        ``{name: {value's text: global ranks holding it}}`` for each fact that differs (the group's first rank's value
        first); empty when every rank holds the same facts.

    Raises:
        USPCommError: the collective failed.
    """
    mine = {key: json.dumps(checksum(value) if isinstance(value, Tensor) else value, sort_keys=True, default=str)
            for key, value in facts.items()}
    if dist.get_world_size(group) == 1:
        return {}
    everyone = all_gather_objects(mine, group, what)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
    found = {}
    for key in mine:
        holders: dict[str, list[int]] = {}
        for rank, theirs in zip(ranks, everyone):
            holders.setdefault(theirs.get(key, "<missing>"), []).append(rank)
        if len(holders) > 1:
            found[key] = holders
    return found


def ring_exchange(sends: Sequence[tuple[Tensor, int]], group: Any, ring_ranks: Sequence[int],
                  ring_rank: int) -> Callable[[], list[Tensor]]:
    """Start several :func:`ring_shift` transfers as one batched exchange (one ``batch_isend_irecv`` call).

    Each ``(tensor, hop)`` goes ``hop`` ranks ahead in the ring while a tensor of its shape and dtype comes from
    ``hop`` ranks behind; every rank of the ring must call it with the same hops in the same order. The ring's
    backward sends a step's K/V shift and the previous step's dK/dV return in one of these, so that they leave as one
    group of transfers rather than two calls serialized on the backend's stream. The tensors sent must not be
    modified until the returned ``wait`` has been called.

    Where the group's backend cannot send the tensors' device (gloo's send and recv take host memory only: CUDA tensors
    on a gloo group), the exchange is staged (:func:`_staged_exchange`): the same bytes travel through host buffers of
    a pool, one wait of the host for the device per exchange. Whether a group stages is decided once per group
    (:func:`_route`), never by trying.

    Args:
        sends: ``(contiguous tensor, hop)`` pairs, ``hop`` >= 1.
        group: the ring process group.
        ring_ranks: global ranks of the ring, in ring order.
        ring_rank: this rank's position in the ring.

    Returns:
        ``wait()``, which blocks until every transfer is done and returns the received tensors, in ``sends``' order.

    Raises:
        USPCommError: the exchange failed.
    """
    if sends and _stages(group, sends[0][0].device):
        return _staged_exchange(sends, group, ring_ranks, ring_rank)
    recvs = [torch.empty_like(send) for send, _ in sends]
    works, token = _start_exchange([(send, hop, recv) for (send, hop), recv in zip(sends, recvs)], group, ring_ranks,
                                   ring_rank)

    def wait() -> list[Tensor]:
        with _named("ring send/recv", group):
            _waited(works, token, _cuda(recvs[0].device) if recvs else None)
        return recvs

    return wait


def _start_exchange(transfers: Sequence[tuple[Tensor, int, Tensor]], group: Any, ring_ranks: Sequence[int],
                    ring_rank: int) -> tuple[list[Any], Optional[int]]:
    """Issue one ``batch_isend_irecv`` of ``(send, hop, recv)`` transfers; its works and the watchdog's token."""
    n = len(ring_ranks)
    ops = []
    for send, hop, recv in transfers:
        ops += [dist.P2POp(dist.isend, send, ring_ranks[(ring_rank + hop) % n], group),
                dist.P2POp(dist.irecv, recv, ring_ranks[(ring_rank - hop) % n], group)]
    with _named("ring send/recv", group):
        return _issue("ring send/recv", group, lambda: dist.batch_isend_irecv(ops))


# ---- staged point-to-point: a ring exchange through host buffers where the backend cannot send the device's tensors
#
# gloo (torch 2.13, ProcessGroupGloo.cpp) moves CUDA tensors in its collectives (allreduce, allgather, alltoall_base,
# broadcast, reduce; _reduce_scatter_base through allreduce), each through pinned host copies of its own, but its
# send and recv hand the tensor's data pointer to the TCP transport as host memory, with no CUDA path; batch_isend_irecv
# on gloo (no coalescing) is one send or recv per op. So only the ring's exchanges need staging.

_P2P_DEVICES = {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu"})}  # what each backend's send / recv moves


class _Route:
    """How one group's point-to-point transfers go: the device types its backend sends itself (None: not known, sent
    as given) and whether every exchange is staged regardless (:func:`stage_point_to_point`, for tests)."""

    __slots__ = ("moves", "forced")

    def __init__(self, moves: Optional[frozenset]) -> None:
        self.moves, self.forced = moves, False

    def force(self, on: bool) -> None:
        """Stage every exchange (``on``) or only those the backend cannot send."""
        self.forced = on


_ROUTES: dict[int, _Route] = {}  # id(group) -> its route, dropped when the group object dies


def _route(group: Any) -> _Route:
    """``group``'s :class:`_Route`, made on its first exchange (a ring's is at its warm-up, when the topology is built):
    the backend is looked up once per group, never per exchange."""
    group = group if group is not None else dist.group.WORLD
    route = _ROUTES.get(id(group))
    if route is None:
        route = _ROUTES[id(group)] = _Route(_P2P_DEVICES.get(dist.get_backend(group)))
        weakref.finalize(group, _ROUTES.pop, id(group), None)
    return route


def _stages(group: Any, device: torch.device) -> bool:
    """Whether an exchange of ``device`` tensors on ``group`` goes through host buffers: forced, or the backend sends
    host memory but not this device's."""
    route = _route(group)
    moves = route.moves
    return route.forced or (moves is not None and device.type not in moves and "cpu" in moves)


def stage_point_to_point(group: Any, on: bool = True) -> None:
    """Test-only: stage every ring exchange of ``group`` through host buffers whatever its tensors' device (CPU
    tensors then take the path CUDA tensors take on gloo, with unpinned buffers and no device waits); ``on=False``
    restores the backend's own rule.

    Args:
        group: the process group.
        on: force staging (True) or not.
    """
    _route(group).force(on)


class _Slot:
    """One host buffer of the pool and the CUDA event after which the last copy reading it to the device is done
    (None: none pending, or an unpinned buffer)."""

    __slots__ = ("buf", "key", "event")

    def __init__(self, buf: Tensor, key: tuple) -> None:
        self.buf, self.key, self.event = buf, key, None

    def free(self) -> bool:
        """Whether the host may write it now (gloo's recv does): no copy to the device still reads it."""
        return self.event is None or self.event.query()

    def read_by_device(self) -> None:
        """A copy from it to the device was queued on the current stream: it stays busy until that has run."""
        if self.key[2]:  # pinned: the copy runs on the device after this returns
            if self.event is None:
                self.event = torch.cuda.Event()
            self.event.record()


class _HostPool:
    """Host buffers for staged exchanges, reused by (shape, dtype, pinned) across calls: a ring step takes at most two
    per tensor it sends (one out, one in), given back at its ``wait``. At most :data:`KEYS` shapes are kept (the least
    recently used one's buffers are dropped: a pinned buffer still read by a copy is held by torch's pinned-memory
    allocator until the copy is done)."""

    KEYS = 16

    def __init__(self) -> None:
        self._free: "OrderedDict[tuple, list[_Slot]]" = OrderedDict()
        self.allocations = 0  # buffers made so far (flat once every shape the ring uses has been seen)

    def take(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> _Slot:
        """A buffer the host may write now: a free one of this key, else a new one."""
        key = (tuple(shape), dtype, pinned)
        free = self._free.get(key)
        if free is not None:
            self._free.move_to_end(key)
            for i, slot in enumerate(free):
                if slot.free():
                    return free.pop(i)
        self.allocations += 1
        return _Slot(torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned), key)

    def give(self, slot: _Slot) -> None:
        """Take ``slot`` back (its pending copy, if any, recorded in its event)."""
        self._free.setdefault(slot.key, []).append(slot)
        self._free.move_to_end(slot.key)
        while len(self._free) > self.KEYS:
            self._free.popitem(last=False)

    def held(self) -> tuple[int, int]:
        """``(buffers, bytes)`` the pool holds now."""
        slots = [slot for free in self._free.values() for slot in free]
        return len(slots), sum(slot.buf.numel() * slot.buf.element_size() for slot in slots)


_POOL = _HostPool()
_COUNTS = {"exchanges": 0, "host_syncs": 0}  # staged exchanges, and the host's waits for the device among them


def staging_stats() -> dict[str, int]:
    """What staged exchanges did in this process so far (for tests and benchmarks).

    Returns:
        ``exchanges`` (staged exchanges), ``host_syncs`` (the host waited for the device: one per staged exchange of
        CUDA tensors, before its sends), ``allocations`` (host buffers ever made), ``buffers`` and ``bytes`` (what the
        pool holds now).
    """
    buffers, nbytes = _POOL.held()
    return {**_COUNTS, "allocations": _POOL.allocations, "buffers": buffers, "bytes": nbytes}


def _staged_exchange(sends: Sequence[tuple[Tensor, int]], group: Any, ring_ranks: Sequence[int],
                     ring_rank: int) -> Callable[[], list[Tensor]]:
    """:func:`ring_exchange` through host buffers: the same tensors' bytes sent, in the same ``batch_isend_irecv``.

    Order, all on the current stream: each tensor is copied into a host buffer (pinned for CUDA tensors, a
    ``non_blocking`` copy), then the host waits for the stream (one ``synchronize`` per exchange: the backend reads the
    buffers from the host as soon as the send is issued), then the receive buffers are taken (the wait also finished
    every earlier copy out of them queued on this stream; a buffer whose copy is not done, another stream's, is not
    taken). ``wait()`` waits for the transfers, copies each received buffer to a new tensor on the device
    (``non_blocking``) and records an event after it: the buffer is not written again before that copy has run.
    """
    device = sends[0][0].device
    pinned = device.type == "cuda"
    outs = [_POOL.take(send.shape, send.dtype, pinned) for send, _ in sends]
    for slot, (send, _) in zip(outs, sends):
        slot.buf.copy_(send, non_blocking=pinned)
    if pinned:
        torch.cuda.current_stream(device).synchronize()
        _COUNTS["host_syncs"] += 1
    _COUNTS["exchanges"] += 1
    ins = [_POOL.take(send.shape, send.dtype, pinned) for send, _ in sends]
    try:
        works, token = _start_exchange([(o.buf, hop, i.buf) for o, (_, hop), i in zip(outs, sends, ins)], group,
                                       ring_ranks, ring_rank)
    except BaseException:
        for slot in outs + ins:
            _POOL.give(slot)
        raise

    def wait() -> list[Tensor]:
        with _named("ring send/recv", group):
            _waited(works, token, None)
        recvs = []
        for slot in ins:
            recv = torch.empty(slot.buf.shape, dtype=slot.buf.dtype, device=device)
            recv.copy_(slot.buf, non_blocking=pinned)
            slot.read_by_device()
            recvs.append(recv)
        for slot in outs + ins:
            _POOL.give(slot)
        return recvs

    return wait
