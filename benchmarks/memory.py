"""Peak memory of attention forward+backward per rank (issue 6): one rank's full attention vs each USP split.

Run (4 CPU ranks over gloo; on a CUDA machine the same command measures the GPUs):

    deepspeed --num_gpus 4 benchmarks/memory.py --seqs 2048,4096,8192 --heads 8 --head-dim 64 --dtype fp32 \
        --causal --plot docs/img/memory.png

For each sequence length S it measures, after one untimed warm-up call of the same shapes:

* ``single``: rank 0 runs ``F.scaled_dot_product_attention`` forward and backward over the whole
  sequence (the other ranks wait at a barrier);
* every ``(U, R)`` split of ``N`` ranks for each ``N`` in ``--sp`` (default: the world size and half
  of it): ``ds_usp.usp_attention`` on zigzag shards of ``S/N`` tokens; with ``N`` below the world
  size the other ranks form further SP groups (data parallel replicas) running the same thing.

What is counted ("beyond the inputs"): the bytes of every tensor storage that an ATen op allocates
between the start of the forward and the end of the backward, while it is alive: the output, what
autograd saves for the backward, the all-to-all send/receive buffers and the ring's K/V and dK/dV
buffers, fp32 accumulators, and the q/k/v gradients (alive at the end). Not counted: the inputs
q, k, v and the output gradient dout, which exist before (their bytes are printed separately, and
``ratio+in`` is the ratio with them added on both sides). On CPU two meters run at the same time:

* ``tracked``: a ``TorchDispatchMode`` that sees every ATen op's outputs, registers each new storage
  (not a view or in-place result of an argument) with its size, and drops it when the storage dies
  (a weakref finalizer on the storage object, which PyTorch keeps alive exactly as long as the
  storage). ds-usp's ``torch.library`` custom ops are entered (the mode runs their Python bodies), so
  the buffers inside them count too. It attributes each byte to the op and the ds-usp source line that
  allocated it: the breakdown printed at the peak.
* ``allocator`` (a cross-check): ``torch.profiler`` with ``profile_memory=True``: the allocations
  and frees of PyTorch's CPU allocator, in time order, cumulated; its maximum. It also sees scratch
  buffers inside kernels (SDPA's backward: about 1 MiB here), which the tracker cannot. But it
  records only what happens on threads with the profiler on: when gloo's worker thread drops the
  last reference to a communication buffer (it holds one until the transfer's work object goes
  away; which thread is last varies from run to run) the free is never recorded, and every later
  moment is overcounted by that buffer. So it is an upper bound that is sometimes off by one
  all-to-all buffer.

The reported peak is the tracker's; the allocator's is printed beside it. On CUDA:
``torch.cuda.max_memory_allocated`` minus the allocation before the call (the inputs), after
``torch.cuda.reset_peak_memory_stats``.

Beside each split the model :func:`ds_usp.cost.attention_memory` is printed (``model`` columns:
``output + saved`` beside ``kept``, ``forward_peak`` beside the forward's peak, ``backward_peak``
beside the backward's peak beyond ``kept``), so that the table shows how close the model is.

Target (issue 6): per-rank peak <= 1.2 x (single-rank peak / N), printed as ``ratio`` =
per-rank peak / (single-rank peak / N) per split and S. Also printed: ``kept``, the bytes alive
between the forward and the backward (the output and what autograd saved): what one attention layer
holds while the rest of the model runs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ds_usp
from _common import (DTYPES, MIB, NATIVE_OP, close_distributed, comma_list, init_distributed, log, parse, parser,
                     random_qkv, save_results, sdpa, split_refusal, splits, table)
from ds_usp.cost import AttentionMemory, attention_memory
from ds_usp.sharding import padded_length

TARGET = 1.2  # issue 6: per-rank peak <= 1.2 x single-rank peak / N
# Seconds to wait after the forward before reading what it kept: a communication buffer lives until the
# transfer's work object is dropped, sometimes on gloo's worker thread a moment after the forward returned.
KEPT_SETTLE_S = 0.2


# ----------------------------------------------------------------------------------------- meters


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _call_site() -> str:
    """The innermost ds-usp source line (file:line function) on the Python stack, else a placeholder."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename.replace(os.sep, "/")
        if "/ds_usp/" in f:
            return f"{f.split('/ds_usp/')[-1]}:{frame.lineno} {frame.name}"
    return "autograd engine / torch"


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages that ATen ops allocate while this mode is active, and their peak.

    ds-usp's attention is ``torch.library`` custom ops, whose bodies a dispatch mode does not see into;
    the mode runs their Python bodies itself, so that the buffers allocated inside are counted too.

    Args:
        exclude: tensors that exist before (the inputs): their storages are never counted, nor views of them.
        attribute: remember which op and source line allocated each storage (for :attr:`at_peak`).
    """

    def __init__(self, exclude: Sequence[Tensor] = (), attribute: bool = True) -> None:
        super().__init__()
        self._external = {_storage_key(t) for t in exclude}
        self._bytes: dict[int, int] = {}
        self._label: dict[int, str] = {}
        self._attribute = attribute
        self.live = 0
        self.peak = 0
        self.phase_peak = 0  # the most live bytes since the last :meth:`mark`
        self.at_peak: dict[str, list[int]] = {}  # label -> [bytes, tensors]

    def mark(self) -> int:
        """Start a new phase: the most bytes live since the last mark (or the start); then reset to the live bytes."""
        most, self.phase_peak = self.phase_peak, self.live
        return most

    def _free(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)
        self._label.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        opdef = OPDEFS.get(func._schema.name) if func.namespace == "ds_usp" else None
        if opdef is not None:  # one of ds-usp's custom ops: run its body under this mode to see its buffers
            with self:
                out = opdef._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        arg_keys: Optional[set[int]] = None
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key, n = st._cdata, st.nbytes()
            if n == 0 or key in self._bytes or key in self._external:
                continue
            if arg_keys is None:
                arg_keys = {_storage_key(x) for x in tree_leaves((args, kwargs)) if isinstance(x, Tensor)}
            if key in arg_keys:
                continue  # a view or an in-place/out= result of an argument not allocated here
            self._bytes[key] = n
            if self._attribute:
                dtype = str(t.dtype).replace("torch.", "")
                self._label[key] = f"{func.__name__.split('.')[0]} {dtype} @ {_call_site()}"
            weakref.finalize(st, self._free, key)
            self.live += n
            self.phase_peak = max(self.phase_peak, self.live)
            if self.live > self.peak:
                self.peak = self.live
                if self._attribute:
                    snap: dict[str, list[int]] = {}
                    for k, b in self._bytes.items():
                        entry = snap.setdefault(self._label[k], [0, 0])
                        entry[0] += b
                        entry[1] += 1
                    self.at_peak = snap
        return out


def allocator_peak(prof: Any) -> int:
    """Largest cumulated CPU allocation (allocations minus frees, in time order) recorded by ``prof``."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@dataclass
