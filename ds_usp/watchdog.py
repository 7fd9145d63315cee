"""The collectives' watchdog: a ds-usp collective that does not complete within its group's timeout is named (the
collective, its group's kinds and ranks, the layer and the training step) on every rank that waits for it, whatever
the backend's ``wait()`` does.

gloo's ``Work.wait()`` blocks until its collective is done and raises at the group's timeout, so :mod:`ds_usp.comm`
turns that error into a named one as it passes. NCCL's returns once the current CUDA stream is ordered after the
collective: a collective whose peer never comes fails no Python call, and after the timeout NCCL's own watchdog aborts
the process naming a process-group number. So this module watches from the host:

* :mod:`ds_usp.comm` issues each collective with ``async_op=True``, watched from before the call (:func:`issuing`: a
  record in a dict, O(1), no host sync) and, once the call returned, by its works (:func:`issued`), then calls
  :func:`waited` once ``wait()`` returned. The call itself can hang: NCCL sets up a group's communicator in its first
  collective (or in ``dist.new_group`` when the default group is bound to a GPU, which the topology watches the same
  way), waiting there for every rank of the group; such a record is named as hung "while being issued" (or created).
  A group whose backend's wait blocks and raises at the timeout itself (gloo, whose connections are made when the
  group is created) needs no record once issued, and none while issuing. On another (NCCL) the record stays until the
  device has run the collective: a CUDA event recorded on the current stream after ``wait()`` (from a pool) stands
  for the work, so that no record holds a tensor (a ``WorkNCCL`` holds its outputs). Later collectives drop the
  records whose collectives have run, oldest first.
* One daemon thread a process, started by the first watched collective, looks at the records every poll interval
  (``min(1 s, timeout / 10)``). A record outstanding for its group's timeout less one poll interval is named no later
  than the timeout itself, before NCCL's watchdog acts on it: the error is logged on this rank at once, and the next
  ds-usp collective of any thread raises it (:func:`overdue`, as ``USPCommError``) while the collective is outstanding.
* A thread stuck where no ds-usp collective comes (a device sync: ``.item()``, a barrier; or the issuing call itself,
  blocked in C++) cannot raise it: when neither the thread that issued the collective nor the main thread has raised
  it within a grace period (``min(30 s, max(1 s, timeout / 10))``), the monitor interrupts the main thread
  (``KeyboardInterrupt`` wherever it runs Python), and after a second grace period prints every thread's Python stack
  and aborts the process (SIGABRT, as NCCL's watchdog does): NCCL's blocking communicator set-up has no timeout of
  its own.

Groups are known by :func:`name_group` (the topology names each group it builds, with its timeout); a collective on
another group (the default group, a caller's own) is not watched, and where its wait blocks it is still named by
:mod:`ds_usp.comm`. The layer and the step come from :func:`set_layer` (the attention interface) and
:func:`set_step_source` (the engine), read when a collective is issued or named: module state, no allocation.
"""
from __future__ import annotations

import _thread
import faulthandler
import functools
import itertools
import os
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ds_usp.log import log_error

POLL_MAX_S = 1.0  # the monitor's longest sleep
GRACE_S = (1.0, 30.0)  # the bounds of the grace period before the monitor interrupts, then aborts


@dataclass(frozen=True)
class GroupInfo:
    """What an error says of a process group, and how long its collectives may take.

    Attributes:
        kinds: the kinds the group serves (``"ulysses"``, ``"ring"``, ``"sp"``, ``"dp"``, ``"sp_dp"``).
        ranks: its global ranks.
        desc: its ``group_desc`` (e.g. ``"ds_usp_ring_1"``).
        timeout_s: its collectives' timeout (None: unknown, the group is not watched).
        wait_blocks: whether its backend's ``Work.wait()`` returns only once the collective is done (gloo).
    """

    kinds: tuple[str, ...]
    ranks: tuple[int, ...]
    desc: str
    timeout_s: Optional[float]
    wait_blocks: bool

    @property
    def poll_s(self) -> float:
        """How often its records are looked at."""
        return min(POLL_MAX_S, self.timeout_s / 10)

    @property
    def grace_s(self) -> float:
        """How long a named collective waits to be raised before the monitor interrupts (then aborts)."""
        return min(GRACE_S[1], max(GRACE_S[0], self.timeout_s / 10))

    def text(self) -> str:
        """``ranks [1, 3] (the ring / dp group ds_usp_ring_1+dp_1)``."""
        return f"ranks {list(self.ranks)} (the {' / '.join(self.kinds)} group {self.desc})"


