"""A deterministic count of one training step's work on CPU (issue 49): ops, matmuls, FLOPs, host syncs, big buffers.

:class:`StepMeter` is a ``TorchDispatchMode``: every aten op that runs under it (forward, backward, checkpoint
recomputation, optimizer) is counted. The counts do not depend on the machine's load, so they can guide work where no
GPU is lent (on a GPU each op is a kernel launch, each sync a stall of the host)::

    with StepMeter() as meter:
        step()
    print(meter.summary())
    json.dumps(meter.report())

What it counts (:class:`Counts`, in total and per phase):

* ``ops``: aten ops dispatched; ``kernels``: those a GPU would launch a kernel for (not views, not ``empty``, not
  ``detach``/``alias``); ``custom_ops``: Python custom ops (``torch.library.custom_op``, e.g. ds-usp's
  ``ds_usp::ring_attention``), each counted once and then run below the Python dispatch key with the meter pushed
  again, so the aten ops inside them are counted too;
* ``matmuls``: ``mm``/``addmm``/``bmm``/``baddbmm``/``addbmm`` (in place and ``out=`` included) and the smallest
  dimension any of them had (a tile's or a loss chunk's rows appear as M in a forward and as K in a weight gradient);
* ``flops``: ``torch.utils.flop_counter``'s formulas (``flop_registry``, the ones ``FlopCounterMode`` applies) in this
  mode, plus the CPU flash-attention ops and the in-place matmuls the registry lacks; attention under ``is_causal``
  is counted at half (what a flash kernel computes; torch's formulas ignore causality; applied to every system alike).
  ``FlopCounterMode`` itself is not used: its module tracker trips inside checkpointed layers;
* ``syncs``: reads of device values by the host: ``.item()``/``float()``/``bool()`` (``_local_scalar_dense``),
  ``nonzero``, ``masked_select``, ``unique``, ``equal``, boolean-mask indexing, ``repeat_interleave`` without
  ``output_size``, and ``.tolist()``/``.numpy()``/``.cpu()``/``.to("cpu")``, which dispatch nothing on CPU and are
  wrapped on ``torch.Tensor`` while the meter is on. A tensor made by such a copy is on the host, and so is what an op
  makes from a host tensor that is not a scalar (on a GPU such an op cannot take a device tensor): reading them is a
  ``host read``, not a sync, so one ``.cpu()`` followed by many ``.item()`` is one sync, as on a GPU. Each sync is
  attributed to its call site (the first frame outside torch, the standard library and this file) and flagged when
  a ``*DecoderLayer.forward`` is on the stack;
* ``host_made``: tensors made of host data (``torch.tensor`` / ``torch.as_tensor`` of Python values,
  ``torch.from_numpy``: each ``aten.lift_fresh``), by call site, flagged as syncs are: on a GPU each is a host tensor
  that a copy to the device follows;
* ``big_allocs``: op outputs over ``big_bytes`` (64 MiB) in new storage (factories included; in-place and ``out=``
  results are not new), by op and call site;
* ``sac_ops``: ops that torch's selective-checkpointing dispatch modes handled first (Python code per op);
* ``zero3_param_ops`` / ``zero3_param_kernels``: those of the ops and kernels that DeepSpeed's ZeRO-3 ran to gather
  or release parameters (a frame of ``deepspeed/runtime/zero/partition_parameters.py`` on the stack: the narrow /
  cat / view that put a parameter's gathered partitions together, the release's empty tensors): DeepSpeed's work,
  apart from the system's own (``ops - zero3_param_ops``).

Phases: ``fwd``, ``bwd`` (autograd's engine running: checkpoint recomputation included), or a name given with
:meth:`StepMeter.phase`. Call sites are paths relative to the repository, ``site-packages`` or ``sys.path``; with
``own`` path prefixes (default ``ds_usp/``) a site elsewhere also names the innermost frame under them (``via``).

Limits, by construction: on CPU every tensor is a host tensor, so a sync is a read the code would make of a device
tensor on a GPU (only tensors copied with ``.cpu()``/``.to("cpu")``, ``.to`` when its source line names ``"cpu"``,
are known to live on the host); op decompositions depend on the torch version, so counts compare only under the
same torch, transformers and DeepSpeed versions. :class:`ZeroCompute` skips the heavy kernels of warm-up steps.

:class:`LayerHostReads` (layer hooks pushing a ``TorchFunctionMode``, apart from the meter) counts the host's reads
of tensor values (``.tolist()``, ``.item()``, ``bool()``...) and the tensors it makes of host data (``torch.tensor``,
a factory such as ``torch.arange`` given no device) inside decoder layers, per forward and per recomputation, with
their call sites.
"""
from __future__ import annotations