class Peak:
    """One rank's measurement (bytes)."""

    allocator: int  # CPU: profiler (an upper bound, see the module docstring); CUDA: max_memory_allocated - baseline
    tracked: int  # CPU: LiveBytes (0 on CUDA)
    inputs: int  # q, k, v, dout of this rank
    kept: int  # alive between forward and backward: the output and what autograd saved
    forward: int  # the most alive during the forward
    backward: int  # the most alive during the backward beyond ``kept``
    at_peak: dict[str, list[int]] = field(default_factory=dict)  # label -> [bytes, tensors]

    @property
    def peak(self) -> int:
        """The reported peak: the tracker's on CPU, the CUDA allocator's on CUDA."""
        return self.tracked if self.tracked else self.allocator


def measure(forward: Callable[[], Tensor], dout: Tensor, inputs: Sequence[Tensor], device: torch.device) -> Peak:
    """Peak memory of ``forward()`` and ``out.backward(dout)`` beyond ``inputs`` (and ``dout``), one warm-up call first.

    Also records what is alive between the two (the output and what autograd saved for the backward),
    the forward's peak, and the backward's peak beyond that.
    """
    forward().backward(dout)
    for t in inputs:
        t.grad = None
    n_in = sum(t.untyped_storage().nbytes() for t in list(inputs) + [dout])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = forward()
        torch.cuda.synchronize(device)
        time.sleep(KEPT_SETTLE_S)
        kept = torch.cuda.memory_allocated(device) - base
        fwd = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        out.backward(dout)
        torch.cuda.synchronize(device)
        bwd = torch.cuda.max_memory_allocated(device) - base
        return Peak(max(fwd, bwd), 0, n_in, kept, fwd, bwd - kept)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with LiveBytes(exclude=list(inputs) + [dout]) as meter:
            out = forward()
            time.sleep(KEPT_SETTLE_S)  # let gloo's worker thread drop its reference to the last send buffer
            kept, fwd = meter.live, meter.mark()
            out.backward(dout)
    return Peak(allocator_peak(prof), meter.peak, n_in, kept, fwd, meter.mark() - kept, meter.at_peak)