class _Record:
    """One outstanding collective: its works (or the CUDA event standing for them; neither: a call in progress), what
    it is, where it was issued from, and how far the monitor has gone with it."""

    __slots__ = ("works", "event", "device_index", "what", "info", "since", "layer", "phase", "thread", "named_at",
                 "message", "acknowledged", "stage", "issuing")

    def __init__(self, works: Optional[Sequence[Any]], what: str, info: GroupInfo, layer: Layer,
                 phase: str, issuing: Optional[str] = None) -> None:
        self.works, self.event, self.device_index, self.what, self.info = works, None, None, what, info
        self.since, self.layer, self.phase, self.thread = time.monotonic(), layer, phase, threading.get_ident()
        self.named_at: Optional[float] = None
        self.message, self.acknowledged, self.stage = "", False, 0
        self.issuing = issuing  # the call is in progress: "while being issued" (None: it returned, or no such call)

    def returned(self, works: Sequence[Any]) -> None:
        """Its issuing call returned ``works``: watched by them from now (a record named meanwhile stays named)."""
        self.works = works
        if self.named_at is None:
            self.issuing, self.since = None, time.monotonic()

    def done(self) -> bool:
        """Whether the device (or the backend) has run the collective."""
        if self.event is not None:
            return self.event.query()
        return self.works is not None and all(work.is_completed() for work in self.works)

    def on_device(self, event: Any, index: int) -> None:
        """From now on ``event`` (recorded after ``wait()`` on CUDA device ``index``) stands for the works, which are
        let go."""
        self.event, self.device_index, self.works = event, index, None

    def finished(self) -> bool:
        """Whether its record may go: the collective has run, and an error named for it was raised."""
        return (self.named_at is None or self.acknowledged) and self.done()

    def due(self, now: float) -> bool:
        """Whether it is to be named now: outstanding for its timeout less one poll interval."""
        return self.named_at is None and now - self.since >= self.info.timeout_s - self.info.poll_s

    def name(self, now: float) -> str:
        """Mark it named; its message."""
        self.named_at = now
        hung = "" if self.issuing is None else (
            f"; it hung {self.issuing}, its call has not returned (NCCL sets up a group's communicator in its first "
            f"collective, or in its creation when the default group is bound to a GPU, and waits there for every rank "
            f"of the group to connect)")
        self.message = (f"the {self.what} over {self.info.text()} has not completed on rank {_rank()}"
                        f"{_where(self.layer, self.phase)} after {now - self.since:.1f} s (the group's timeout, "
                        f"usp.timeout_seconds, is {self.info.timeout_s:g} s){hung}: a rank of this group died, "
                        f"stalled, cannot reach this one, or called a different collective; see the other ranks' logs")
        return self.message

    def acknowledge(self) -> None:
        """Its error was raised where someone can handle it: no interrupt, no abort."""
        self.acknowledged = True

    def escalation(self, now: float) -> Optional[str]:
        """``"interrupt"`` or ``"abort"`` when a named error has waited one or two grace periods to be raised."""
        if self.named_at is None or self.acknowledged or self.stage >= 2:
            return None
        if now - self.named_at >= (self.stage + 1) * self.info.grace_s:
            self.stage += 1
            return "interrupt" if self.stage == 1 else "abort"
        return None


# ---- module state: the registry of groups, the context, the records and the monitor thread's start flag
_GROUPS: dict[int, GroupInfo] = {}  # id(group) -> its info, dropped when the group object dies
Layer = Optional[Union[int, str]]  # a decoder layer's index, or a module's path (a DiT block's attention)
_LAYER: Layer = None  # the decoder layer whose attention runs (set by the attention interface)
_PHASE = "forward"
_STEP_SOURCE: Optional[Callable[[], Optional[int]]] = None  # the training step, read when an error is named
_LOCK = threading.Lock()
_TOKENS = itertools.count()
_OUT: dict[int, _Record] = {}  # token -> record, oldest first
_NAMED: dict[int, _Record] = {}  # the named ones among them
_KEPT: deque = deque()  # their tokens, oldest first, for dropping the ones that have run (forgotten ones skipped)
_EVENTS: dict[int, list] = {}  # CUDA device index -> free events
_MONITOR = {"started": False, "fork_hook": False}