import collections
import contextlib
import linecache
import os
import sys
import sysconfig
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
BIG_BYTES = 64 * 2 ** 20
ROOT = Path(__file__).resolve().parents[2]  # the repository (site-packages for an installed ds-usp)
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_PACKAGES = tuple(os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib"))
_HERE = os.path.abspath(__file__)
_ZERO3_PARAMS = os.path.join("deepspeed", "runtime", "zero", "partition_parameters.py")

_MATMUL_NAMES = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "_scaled_mm", "_int_mm")
MATMULS = {getattr(aten, n) for n in _MATMUL_NAMES if hasattr(aten, n)}
_ADDED = {aten.addmm, aten.baddbmm, aten.addbmm, aten.addmm_, aten.baddbmm_, aten.addbmm_}  # (self, a, b, ...)
NO_KERNEL = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.detach,
             aten.alias, aten.lift_fresh, aten._unsafe_view, aten.set_, aten.sym_size, aten.sym_stride,
             aten.sym_numel, aten.sym_storage_offset, aten.is_same_size, aten._local_scalar_dense}
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.unique_dim, aten._unique, aten._unique2,
            aten.unique_consecutive, aten.equal, aten.is_nonzero, aten.bincount, aten.histc}
_BOOL_INDEX = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
CPU_ATTENTION = {getattr(aten, n): backward for n, backward in (("_scaled_dot_product_flash_attention_for_cpu", False),
                 ("_scaled_dot_product_flash_attention_for_cpu_backward", True)) if hasattr(aten, n)}
# the kernels ZeroCompute skips: every matmul and fused attention (what a step's time is made of on CPU)
HEAVY = MATMULS | set(CPU_ATTENTION)


def _is_python_custom_op(func: Any) -> bool:
    """Whether ``func`` is a ``torch.library.custom_op`` (a Python kernel whose body dispatches aten ops)."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:  # a private module that moved: the op is counted as one, its body not seen
        return False
    return _maybe_get_opdef(func) is not None


def _argument(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The value of ``func``'s argument ``name`` (by its schema), positional or keyword."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else kwargs.get(name, default)
    return default


def matmul_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> Optional[float]:
    """FLOPs of a matmul, attention or convolution op by torch's formulas (None: not such an op).

    ``flop_registry``'s entries as ``FlopCounterMode`` applies them; in-place matmuls (``addmm_``) by their
    functional twin's formula, ``addbmm`` as the batched product it sums; the CPU flash-attention ops by
    ``sdpa_flop_count``/``sdpa_backward_flop_count``; every attention op at half under ``is_causal``.

    Args:
        func: the aten op (an ``OpOverload``).
        args: its positional arguments.
        kwargs: its keyword arguments.
        out: what it returned.

    Returns:
        The FLOPs, or None when ``func`` is none of these ops.
    """
    packet = func.overloadpacket
    if packet in CPU_ATTENTION:
        backward = CPU_ATTENTION[packet]  # (grad_out, q, k, v, ...) or (q, k, v, ...)
        shapes = [t.shape for t in args[:4 if backward else 3]]
        flops = sdpa_backward_flop_count(*shapes) if backward else sdpa_flop_count(*shapes)
    elif packet in flop_registry:
        flops = flop_registry[packet](*args, **kwargs, out_val=out)
    elif packet in (aten.addmm_, aten.baddbmm_):
        functional = aten.addmm if packet is aten.addmm_ else aten.baddbmm
        flops = flop_registry[functional](*args, **kwargs, out_val=out)
    elif packet in (aten.addbmm, aten.addbmm_):
        b, m, k = args[1].shape
        flops = 2 * b * m * k * args[2].shape[-1]
    else:
        return None
    if "attention" in str(packet) and _argument(func, args, kwargs, "is_causal", False):
        flops *= 0.5
    return float(flops)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storages(x: Any) -> set[int]:
    return {_storage(t) for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"}


def short_path(path: str) -> str:
    """``path`` relative to the repository, ``site-packages`` or the longest ``sys.path`` entry holding it.

    Args:
        path: a source file's path.

    Returns:
        The short form (``path`` itself, absolute, when none of them holds it).
    """
    full = os.path.abspath(path)
    try:
        return str(Path(full).relative_to(ROOT))
    except ValueError:
        pass
    if "site-packages" + os.sep in full:
        return full.split("site-packages" + os.sep, 1)[1]
    for entry in sorted((os.path.join(os.path.abspath(p), "") for p in sys.path if p), key=len, reverse=True):
        if full.startswith(entry):
            return full[len(entry):]
    return full


def _in_zero3_params() -> bool:
    """Whether DeepSpeed's ZeRO-3 parameter gathering or release is on the stack (see ``zero3_param_ops``)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.endswith(_ZERO3_PARAMS):
            return True
        f = f.f_back
    return False