# ----------------------------------------------------------------------------------------- runs


@dataclass
class Row:
    """One method at one length, with the peak of every rank that ran it and, for a split, the model."""

    seq: int
    label: str  # "single" or "UxR"
    n: int  # ranks sharing the sequence (1 for single)
    ulysses: int
    ring: int
    peaks: list[Peak]  # per rank that ran it
    model: Optional[AttentionMemory] = None  # a split's ds_usp.cost.attention_memory

    @property
    def worst(self) -> Peak:
        """The rank with the largest peak."""
        return max(self.peaks, key=lambda p: p.peak)


def run_single(args: argparse.Namespace, seq: int, device: torch.device) -> Optional[Peak]:
    """Rank 0: whole-sequence SDPA forward+backward; others return None."""
    if dist.get_rank() != 0:
        return None
    q, k, v, dout = random_qkv(args.batch, seq, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype],
                               device, args.seed + seq)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    return measure(lambda: sdpa(q, k, v, args.causal), dout, [q, k, v], device)


def run_usp(args: argparse.Namespace, seq: int, topo: Any, device: torch.device) -> Peak:
    """This rank: ``usp_attention`` forward+backward on its zigzag shard."""
    s_local = padded_length(seq, topo.ulysses_degree, topo.ring_degree, "zigzag") // topo.sp_size
    q, k, v, dout = random_qkv(args.batch, s_local, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype],
                               device, args.seed + seq * 1000 + topo.rank)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def forward() -> Tensor:
        return ds_usp.usp_attention(q, k, v, topo, causal=args.causal, layout="zigzag", seq_len=seq,
                                    native_op=NATIVE_OP[args.native_op])

    return measure(forward, dout, [q, k, v], device)


def model(args: argparse.Namespace, seq: int, ulysses: int, ring: int) -> AttentionMemory:
    """:func:`ds_usp.cost.attention_memory` of this split at ``seq`` (padded as ds-usp pads it)."""
    e = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    return attention_memory(args.batch, padded_length(seq, ulysses, ring, "zigzag"), args.heads, args.kv_heads,
                            args.head_dim, ulysses, ring, e)