def name_group(group: Any, kinds: Sequence[str], ranks: Sequence[int], desc: str, timeout_s: Optional[float],
               wait_blocks: bool) -> None:
    """Record what ``group`` is, for the errors of its collectives, and watch them when ``timeout_s`` is known.

    Args:
        group: the process group.
        kinds: the kinds it serves.
        ranks: its global ranks.
        desc: its ``group_desc``.
        timeout_s: its collectives' timeout in seconds (None: not watched).
        wait_blocks: whether its backend's ``wait()`` blocks until the collective is done (gloo: True).
    """
    key = id(group)
    if key not in _GROUPS:
        weakref.finalize(group, _GROUPS.pop, key, None)
    info = GroupInfo(tuple(kinds), tuple(ranks), desc, timeout_s, wait_blocks)
    _GROUPS[key] = info


def group_info(group: Any) -> Optional[GroupInfo]:
    """What :func:`name_group` was told of ``group`` (None: nothing)."""
    return _GROUPS.get(id(group))


def describe_group(group: Any) -> str:
    """``ranks [1, 3] (the ring group ds_usp_ring_1)``, or its ranks alone for a group :func:`name_group` was not told
    of (None: every rank).

    Args:
        group: the process group, or None.

    Returns:
        The text.
    """
    info = _GROUPS.get(id(group))
    if info is not None:
        return info.text()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return f"ranks {ranks}"


def set_layer(layer: Layer, phase: str = "forward") -> None:
    """The layer whose collectives run from now on (a decoder layer's index, a module's path such as
    ``"transformer_blocks.7.attn"``; None: none known), and whether in its ``"forward"`` or ``"backward"``."""
    global _LAYER, _PHASE
    _LAYER, _PHASE = layer, phase


@functools.cache
def _backward_of(layer: Layer) -> Callable[[torch.Tensor], None]:
    """The hook on a layer's output: its gradient has arrived, so the layer's backward (and its collectives) runs
    next, in ``layer``."""

    def hook(grad: torch.Tensor) -> None:
        set_layer(layer, "backward")

    return hook


def _after_backward(grad: torch.Tensor) -> None:
    """The hook on a layer's input: its gradient is complete, so the layer's backward is over."""
    set_layer(None)


def run_in_layer(layer: Layer, run: Callable[[], Any], inputs: Any) -> Any:
    """``run()`` (a layer's sequence-parallel part: attention, a linear-attention mixer, a DiT block's attention) with
    ``layer`` told to the watchdog (:func:`set_layer`), so that a collective that does not complete names it: set for
    the forward, and, when the output takes a gradient, for the backward by a hook on the output (the backward starts)
    and one on ``inputs`` (it ended). Two module variables set per call, two hooks per training call; nothing under
    ``torch.compile`` (its graphs keep no such side effect) or when ``layer`` is None.

    Args:
        layer: the layer (an index or a module path), or None.
        run: the call.
        inputs: the call's input tensor (its gradient completes last), or anything else (no hook).

    Returns:
        What ``run`` returned (a tensor, or a tuple whose first item is the output).
    """
    if layer is None or torch.compiler.is_compiling():
        return run()
    set_layer(layer)
    try:
        result = run()
    finally:
        set_layer(None)
    out = result[0] if isinstance(result, tuple) and result else result
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(_backward_of(layer))
        if isinstance(inputs, torch.Tensor) and inputs.requires_grad:
            inputs.register_hook(_after_backward)
    return result


def set_step_source(source: Optional[Callable[[], Optional[int]]]) -> None:
    """The function an error calls for the training step it names (the training engine's; None: no step)."""
    global _STEP_SOURCE
    _STEP_SOURCE = source


def where() -> str:
    """`` in layer 5 (forward) of training step 2``: what is known of where collectives run now (may be empty)."""
    return _where(_LAYER, _PHASE)