@dataclass
class Counts:
    """What the meter counted (a whole step or one phase)."""

    ops: int = 0
    kernels: int = 0
    custom_ops: int = 0
    sac_ops: int = 0
    matmuls: int = 0
    matmul_min_dim: Optional[int] = None
    flops: float = 0.0
    syncs: int = 0
    host_made: int = 0
    big_allocs: int = 0
    big_alloc_bytes: int = 0
    zero3_param_ops: int = 0
    zero3_param_kernels: int = 0

    def describe(self) -> str:
        """The counts in one line.

        Returns:
            The line.
        """
        return (f"{self.ops} ops ({self.kernels} kernels, {self.custom_ops} custom, {self.sac_ops} through SAC), "
                f"{self.matmuls} matmuls (smallest dim {self.matmul_min_dim}), {self.flops / 1e12:.4f} TFLOP, "
                f"{self.syncs} syncs, {self.host_made} tensors made of host data, "
                f"{self.big_allocs} outputs > 64 MiB ({self.big_alloc_bytes / 2 ** 30:.2f} GiB), "
                f"{self.zero3_param_ops} ops gathering or releasing ZeRO-3 parameters")


@dataclass(frozen=True)
class Site:
    """Where an op was called from: ``site`` the first frame outside torch, the standard library and this file
    (``path:line function``); ``via`` the innermost frame under an ``own`` prefix when ``site`` is not;
    ``in_layer`` a decoder layer's forward is on the stack."""

    site: str
    via: Optional[str] = None
    in_layer: bool = False