def gather_peaks(peak: Optional[Peak]) -> list[Peak]:
    """Every rank's :class:`Peak` (ranks with None left out), on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if peak is None else asdict(peak))
    return [Peak(**p) for p in everyone if p is not None]


# ----------------------------------------------------------------------------------------- report


def cells(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The table's columns per row (MiB, the rank with the largest peak; ratios to the single row of the same S)."""
    singles = {r.seq: r.worst for r in rows if r.label == "single"}
    out = []
    for row in rows:
        w, s, m = row.worst, singles[row.seq], row.model
        ideal = s.peak / row.n if m else None
        out.append({"S": row.seq, "method": row.label, "N": row.n, "peak MiB": w.peak / MIB,
                    "alloc MiB": w.allocator / MIB, "single/N": ideal and ideal / MIB,
                    "ratio": ideal and w.peak / ideal,
                    "target": ("ok" if w.peak <= TARGET * ideal else "MISS") if ideal else "-",
                    "in MiB": w.inputs / MIB, "ratio+in": ideal and (w.peak + w.inputs) / ((s.peak + s.inputs) / row.n),
                    "kept MiB": w.kept / MIB, "model kept": m and (m.output + m.saved) / MIB,
                    "kept ratio": ideal and s.kept and w.kept / (s.kept / row.n),
                    "fwd MiB": w.forward / MIB, "model fwd": m and m.forward_peak / MIB,
                    "bwd MiB": w.backward / MIB, "model bwd": m and m.backward_peak / MIB})
    return out


def render(args: argparse.Namespace, world: int, rows: Sequence[Row], device: torch.device) -> str:
    """The table: per S the single-rank row, then every split with its ratio to single/N and the model."""
    meter = "tracked (dispatch mode), allocator (torch.profiler) as a cross-check" if device.type == "cpu" else \
        "torch.cuda.max_memory_allocated"
    rows_ = cells(rows)
    fmt = {c: ".2f" for c in rows_[0] if c not in ("S", "N")}
    return "\n".join([
        f"attention fwd+bwd peak memory per rank beyond the inputs: world={world}, batch={args.batch}, "
        f"H={args.heads}, H_kv={args.kv_heads}, D={args.head_dim}, {args.dtype}, "
        f"{'causal' if args.causal else 'non-causal'}, zigzag, native_op={args.native_op}, {device.type}; "
        f"meter: {meter}",
        table(rows_, fmt=fmt),
        "columns: peak = the tracker's on CPU (live tensor storages allocated by ATen ops, ds-usp's custom ops",
        "  entered; the rank with the largest peak); alloc = CPU allocator peak from the profiler's memory events",
        "  (cross-check: adds kernel scratch, and overcounts when a gloo thread frees a comm buffer: see the module",
        f"  docstring); ratio = peak / (single peak / N), target <= {TARGET} (issue 6); in = q, k, v, dout of the",
        "  rank; ratio+in = the same ratio with the inputs added on both sides; kept = alive between forward and",
        "  backward (the output and what autograd saved for the backward: what a layer holds while the rest of the",
        "  model runs), kept ratio = kept / (single kept / N); fwd = the forward's peak, bwd = the backward's",
        "  peak beyond kept. model = ds_usp.cost.attention_memory: output + saved, forward_peak, backward_peak.",
    ])