def _where(layer: Layer, phase: str) -> str:
    step = _STEP_SOURCE() if _STEP_SOURCE is not None else None
    name = f"layer {layer}" if isinstance(layer, int) else layer  # an index, or a module's path
    text = f" in {name} ({phase})" if layer is not None else ""
    if step is not None:
        text += f"{' of' if text else ' in'} training step {step}"
    return text


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def watch(works: Optional[Sequence[Any]], what: str, group: Any) -> Optional[int]:
    """Start watching a collective just issued on ``group`` (O(1), no host sync).

    Args:
        works: its works (``async_op=True``), or None for a call that runs to its end (an object collective), watched
            until :func:`forget`.
        what: its name in errors (e.g. ``"Ulysses all-to-all"``).
        group: its process group.

    Returns:
        A token for :func:`waited` / :func:`forget`; None when the group is not watched: unknown, no timeout, or its
        backend's wait blocks and raises at the timeout itself (gloo: the error passes through ``ds_usp.comm``, named).
    """
    info = _GROUPS.get(id(group))
    if info is None or info.timeout_s is None or info.wait_blocks:
        return None
    return _add(_Record(works, what, info, _LAYER, _PHASE), kept=True)


def _add(record: _Record, kept: bool) -> int:
    """Watch ``record`` (the monitor started on the first), among the kept ones when ``kept`` (dropped oldest first
    once run): its token."""
    if not _MONITOR["started"]:
        _start()
    token = next(_TOKENS)
    with _LOCK:
        _OUT[token] = record
        if kept:
            _KEPT.append(token)
    return token


ISSUING = "while being issued"


def issuing(what: str, group: Any, info: Optional[GroupInfo] = None, hung: str = ISSUING) -> Optional[int]:
    """Start watching a call about to issue a collective on ``group`` (before it, O(1), no host sync): a call that does
    not return within the group's timeout (NCCL setting up the group's communicator) is named as :func:`watch`'s
    records are, as hung ``hung``. Once it returned, :func:`issued` (or, for a call that is the whole collective or a
    group's creation, :func:`forget`).

    Args:
        what: the collective's name in errors (e.g. ``"Ulysses all-to-all"``).
        group: its process group (unused when ``info`` is given).
        info: what to name instead of ``group``'s info, for a call on a group not yet made (``dist.new_group``): watched
            whenever it has a timeout, whatever its backend.
        hung: what the error says the call hung in (``"while being issued"``).

    Returns:
        A token for :func:`issued` / :func:`forget`; None when the call is not watched: the group is unknown or has no
        timeout, or (``info`` not given) its backend's wait blocks (gloo: its collectives' calls wait on no peer, and a
        blocked wait raises by itself).
    """
    if info is None:
        info = _GROUPS.get(id(group))
        if info is None or info.wait_blocks:
            return None
    if info.timeout_s is None:
        return None
    return _add(_Record(None, what, info, _LAYER, _PHASE, hung), kept=False)  # kept once it returned (issued)


def issued(token: Optional[int], works: Sequence[Any]) -> Optional[int]:
    """The call watched under ``token`` (:func:`issuing`) returned ``works``: from now on they are watched as
    :func:`watch`'s, from now (a few dict operations, no host sync). A call the monitor named meanwhile stays named:
    the caller's :func:`overdue` raises it at once.

    Args:
        token: from :func:`issuing`, or None (nothing watched).
        works: its works.

    Returns:
        The token, for :func:`waited` / :func:`forget` (None when ``token`` is).
    """
    if token is None:
        return None
    record = _OUT.get(token)
    if record is None:
        return None
    with _LOCK:
        record.returned(works)
        _KEPT.append(token)
    return token


def waited(token: Optional[int], device: Optional[torch.device] = None) -> None:
    """The works of ``token`` were waited for, which on a watched group does not mean they have run (NCCL): they are
    watched until the device has run them (``device``: the CUDA device of their tensors, where an event recorded now
    stands for them; None: the works themselves are asked). Records of earlier collectives that have run are dropped.

    Args:
        token: from :func:`watch`.
        device: the CUDA device the collective's tensors are on, or None.
    """
    if token is None:
        return
    record = _OUT.get(token)
    if record is None:
        return
    index = None if device is None else (device.index if device.index is not None else torch.cuda.current_device())
    event = _event_after(index) if index is not None else None
    with _LOCK:
        if event is not None:
            record.on_device(event, index)
        while _KEPT:
            head = _OUT.get(_KEPT[0])
            if head is not None and not head.finished():
                break
            _drop(_KEPT.popleft())


def forget(token: Optional[int]) -> None:
    """Stop watching ``token``'s collective (it ended, or its error was raised). None: nothing."""
    if token is None:
        return
    with _LOCK:
        _drop(token)