class StepMeter(TorchDispatchMode):
    """Count the work of what runs inside it (see the module docstring).

    Args:
        big_bytes: an output over this many bytes in new storage is a big allocation.
        own: path prefixes (relative, as :func:`short_path` gives them) whose frames are named as ``via``.
    """

    def __init__(self, big_bytes: int = BIG_BYTES, own: tuple[str, ...] = ("ds_usp/",)) -> None:
        super().__init__()
        self.big_bytes, self.own = big_bytes, own
        self.total = Counts()
        self.phases: dict[str, Counts] = collections.defaultdict(Counts)
        self.flops_by_op: collections.Counter = collections.Counter()
        self.ops_by_name: collections.Counter = collections.Counter()
        self.matmul_shapes: collections.Counter = collections.Counter()  # (op, a's shape, b's shape) -> calls
        self.syncs: collections.Counter = collections.Counter()  # (kind, Site) -> count
        self.host_reads: collections.Counter = collections.Counter()  # (kind, site) -> reads of host copies
        self.host_made: collections.Counter = collections.Counter()  # (kind, Site) -> tensors made of host data
        self.allocs: collections.Counter = collections.Counter()  # (op, MiB, Site) -> count
        self._phase: Optional[str] = None
        self._host: set[int] = set()  # storages on the host: copies made by .cpu()/.to("cpu") and what they make
        self._saved: dict[tuple[Any, str], Any] = {}
        self._depth = 0  # this mode's enters (a custom op's body enters it again)
        self._in_sac = 0  # torch's selective-checkpointing modes handling the current op
        self._line = ""  # the source line of the last call site found

    # ---- phases -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator["StepMeter"]:
        """Count what runs inside under ``name`` (else ``fwd``/``bwd``, by whether autograd's engine runs).

        Args:
            name: the phase's name.

        Yields:
            The meter.
        """
        old, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = old

    def _current(self) -> Counts:
        if self._phase is not None:
            return self.phases[self._phase]
        return self.phases["bwd" if torch._C._current_graph_task_id() != -1 else "fwd"]

    # ---- call sites -------------------------------------------------------------------------------------------
    def _site(self) -> Site:
        """Where the op being counted was called from (its source line kept in :attr:`_line` for ``.to``)."""
        f = sys._getframe(1)
        site = via = None
        in_layer = False
        while f is not None:
            path = f.f_code.co_filename
            outside = not (path.startswith(_TORCH_DIR) or path.startswith("<") or os.path.abspath(path) == _HERE
                           or (path.startswith(_STDLIB) and not path.startswith(_PACKAGES)))
            if outside and (site is None or (via is None and not site.startswith(self.own))):
                where = f"{short_path(path)}:{f.f_lineno} {f.f_code.co_name}"
                if site is None:
                    site, self._line = where, linecache.getline(path, f.f_lineno)
                elif where.startswith(self.own):
                    via = where
            if f.f_code.co_name == "forward" and type(f.f_locals.get("self")).__name__.endswith("DecoderLayer"):
                in_layer = True
            f = f.f_back
        return Site(site or "<torch>", via, in_layer)

    # ---- the mode ---------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "prims") and _is_python_custom_op(func):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if tensors:  # count it, then run its kernel below the Python key with this mode pushed again
                keys = torch._C._dispatch_keys(tensors[0])
                for t in tensors[1:]:
                    keys = keys | torch._C._dispatch_keys(t)
                keys = keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
                with self:
                    out = func.redispatch(keys, *args, **kwargs)
                self._count(func, args, kwargs, out, custom=True)
                return out
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # reached only inside a custom op's body (below autograd): count what it decomposes into
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        return out

    def _count(self, func: Any, args: tuple, kwargs: dict, out: Any, custom: bool = False) -> None:
        packet = func.overloadpacket
        name = str(packet)
        phase = self._current()
        kernel = not custom and not func.is_view and packet not in NO_KERNEL
        zero3 = _in_zero3_params()
        for c in (self.total, phase):
            c.ops += 1
            c.kernels += kernel
            c.custom_ops += custom
            c.sac_ops += self._in_sac > 0
            c.zero3_param_ops += zero3
            c.zero3_param_kernels += zero3 and kernel
        self.ops_by_name[name] += 1
        flops = None if custom else matmul_flops(func, args, kwargs, out)
        if flops:
            for c in (self.total, phase):
                c.flops += flops
            self.flops_by_op[name] += flops
        if packet in MATMULS:
            a, b = (args[1], args[2]) if packet in _ADDED else (args[0], args[1])
            smallest = min(a.shape[-2], a.shape[-1], b.shape[-1])
            for c in (self.total, phase):
                c.matmuls += 1
                c.matmul_min_dim = smallest if c.matmul_min_dim is None else min(c.matmul_min_dim, smallest)
            self.matmul_shapes[(name, tuple(a.shape), tuple(b.shape))] += 1
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self._host and any(t.dim() and _storage(t) in self._host for t in inputs):
            for t in flat_out:  # on a GPU an op with a host input that is not a scalar runs on the host
                self._mark_host(t)
        if packet is aten.lift_fresh:  # torch.tensor / as_tensor of Python values, from_numpy: a copy to a GPU
            for c in (self.total, phase):
                c.host_made += 1
            self.host_made[("tensor of host data", self._site())] += 1
        if packet in SYNC_OPS or self._reads_values(packet, args, kwargs):
            if inputs and _storage(inputs[0]) in self._host:
                self.host_reads[(name, self._site().site)] += 1
            else:
                self._sync(name, self._site(), phase)
        big = [t for t in flat_out if t.untyped_storage().nbytes() > self.big_bytes]
        if big and not func.is_view and not custom:
            old = _storages((args, kwargs))  # in place or out=: the storage is an input's
            for t in big:
                if _storage(t) not in old:
                    nbytes = t.untyped_storage().nbytes()
                    for c in (self.total, phase):
                        c.big_allocs += 1
                        c.big_alloc_bytes += nbytes
                    self.allocs[(name, nbytes >> 20, self._site())] += 1

    @staticmethod
    def _reads_values(packet: Any, args: tuple, kwargs: dict) -> bool:
        """Ops whose output shape depends on a tensor's values (the host must read them)."""
        if packet in _BOOL_INDEX:
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))
        return (packet is aten.repeat_interleave and len(args) > 1 and isinstance(args[1], torch.Tensor)
                and kwargs.get("output_size") is None)

    def _sync(self, kind: str, site: Site, phase: Counts) -> None:
        for c in (self.total, phase):
            c.syncs += 1
        self.syncs[(kind, site)] += 1

    def _mark_host(self, t: torch.Tensor) -> None:
        ptr = _storage(t)
        if ptr and ptr not in self._host:
            self._host.add(ptr)
            weakref.finalize(t, self._host.discard, ptr)

    # ---- host copies that dispatch nothing on CPU, and torch's selective-checkpointing modes -------------------
    def __enter__(self) -> "StepMeter":
        if self._depth == 0:
            self._wrap()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:  # the outermost exit: a custom op's body exits the mode it re-entered first
            for (owner, attr), original in self._saved.items():
                setattr(owner, attr, original)
            self._saved = {}

    def _wrap(self) -> None:
        meter = self

        def host_copy(name: str) -> None:
            original = getattr(torch.Tensor, name)

            def method(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if name == "to" and not any(str(a) == "cpu" for a in (*args, kwargs.get("device"))):
                    return original(t, *args, **kwargs)
                site = meter._site()
                if name == "to" and "'cpu'" not in meter._line and '"cpu"' not in meter._line:  # .to(x.device)
                    return original(t, *args, **kwargs)
                if _storage(t) in meter._host:
                    meter.host_reads[(f".{name}()", site.site)] += 1
                else:
                    meter._sync(f".{name}()", site, meter._current())
                out = original(t, *args, **kwargs)
                if isinstance(out, torch.Tensor):
                    if _storage(out) == _storage(t):  # the CPU's .cpu() is the tensor itself: a distinct host copy
                        with _disable_current_modes():
                            out = t.clone()
                    meter._mark_host(out)
                return out

            self._saved[(torch.Tensor, name)] = original
            setattr(torch.Tensor, name, method)

        for name in ("tolist", "numpy", "cpu", "to"):
            host_copy(name)
        import torch.utils.checkpoint as ckpt

        for cls_name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"):
            cls = getattr(ckpt, cls_name, None)
            if cls is None:
                continue
            original = cls.__dict__["__torch_dispatch__"]

            def dispatch(mode: Any, *a: Any, _original: Any = original, **k: Any) -> Any:
                meter._in_sac += 1
                try:
                    return _original(mode, *a, **k)
                finally:
                    meter._in_sac -= 1

            self._saved[(cls, "__torch_dispatch__")] = original
            cls.__torch_dispatch__ = dispatch

    # ---- results ----------------------------------------------------------------------------------------------
    def report(self, top: int = 40) -> dict[str, Any]:
        """The counts as plain data (JSON): totals, phases, FLOPs and ops by op, matmul shapes, syncs and host reads
        by call site, big allocations by op, size and call site.

        Args:
            top: how many of the most frequent ops by name to keep.

        Returns:
            The report.
        """
        return {
            "total": asdict(self.total), "phases": {p: asdict(c) for p, c in self.phases.items()},
            "flops_by_op": dict(self.flops_by_op.most_common()), "ops_by_name": dict(self.ops_by_name.most_common(top)),
            "matmul_shapes": [[op, list(a), list(b), n] for (op, a, b), n in self.matmul_shapes.most_common()],
            "syncs": [dict(kind=kind, **asdict(site), count=n) for (kind, site), n in self.syncs.most_common()],
            "host_reads": [dict(kind=kind, site=site, count=n) for (kind, site), n in self.host_reads.most_common()],
            "host_made": [dict(kind=kind, **asdict(site), count=n) for (kind, site), n in self.host_made.most_common()],
            "big_allocs": [dict(op=op, mib=mib, **asdict(site), count=n) for (op, mib, site), n in
                           sorted(self.allocs.items(), key=lambda kv: (-kv[0][1] * kv[1], kv[0][2].site))],
        }

    def summary(self, top: int = 8) -> str:
        """The counts in a few lines.

        Args:
            top: how many ops, and big allocations, to name.

        Returns:
            The lines, joined.
        """
        lines = [f"total: {self.total.describe()}"] + [f"  {p}: {c.describe()}" for p, c in self.phases.items()]
        lines.append("TFLOP by op: " + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in self.flops_by_op.most_common(top)))
        lines.append("ops by name: " + ", ".join(f"{k} {v}" for k, v in self.ops_by_name.most_common(top)))
        for (kind, site), n in self.syncs.most_common():
            lines.append(f"sync {n}x {kind}{' [in a decoder layer]' if site.in_layer else ''} at {site.site}"
                         + (f" (via {site.via})" if site.via else ""))
        for (kind, site), n in self.host_made.most_common(top):
            lines.append(f"made {n}x {kind}{' [in a decoder layer]' if site.in_layer else ''} at {site.site}"
                         + (f" (via {site.via})" if site.via else ""))
        for (op, mib, site), n in sorted(self.allocs.items(), key=lambda kv: -kv[0][1] * kv[1])[:top]:
            lines.append(f"output > {self.big_bytes >> 20} MiB: {n}x {op} {mib} MiB at {site.site}"
                         + (f" (via {site.via})" if site.via else ""))
        return "\n".join(lines)


