"""What one forward call of a long-sequence step does: the memory features ``"auto"`` chooses for it.

:class:`MemoryContext` is shared by a wrapped model's top-level forward and its layers
(:mod:`ds_usp.integration.step.forward`). At each call :meth:`MemoryContext.choose` turns the ``usp`` keys and the
tokens this rank holds into :class:`StepChoices`: the fastest features whose predicted memory fits the rank's budget,
from the one cost model (:func:`ds_usp.cost.choose_features`; ``python -m ds_usp.plan`` prints the same choice).

The budget: :data:`~ds_usp.cost.HEADROOM` of what ``usp.memory_gib`` (when given, else the device's memory: a GPU's;
on CPU the host's available memory shared by the node's ranks) leaves beside what the rank already holds: the larger
of what the process holds at a call's start (the most seen so far: the device's allocations on a GPU; on CPU with
``usp.memory_gib`` its resident set, interpreter and libraries included) and what the cost model says the model's
states take between steps (:func:`ds_usp.cost.model_state_memory`), plus what the step allocates for them
(ZeRO-3's gathered parameters, :func:`ds_usp.cost.step_only_states`). So a given ``usp.memory_gib`` bounds the rank's whole peak, and
a budget no plan fits is refused by name (:class:`MemoryBudgetError`) with what the smallest plan needs; without it
the plan that holds least runs. Under ZeRO-3, or with ``usp.memory_gib`` given, the ranks agree on the budget and on the tokens
(tile counts decide how often ZeRO-3 gathers; a refusal must be every rank's), one small all-reduce per call. On a
GPU, offloaded layer inputs must fit the host too: :data:`~ds_usp.cost.HEADROOM` of its available memory shared by
the node's ranks (read at the first call, agreed on likewise).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ds_usp.comm import all_reduce_max_
from ds_usp.config import USPConfigError, USPSettings, ranks_per_node
from ds_usp.cost import (GIB, HEADROOM, Calibration, FeatureModes, Features, Hardware, ModelShape, StepSettings,
                         activation_budget, attention_forward_flops, attention_memory, choose_features, features_of,
                         model_state_memory, step_only_states)
from ds_usp.log import log_rank0
from ds_usp.topology import USPTopology

MIB = 2 ** 20
CPU = Hardware(peak_tflops=1.0, efficiency=1.0, host_bw=1e9, launch_us=5.0)  # relative prices only
MemorySettings = USPSettings  # the memory stack reads the "usp" keys of the same names


class MemoryBudgetError(USPConfigError):
    """``usp.memory_gib`` leaves less than the smallest plan the ``usp`` keys allow needs."""


@dataclass(frozen=True)
class StepChoices(Features):
    """What one forward call does (:class:`ds_usp.cost.Features`), the same on every rank under ZeRO-3.

    Attributes:
        tokens: tokens this rank holds (batch x local length); the largest over the ranks under ZeRO-3.
        budget: the bytes the activations were planned into (0: none known).
        predicted: the bytes the cost model predicts the activations take.
        seconds: what the features add to the step, as the cost model prices them.
        gathered: the bytes the step allocates for the model beside its activations, left out of the budget
            (ZeRO-3's gathered parameters, :func:`ds_usp.cost.step_only_states`): a step grows what the rank holds at
            its start by about ``predicted + gathered``.
    """

    tokens: int = 0
    budget: float = 0.0
    predicted: float = 0.0
    seconds: float = 0.0
    gathered: float = 0.0


M_MMAP_THRESHOLD, HEAP_THRESHOLD = -3, 64 * 1024  # glibc's mallopt parameter; the threshold the budget sets
HELD_GRAIN = 64 * MIB  # what the rank holds is counted in steps of this, so that choices are made again rarely


@functools.lru_cache(maxsize=None)
def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim_host_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim(0)``; a no-op elsewhere).

    Tensors on CPU come from malloc: a freed block below glibc's mmap threshold (up to 32 MiB) stays resident,
    so layer after layer the resident set grows with what was freed. Trimming costs a walk over the free lists
    and a page fault when a page is reused.
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def bound_host_heap() -> bool:
    """Make this process's resident set follow its live tensors: glibc's mmap threshold fixed at 64 KiB, so a freed
    tensor leaves the resident set. By default the threshold rises up to 32 MiB as large blocks are freed, and a freed
    block below it stays resident: a CPU step's resident peak then ran 24-35% above its live bytes, which the cost model
    predicts (tests/test_plan.py measures live bytes this way). Done once per process, when ``usp.memory_gib`` is given
    on CPU; it costs a system call per large allocation. False where the C library is not glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, HEAP_THRESHOLD))