def _drop(token: int) -> None:
    """Remove a record (the caller holds the lock); its event goes back to the pool."""
    record = _OUT.pop(token, None)
    _NAMED.pop(token, None)
    if record is not None and record.event is not None:
        _EVENTS.setdefault(record.device_index, []).append(record.event)


def _event_after(index: int) -> Any:
    """A CUDA event recorded on device ``index``'s current stream: it completes once everything queued there ran."""
    with _LOCK:
        free = _EVENTS.get(index)
        event = free.pop() if free else None
    if event is None:
        event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(index))
    return event


def overdue() -> Optional[str]:
    """The message of a collective the monitor named that is still outstanding (the oldest), or None. Once the thread
    that issued it or the main thread was given it (to raise), it is not interrupted for, and once it has also run
    (late, or failed by its backend) it is dropped.

    Returns:
        The message, or None (the common case: one dict's truth tested).
    """
    if not _NAMED:
        return None
    with _LOCK:
        for token, record in list(_NAMED.items()):
            if record.finished():
                _drop(token)
                continue
            me = threading.get_ident()
            if me in (record.thread, threading.main_thread().ident):
                record.acknowledge()
            how = "when its call returned" if record.issuing is not None and me == record.thread else \
                "at its next collective"
            return f"{record.message} (raised on rank {_rank()} {how})"
    return None


def outstanding() -> list[str]:
    """What is watched now, oldest first: ``"<collective> over <group> for <seconds> s"`` (and ``" while being
    issued"`` for a call in progress, :func:`issuing`) (for logs and tests).

    Returns:
        One line per outstanding collective.
    """
    now = time.monotonic()
    with _LOCK:
        return [f"{r.what} over {r.info.text()} for {now - r.since:.1f} s{'' if r.issuing is None else ' ' + r.issuing}"
                for r in _OUT.values()]


def _start() -> None:
    """Start the monitor thread of this process (once; again in a forked child)."""
    with _LOCK:
        if _MONITOR["started"]:
            return
        _MONITOR["started"] = True
        hook = not _MONITOR["fork_hook"]
        _MONITOR["fork_hook"] = True
    if hook:
        os.register_at_fork(after_in_child=_after_fork)
    threading.Thread(target=_monitor, name="ds_usp-collectives-watchdog", daemon=True).start()


def _after_fork() -> None:
    """A forked child has no monitor thread and none of its parent's collectives."""
    global _LOCK
    _LOCK = threading.Lock()
    _OUT.clear()
    _NAMED.clear()
    _KEPT.clear()
    _EVENTS.clear()
    _MONITOR["started"] = False


def _monitor() -> None:
    """The monitor thread: every poll interval, name the records that are due and escalate the named ones."""
    while True:
        time.sleep(_poll_s())
        try:
            named, actions = _scan(time.monotonic())
        except Exception as e:  # noqa: BLE001 - the monitor must outlive a bad look; it says so
            log_error(f"ds_usp's collectives watchdog could not look at the outstanding collectives: {e!r}")
            continue
        for message in named:
            log_error(message)
        for action, message in actions:
            _escalate(action, message)


def _poll_s() -> float:
    """The monitor's sleep: the shortest poll interval of the named groups and of the records (a group being created
    is known to its record only)."""
    infos = [i for i in list(_GROUPS.values()) if i.timeout_s is not None] + [r.info for r in list(_OUT.values())]
    return min((i.poll_s for i in infos), default=POLL_MAX_S)


def _scan(now: float) -> tuple[list[str], list[tuple[str, str]]]:
    """The messages of the records named now, and the escalations due (``(action, message)``)."""
    named, actions = [], []
    with _LOCK:
        for token, record in _OUT.items():
            if record.due(now) and not record.done():
                named.append(record.name(now))
                _NAMED[token] = record
            action = record.escalation(now)
            if action is not None:
                actions.append((action, record.message))
    return named, actions


def _escalate(action: str, message: str) -> None:
    """Interrupt the main thread, or print every thread's stack and abort the process."""
    if action == "interrupt":
        log_error(f"interrupting the main thread: it has not raised this error within its grace period: {message}")
        _thread.interrupt_main()
        return
    log_error(f"aborting the process: a thread is still stuck behind this collective: {message}")
    _abort()


def _abort() -> None:
    """Every thread's Python stack on stderr, then SIGABRT (NCCL's watchdog ends a process the same way)."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os.abort()