class ZeroCompute(TorchDispatchMode):
    """Matmuls and fused attention write zeros instead of computing (every other op runs): warm-up steps that only
    have to leave the state a metered step needs (optimizer states made, ZeRO-3's trace recorded) at a fraction of
    their time. Outputs keep the shapes, dtypes and strides the kernels give (from their meta kernels); in-place forms
    leave the tensors they add to as they are, ``out=`` forms zero theirs (left as they were, an uninitialized buffer
    made a warm-up's gradients non-finite now and then: the step was skipped as an overflow, and the metered step
    then counted the optimizer's state being made). tests/test_step_work.py checks that a step metered after
    such warm-ups counts exactly what it counts after real ones.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket not in HEAVY:
            return func(*args, **kwargs)
        if func._schema.is_mutable:  # addmm_ keeps what it adds to; mm.out's buffer (often torch.empty) is zeroed
            if "out" in kwargs:
                return kwargs["out"].zero_()
            return args[0]
        meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        return tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype).zero_()
                        if isinstance(m, torch.Tensor) else m, meta)


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


# ---- host reads inside decoder layers (issue 61, item 5) -------------------------------------------------------------
# Tensor methods and functions by which the host reads a tensor's values (on a GPU: waits for it) or makes a tensor
# of host data (on a GPU: a copy to the device); counted by name while a decoder layer's forward runs.
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "equal")
# ops whose output's shape depends on a tensor's values: the host waits for them as for a read
HOST_SHAPED = ("nonzero", "masked_select", "unique", "unique_consecutive", "bincount", "argwhere")
HOST_MADE = ("tensor", "as_tensor", "from_numpy", "frombuffer")
_UNSEEN_MADE = ("from_numpy", "frombuffer")  # not handed to a TorchFunctionMode: wrapped while the meter is on
# factories that make a host tensor when given no device (the CPU default): on a GPU, moved with a copy after
HOST_FACTORIES = ("arange", "zeros", "ones", "empty", "full", "eye", "linspace", "randperm")


def _caller(skip: str) -> str:
    """``path:line function`` of the first frame outside torch, the standard library and ``skip`` (a file)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        inside = path.startswith(_TORCH_DIR) or path.startswith("<") or os.path.abspath(path) == skip or (
            path.startswith(_STDLIB) and not path.startswith(_PACKAGES))
        if not inside:
            return f"{short_path(path)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "<torch>"