def resident_bytes() -> float:
    """This process's resident set (``VmRSS``), in bytes (0: unknown)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0.0


def host_memory_per_rank() -> float:
    """The host's available memory (``MemAvailable``) shared by the ranks of this node, in bytes (0: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0.0
    return avail / max(1, ranks_per_node(1))  # the launcher's ranks on this node (SLURM's too); 1 if it says none


@dataclass
class MemoryContext:
    """What the wrapped model shares between its top-level forward and its layers.

    The topology is the model's current call's (:attr:`topo`: under dynamic SP the degree the batch runs at);
    :attr:`choices` are the features of the current forward call, set by :meth:`choose` when a call starts and by
    :meth:`use` when a checkpointed layer is recomputed with the choices of the call that ran it.
    """

    settings: MemorySettings
    fallback_topo: Optional[USPTopology]
    layout: str
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    zero3: bool
    usp: Any = None  # the model's USPContext (ds_usp.integration.models.attention), whose call state gives the topology
    shape: Optional[ModelShape] = None  # the cost model's view of the model (None: only forced features, by tile_mib)
    step: Optional[StepSettings] = None  # the layout and ZeRO settings, for the model's states in the budget
    choices: Optional[StepChoices] = field(default=None)
    offload: Any = None  # the checkpointed inputs in host memory (ds_usp.integration.step.recompute.Offload)
    held: Optional[float] = None  # bytes the rank holds before its step (None: measured at every call)
    _memory: Optional[float] = field(default=None, repr=False)  # the rank's memory (bytes), read at the first call
    _held_seen: float = field(default=0.0, repr=False)  # the most the rank held at a call's start, measured
    _host: float = field(default=0.0, repr=False)  # host bytes offloaded inputs may take (GPU; 0: unknown), read once
    _known: dict = field(default_factory=dict, repr=False)  # tokens -> choices already made
    _logged: set = field(default_factory=set, repr=False)

    @property
    def topo(self) -> Optional[USPTopology]:
        """The topology of the model's current call."""
        return self.usp.topo if self.usp is not None else self.fallback_topo

    def use(self, choices: StepChoices) -> None:
        """Run with ``choices`` (a recomputation: those of the call that ran the layer)."""
        self.choices = choices

    def choose(self, tokens: int, device: torch.device, dtype: torch.dtype) -> StepChoices:
        """Decide and use the features of a forward call over ``tokens`` tokens per rank (:meth:`make_choices`)."""
        self.choices = self.make_choices(tokens, device, dtype)
        return self.choices

    def make_choices(self, tokens: int, device: torch.device, dtype: torch.dtype) -> StepChoices:
        """The features for a forward call over ``tokens`` tokens per rank (see the module docstring).

        Args:
            tokens: batch x local sequence length of this rank.
            device: the activations' device.
            dtype: the activations' dtype.

        Returns:
            The choices (logged on rank 0 the first time they are made for a length).

        Raises:
            MemoryBudgetError: ``usp.memory_gib`` is given and no plan the ``usp`` keys allow fits it (on every rank:
                they agreed on the budget and the tokens first).
        """
        memory, held, host = self._rank_memory(device)
        given = getattr(self.settings, "memory_gib", None) is not None
        whole = self.usp is not None and self.usp.unsharded  # generation: each rank alone, no collective
        if (self.zero3 or given) and not whole and dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor([tokens, -int(memory // MIB), int(held // MIB), -int(min(host, 2 ** 62) // MIB)],
                                  dtype=torch.int64, device=_group_device(device))
            all_reduce_max_(agreed, self.topo.sp_dp_group, "the tokens and memory of a step")
            tokens, neg_mib, held_mib, neg_host = agreed.tolist()  # one read of the device's values
            memory, held, host = -float(neg_mib) * MIB, float(held_mib) * MIB, -float(neg_host) * MIB
        key = (tokens, dtype, memory, held, host)
        if key not in self._known:
            self._known[key] = self._decide(tokens, device, dtype.itemsize, memory, held, host)  # (no tensor made)
        choices = self._known[key]
        over = choices.predicted > choices.budget
        if over and given:
            raise MemoryBudgetError(_refusal(self.settings.memory_gib, choices, self.layers))
        if key not in self._logged:
            self._logged.add(key)
            log_rank0(f"usp memory features at {tokens} tokens per rank: {choices.describe(self.layers)}"
                      + (f" (predicted {choices.predicted / GIB:.2f} GiB of a {choices.budget / GIB:.2f} GiB budget "
                         f"for activations{': nothing fits, these hold the least' if over else ''}; the features "
                         f"add about {choices.seconds:.3g} s)" if choices.budget else ""))
        return choices

    def _rank_memory(self, device: torch.device) -> tuple[float, float, float]:
        """``(memory, held, host)``: the memory one rank's step may use (``usp.memory_gib``, else the device's; read
        at the first call), what the process holds of it before this call (the most seen so far, rounded up to
        :data:`HELD_GRAIN`: what the first step allocates late, such as gradient buffers and optimizer states, counts
        from the next call on; :attr:`held` when given), and (on a GPU) the host bytes its offloaded layer inputs may
        take (see the module docstring)."""
        given = getattr(self.settings, "memory_gib", None)
        cuda = device.type == "cuda"
        if self._memory is None:
            if given is not None:
                self._memory = float(given) * GIB
                if not cuda and self.held is None:  # the budget bounds the resident set: let it follow the tensors
                    bound_host_heap()
                    trim_host_heap()
            elif cuda:
                self._memory = float(torch.cuda.get_device_properties(device).total_memory)
            else:
                self._memory = host_memory_per_rank()  # what is free already: nothing held counts against it
            self._host = HEADROOM * host_memory_per_rank() if cuda else 0.0  # CPU: nothing to offload to
        if self.held is not None:
            return self._memory, self.held, self._host
        now = (float(torch.cuda.memory_allocated(device)) if cuda else resident_bytes() if given is not None else 0.0)
        self._held_seen = max(self._held_seen, math.ceil(now / HELD_GRAIN) * HELD_GRAIN)
        return self._memory, self._held_seen, self._host

    def _decide(self, tokens: int, device: torch.device, elem: int, memory: float, held: float,
                host: float) -> StepChoices:
        s = self.settings
        modes = FeatureModes(s.chunked_loss, s.tiled_mlp, s.activation_checkpointing, s.offload_activations,
                             s.tile_mib)
        if self.shape is None or not memory:  # no cost model: the features set to true, sized by the tile budget
            forced = StepSettings(1, 1, checkpointing=s.activation_checkpointing if s.activation_checkpointing in
                                  ("selective", "full") else "", tiled_mlp=s.tiled_mlp is True,
                                  chunked_loss=s.chunked_loss is True, offload_activations=s.offload_activations is True,
                                  tile_mib=s.tile_mib or 128.0)
            shape = self.shape or ModelShape("the model", self.hidden, self.layers, 1, 1, 1, 1, self.vocab,
                                             self.intermediate, 0, 0)
            return StepChoices(**vars(features_of(shape, tokens, forced)), tokens=tokens)
        topo = self.topo
        step = self.step or StepSettings(topo.ulysses_degree, topo.ring_degree, topo.dp_size, 3 if self.zero3 else 2)
        # what the step holds besides its activations: what the rank holds as the call starts (at least the model's
        # states that outlive a step), and what the step allocates for the model (ZeRO-3's gathered parameters, not
        # yet gathered then; on CPU the resident set dwarfs the states, and taking the larger of the two alone left
        # them out: 73 MiB of a 951 MiB budget for benchmarks/long_seq.py's tight row)
        in_step = step_only_states(self.shape, step, elem)
        budget = activation_budget(memory, max(held, sum(model_state_memory(self.shape, step, elem)) - in_step)
                                   + in_step)
        seq = tokens * topo.sp_size  # the whole rows' length (a batch's rows: b x S over the group)
        att = attention_memory(1, seq, self.shape.heads, self.shape.kv_heads, self.shape.head_dim, topo.ulysses_degree,
                               topo.ring_degree, elem)
        cuda = device.type == "cuda"
        features, predicted, seconds = choose_features(
            self.shape, tokens, modes, budget, Hardware() if cuda else CPU, elem, att.backward_peak,
            attention_forward_flops(self.shape, seq) / topo.sp_size, cuda, Calibration(),
            host_budget=host if host > 0 else math.inf, ulysses=topo.ulysses_degree)
        return StepChoices(**vars(features), tokens=tokens, budget=budget, predicted=predicted, seconds=seconds,
                           gathered=in_step)


def _refusal(gib: float, choices: StepChoices, layers: int) -> str:
    """Why ``usp.memory_gib`` cannot hold the step, and what the smallest plan needs."""
    holds = gib * GIB - choices.budget / HEADROOM  # what the rank holds, and what its step gathers of the model
    want = math.ceil((holds + choices.predicted / HEADROOM) / GIB * 100) / 100  # the least memory_gib that fits it
    return (f"usp.memory_gib ({gib:g}) is too small for {choices.tokens} tokens per rank: the rank holds "
            f"{holds / GIB:.2f} GiB besides the step's activations (model states, ZeRO-3's gathered parameters, "
            f"buffers; on CPU the process itself), and "
            f"{HEADROOM:.0%} of the rest, {max(choices.budget, 0.0) / GIB:.2f} GiB, is the step's; the plan that "
            f"holds least of those the usp keys allow ({choices.describe(layers)}) needs {choices.predicted / GIB:.2f} "
            f"GiB. Set usp.memory_gib to at least {want:g}, spread the sequence over more sequence-parallel ranks, or "
            f"shorten it.")


def _group_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")