def render_breakdown(rows: Sequence[Row], seq: int, top: int) -> str:
    """What is alive at the tracked peak, per method, at length ``seq`` (largest first)."""
    lines = [f"live at the tracked peak, S={seq}: MiB, tensors, allocating op and dtype @ innermost ds-usp line "
             f"('autograd engine / torch' = no ds-usp frame: autograd's own ops, or torch's SDPA):"]
    for row in rows:
        if row.seq != seq or not row.worst.at_peak:
            continue
        w = row.worst
        items = sorted(w.at_peak.items(), key=lambda kv: -kv[1][0])
        lines.append(f"  {row.label} (N={row.n}) total {w.tracked / MIB:.2f}:")
        lines += [f"    {b / MIB:8.2f} {n:>2}x {name}" for name, (b, n) in items[:top]]
        rest = sum(b for _, (b, _n) in items[top:])
        if rest:
            lines.append(f"    {rest / MIB:8.2f}     other")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, title: str) -> None:
    """Two panels: peak MiB vs S (single/N ideal and each split), and ratio vs S with the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    singles = {r.seq: r.worst.peak for r in rows if r.label == "single"}
    seqs = sorted(singles)
    ns = sorted({r.n for r in rows if r.label != "single"}, reverse=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = "osd^v<>"
    for n in ns:
        axes[0].plot(seqs, [singles[s] / n / MIB for s in seqs], "k--" if n == ns[0] else "k:", lw=1,
                     label=f"single / {n}")
    for i, label in enumerate(dict.fromkeys(r.label for r in rows if r.label != "single")):
        pts = sorted((r.seq, r.worst.peak, r.n) for r in rows if r.label == label)
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1] / MIB for p in pts], marker=markers[i % len(markers)], label=f"USP {label}")
        axes[1].plot(xs, [p[1] / (singles[p[0]] / p[2]) for p in pts], marker=markers[i % len(markers)],
                     label=f"{label} (N={pts[0][2]})")
    axes[1].axhline(TARGET, color="r", ls="--", lw=1, label=f"target {TARGET}")
    axes[1].axhline(1.0, color="k", ls=":", lw=1)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.set_xlabel("sequence length S")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log", base=2)
    axes[0].set_ylabel("peak MiB per rank (beyond inputs)")
    axes[1].set_ylabel("per-rank peak / (single peak / N)")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The shared flags (``--seqs`` as a list, one ``--dtype``) and the memory benchmark's own."""
    p = parser("peak memory of attention fwd+bwd per rank: single rank vs USP splits", seq=[2048, 4096, 8192])
    p.add_argument("--sp", type=comma_list(int), default=None,
                   help="SP sizes N to measure (default: the world size and half of it)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--breakdown", type=int, default=10, help="top entries of the at-peak breakdown (0: none)")
    p.add_argument("--plot", default=None, help="write a PNG here (rank 0, needs matplotlib)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a split misses the target")
    return parse(p, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure, print the table (rank 0); with ``--strict`` exit 1 if a split misses the target."""
    args = parse_args(argv)
    device = init_distributed(args.timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    sps = args.sp or sorted({world, world // 2} - {0, 1}, reverse=True)
    plans = [(n, u, r) for n in sps for u, r in splits(n)]
    topos = {(u, r): ds_usp.USPTopology.build(u, r, timeout=datetime.timedelta(seconds=args.timeout))
             for _, u, r in plans}
    rows: list[Row] = []
    for seq in args.seqs:
        dist.barrier()
        rows.append(Row(seq, "single", 1, 1, 1, gather_peaks(run_single(args, seq, device))))
        log(f"S={seq} single: {rows[-1].worst.peak / MIB:.2f} MiB")
        for n, u, r in plans:
            skip = split_refusal(args.heads, args.kv_heads, u)
            if skip:
                log(f"S={seq} {u}x{r}: skipped, {skip}")
                continue
            dist.barrier()
            rows.append(Row(seq, f"{u}x{r}", n, u, r, gather_peaks(run_usp(args, seq, topos[(u, r)], device)),
                            model(args, seq, u, r)))
            log(f"S={seq} {u}x{r}: {rows[-1].worst.peak / MIB:.2f} MiB")
    ok = all(c["target"] != "MISS" for c in cells(rows))
    if rank == 0:
        print(render(args, world, rows, device), flush=True)
        if args.breakdown and device.type == "cpu":
            print(render_breakdown(rows, max(args.seqs), args.breakdown), flush=True)
        log(f"target (per-rank peak <= {TARGET} x single/N): {'met by every split' if ok else 'MISSED'}")
        if args.plot:
            plot(rows, args.plot, f"attention fwd+bwd peak per rank, H={args.heads}, D={args.head_dim}, "
                                  f"{args.dtype}, {'causal' if args.causal else 'full'}, {device.type}")
            log(f"plot written to {args.plot}")
        raw = [dict(c, peaks=[asdict(p) for p in r.peaks]) for c, r in zip(cells(rows), rows)]
        log(f"results written to {save_results(args.json, vars(args), raw)}")
    close_distributed()
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