class LayerHostReads:
    """Count the host's reads of tensor values (:data:`HOST_READS`) and the tensors it makes from host data
    (:data:`HOST_MADE`; :data:`HOST_FACTORIES` given no device) while one of ``layers``' forwards runs, apart for the
    forward and for its recomputation in the backward (activation checkpointing)::

        with LayerHostReads(model.model.layers) as reads:
            model(**shard).logits.sum().backward()
        reads.counts()  # {"fwd": {"reads": 0, "made": 0, "module_calls": 14}, "recompute": {...}}

    Reads are :data:`HOST_READS`, the ops of :data:`HOST_SHAPED` (their output's shape is a count of values),
    boolean-mask indexing and ``.to`` a device the call's source line names ``"cpu"``; host-made tensors are
    :data:`HOST_MADE` and :data:`HOST_FACTORIES` given no device. A ``torch.overrides.TorchFunctionMode``
    (:class:`_HostCalls`) sees every torch call of Python code; it hands a custom operator on as one call, so each
    ``torch.library.custom_op`` body (ds-usp's attention) pushes it again while the meter is on; ``torch.from_numpy``
    and ``torch.frombuffer``, which it never sees, are wrapped while the meter is on.
    Module hooks push it while a layer runs: forward pre-hooks put first (so what the other pre-hooks of a layer do,
    such as cutting its inputs, counts as inside it) and always-called forward hooks, of each layer and of every
    module inside it. A layer's own hooks alone
    would miss the recomputation, which the checkpointing of transformers and of ds-usp runs below the layer's
    ``__call__``: there the modules inside the layer push it (the layer's own code between them is not seen). The
    mode is not on the stack when ``backward`` is called (a mode does not see what runs inside a call it handles). The
    hooks also count the calls of the modules inside the layers per phase (``module_calls``: equal in both phases
    when every layer was recomputed). On CPU every tensor is a host tensor: a count is what the code would read of a
    device tensor on a GPU.

    Args:
        layers: the modules whose forwards are watched (a model's decoder layers).
    """

    def __init__(self, layers: Any) -> None:
        self.layers = list(layers)
        self.by_site: collections.Counter = collections.Counter()  # (phase, kind, name, site) -> count
        self.module_calls: collections.Counter = collections.Counter()  # phase -> calls of modules inside the layers
        self._mode = _HostCalls(self.by_site)
        self._depth = 0
        self._handles: list = []
        self._unseen: dict[str, Any] = {}
        self._bodies: list[tuple[dict, Any, Any]] = []  # (a custom op's bodies, device type, its own body)

    def _enter(self, module: Any, args: Any, inner: bool) -> None:
        if inner:
            self.module_calls[_phase()] += 1
        if self._depth == 0:
            torch.overrides._push_mode(self._mode)
        self._depth += 1

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            torch.overrides._pop_mode()

    def __enter__(self) -> "LayerHostReads":
        for layer in self.layers:
            for m in layer.modules():  # first of the pre-hooks: what other pre-hooks do runs inside the layer
                self._handles.append(m.register_forward_pre_hook(
                    lambda module, args, inner=m is not layer: self._enter(module, args, inner), prepend=True))
                self._handles.append(m.register_forward_hook(self._leave, always_call=True))
        for name in _UNSEEN_MADE:  # torch functions a TorchFunctionMode never sees
            original = getattr(torch, name)
            self._unseen[name] = original

            def made(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                if self._depth:
                    self._mode.count(("made", _name))
                return _original(*args, **kwargs)

            setattr(torch, name, made)
        self._open_bodies()
        return self

    def _open_bodies(self) -> None:
        """Every custom operator's Python body (``torch.library.custom_op``: ds-usp's ring attention, its all-to-alls)
        runs with the mode pushed again while a layer runs. The mode hands such an op on as one call, and its body
        would run unseen: each body is wrapped where the dispatcher looks it up at every call."""
        for opdef in list(getattr(torch._library.custom_ops, "OPDEFS", {}).values()):
            bodies = getattr(opdef, "_backend_fns", None)
            for device_type, fn in list((bodies or {}).items()):
                def body(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
                    if not self._depth:
                        return _fn(*args, **kwargs)
                    torch.overrides._push_mode(self._mode)
                    try:
                        return _fn(*args, **kwargs)
                    finally:
                        torch.overrides._pop_mode()

                self._bodies.append((bodies, device_type, fn))
                bodies[device_type] = body

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for name, original in self._unseen.items():
            setattr(torch, name, original)
        self._unseen = {}
        for bodies, device_type, fn in reversed(self._bodies):
            bodies[device_type] = fn
        self._bodies = []

    def reset(self) -> None:
        """Forget what was counted (between steps)."""
        self.by_site.clear()
        self.module_calls.clear()

    def counts(self) -> dict[str, dict[str, int]]:
        """Per phase (``fwd``, ``recompute``): host reads, host-made tensors and calls of modules inside the layers.

        Returns:
            ``{phase: {"reads": n, "made": n, "module_calls": n}}``.
        """
        out = {phase: {"reads": 0, "made": 0, "module_calls": self.module_calls[phase]}
               for phase in ("fwd", "recompute")}
        for (phase, kind, _, _), n in self.by_site.items():
            out[phase][kind] += n
        return out

    def sites(self) -> list[str]:
        """One line per call site: ``phase kind .name count at site``.

        Returns:
            The lines, the most frequent first.
        """
        return [f"{phase} {kind} .{name} {n}x at {site}" for (phase, kind, name, site), n in self.by_site.most_common()]


def _phase() -> str:
    """``recompute`` while autograd's engine runs (checkpointed layers run again), else ``fwd``."""
    return "recompute" if torch._C._current_graph_task_id() != -1 else "fwd"


class _HostCalls(torch.overrides.TorchFunctionMode):
    """Counts the calls of :data:`HOST_READS`, :data:`HOST_SHAPED` (as reads), boolean-mask indexing, ``.to`` a
    device its source line names ``"cpu"`` (``.to(x.device)`` is the CPU on CPU, a device on a GPU) and
    :data:`HOST_MADE` into ``by_site`` by phase and call site."""

    def __init__(self, by_site: collections.Counter) -> None:
        super().__init__()
        self.by_site = by_site
        self._kinds = {**{getattr(torch.Tensor, n): ("reads", n) for n in HOST_READS},
                       **{f: ("reads", n) for n in HOST_SHAPED + ("equal",)
                          for f in (getattr(torch, n, None), getattr(torch.Tensor, n, None)) if f is not None},
                       **{getattr(torch, n): ("made", n) for n in HOST_MADE}}
        self._factories = {getattr(torch, n): ("made", n) for n in HOST_FACTORIES}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        try:
            kind = self._kinds.get(func)
            if kind is None:  # a factory given no device (the default: the CPU) makes a host tensor
                kind = self._factories.get(func)
                if kind is not None and (kwargs.get("device") is not None
                                         or torch.get_default_device().type != "cpu"):
                    kind = None
        except TypeError:  # an unhashable callable: none of ours
            kind = None
        if kind is None and func is torch.Tensor.__getitem__ and _bool_index(args[1] if len(args) > 1 else None):
            kind = ("reads", "__getitem__ by a boolean mask")
        if kind is None and func is torch.Tensor.to and _to_the_host(args[1:], kwargs):
            kind = ("reads", "to('cpu')")
        if kind is not None:
            self.count(kind)
        return func(*args, **kwargs)

    def count(self, kind: tuple[str, str]) -> None:
        """One call of ``kind`` (``(reads | made, name)``) at the caller's caller's site."""
        self.by_site[(_phase(), *kind, _caller(_HERE))] += 1


def _bool_index(index: Any) -> bool:
    """Whether an index holds a boolean tensor (its result's shape is the count of its True values)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


def _to_the_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU in its call's source line and gets it as the device."""
    device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    if device is None or torch.device(device).type != "cpu":
        return False
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR) or os.path.abspath(f.f_code.co_filename)
                             == _HERE):
        f = f.f_back
    line = linecache.getline(f.f_code.co_filename, f.f_lineno) if f is not None else ""
    return "cpu" in line
