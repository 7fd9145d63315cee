"""Attention benchmark (issue 3): ds-usp's U x R splits vs DeepSpeed-Ulysses vs one rank.

Run (4 CPU ranks, gloo; NCCL when CUDA is available):

    deepspeed --num_gpus 4 benchmarks/attention.py --seq 8192 --heads 8 --kv-heads 8 --head-dim 64 \
        --dtype fp32 --iters 5 --warmup 2 --causal

In one run it times forward+backward of

* a single-rank full attention (torch SDPA over the whole sequence on rank 0, the others idle at
  a barrier): the baseline ``t_single``;
* DeepSpeed's ``DistributedAttention`` (Ulysses over all N ranks, SDPA inside), when the head
  counts allow it;
* ``ds_usp.usp_attention`` for every ``U x R = N`` split, zigzag layout, plus the contiguous layout
  (basic ring) for the splits with a ring;
* a compute-only control: every rank at once runs SDPA for its ``1/N`` of the heads, no
  communication (how much the ranks slow each other down on this machine).

Every rank runs one intra-op thread. Per iteration each rank measures wall time, CPU time of its
process (``time.process_time``: the compute thread plus gloo's transfer threads, not the time
spent descheduled) and CPU time of its compute thread (``time.thread_time``). A row's time is the
median over iterations of the slowest rank. Parallel efficiency is ``t_single / (N * t_split)``,
reported on CPU time (the emulation of one device per rank on a machine with fewer cores than
ranks) and on wall time. Every row's gathered output and q/k/v gradients are checked against the
single-rank ones. See docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (atol, rtol) of the correctness check against the single-rank output and gradients.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-4, 2e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}
TARGET_EFFICIENCY = 0.90  # issue 3: every split, on CPU time
TARGET_VS_DEEPSPEED = 1.10  # issue 3: ds-usp time / DeepSpeed-Ulysses time
TAG = "[attention-bench]"
NATIVE_OP: dict[str, Any] = {"auto": "auto", "on": True, "off": False}  # --native-op -> usp_attention(native_op=)

Step = Callable[[], Optional[Tensor]]


@dataclass
class Method:
    """One row of the table.

    Attributes:
        label: the row's name.
        kind: ``"single"``, ``"ceiling"``, ``"deepspeed"`` or ``"usp"``.
        ulysses: Ulysses degree U (the all-to-all group size).
        ring: ring degree R.
        layout: sequence layout of the shards.
        skip: why the row cannot run with these arguments (None: it runs).
    """

    label: str
    kind: str
    ulysses: int
    ring: int
    layout: str
    skip: Optional[str] = None


@dataclass
class Result:
    """Timings of one method (seconds), reduced over ranks and iterations.

    Attributes:
        wall: median over iterations of the slowest rank's wall time.
        cpu: median over iterations of the slowest rank's process CPU time.
        thread: median over iterations of the slowest rank's main-thread CPU time.
        rank_cpu: per rank, the median of its CPU time.
        max_err: largest absolute difference to the single-rank output/gradients.
        elapsed: seconds the whole measurement of this method took (warmup included).
    """

    wall: float
    cpu: float
    thread: float
    rank_cpu: list[float] = field(default_factory=list)
    max_err: float = 0.0
    elapsed: float = 0.0

    @property
    def imbalance(self) -> float:
        """Slowest rank's median CPU time over the mean rank's (1.0 = balanced)."""
        mean = sum(self.rank_cpu) / len(self.rank_cpu)
        return max(self.rank_cpu) / mean if mean > 0 else float("nan")


@dataclass
class Reference:
    """The single-rank output and gradients (rank 0 only), for the correctness check."""

    out: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed arguments; ``kv_heads`` defaults to ``heads``.
    """
    p = argparse.ArgumentParser(description="ds-usp attention benchmark (forward+backward)")
    p.add_argument("--seq", type=int, default=8192, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (the median is reported)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed iterations before them (>= 1: a first call may JIT-build the native op)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--native-op", choices=sorted(NATIVE_OP), default=None,
                   help="ds-usp's native_op setting (default: the library's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds any collective may wait before the run fails instead of hanging")
    p.add_argument("--json", default=None, help="also write the results to this file (rank 0)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    for name in ("seq", "batch", "heads", "kv_heads", "head_dim", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 1:
        p.error(f"--warmup must be >= 1 (the first call of a method is never timed), got {args.warmup}")
    if args.heads % args.kv_heads != 0:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def log(msg: str) -> None:
    """Print a progress line on rank 0."""
    if dist.get_rank() == 0:
        print(f"{TAG} {msg}", flush=True)


def splits(world: int) -> list[tuple[int, int]]:
    """Every ``(U, R)`` with ``U * R == world``, Ulysses-heaviest first."""
    return [(world // r, r) for r in range(1, world + 1) if world % r == 0]


def plan_methods(args: argparse.Namespace, world: int) -> list[Method]:
    """The rows to measure, each with a skip reason when it cannot run (a pure function: same on every rank).

    Args:
        args: the command line.
        world: number of ranks N.

    Returns:
        The methods in measurement order: single rank, compute-only ceiling, DeepSpeed-Ulysses, then the
        ds-usp splits.
    """
    from ds_usp.attention.ulysses import check_heads

    methods = [Method("single-rank SDPA", "single", 1, 1, "-")]
    ceiling_skip = None
    if args.heads % world or args.kv_heads % world:
        ceiling_skip = f"needs q heads ({args.heads}) and kv heads ({args.kv_heads}) divisible by the {world} ranks"
    methods.append(Method("compute only (ceiling)", "ceiling", world, 1, "-", ceiling_skip))
    ds_skip = None
    if args.heads % world or args.kv_heads % world:
        ds_skip = (f"DeepSpeed-Ulysses needs q heads ({args.heads}) and kv heads ({args.kv_heads}) divisible by "
                   f"the {world} ranks")
    elif args.seq % world:
        ds_skip = f"DeepSpeed-Ulysses needs the sequence ({args.seq}) divisible by the {world} ranks (no padding)"
    methods.append(Method("DeepSpeed-Ulysses", "deepspeed", world, 1, "contiguous", ds_skip))
    for u, r in splits(world):
        try:
            check_heads(args.heads, args.kv_heads, u)
            skip = None
        except ValueError as err:
            skip = f"ds-usp: {err}"
        methods.append(Method("ds-usp", "usp", u, r, "zigzag", skip))
        if r > 1:
            methods.append(Method("ds-usp (basic ring)", "usp", u, r, "contiguous", skip))
    return methods


class SDPALocal(nn.Module):
    """Torch SDPA on (batch, seq, heads, head_dim) tensors: the local attention handed to DeepSpeed."""

    def __init__(self, causal: bool, scale: float) -> None:
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention of ``(b, s, hq, d)`` queries over ``(b, s, hkv, d)`` keys/values."""
        return sdpa_bshd(q, k, v, self.causal, self.scale)


def sdpa_bshd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """``F.scaled_dot_product_attention`` on bshd tensors (transposed views, no copy)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)  # (b, h, s, d) -> (b, s, h, d)


def make_inputs(args: argparse.Namespace, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Full q, k, v and output gradient, identical on every rank (seeded generator).

    Returns:
        ``(q, k, v, dout)``, ``(b, S, h, d)`` with ``h`` = kv heads for k and v.
    """
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    b, s, d = args.batch, args.seq, args.head_dim

    def randn(h: int) -> Tensor:
        return torch.randn(b, s, h, d, generator=gen).to(device=device, dtype=dtype)

    return randn(args.heads), randn(args.kv_heads), randn(args.kv_heads), randn(args.heads)


def leaves(*xs: Tensor) -> list[Tensor]:
    """Detached copies that require grad (the inputs a timed step differentiates)."""
    return [x.detach().clone().requires_grad_(True) for x in xs]


def fwd_bwd(attn: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> Step:
    """A step that runs ``attn`` forward and backward (with gradient ``dout``) and returns the output."""

    def step() -> Tensor:
        q.grad = k.grad = v.grad = None
        out = attn(q, k, v)
        out.backward(dout)
        return out

    return step


def time_step(step: Step, args: argparse.Namespace, device: torch.device) -> tuple[Tensor, Optional[Tensor]]:
    """Run ``step`` ``warmup + iters`` times, each after a barrier, and time the last ``iters``.

    Returns:
        ``(times, last output)``; ``times`` is ``(iters, 3)`` float64: wall, process CPU, thread CPU seconds.
    """
    times = torch.zeros(args.iters, 3, dtype=torch.float64)
    out = None
    for i in range(args.warmup + args.iters):
        dist.barrier()
        w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        out = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        w1, c1, t1 = time.perf_counter(), time.process_time(), time.thread_time()
        if i >= args.warmup:
            times[i - args.warmup] = torch.tensor([w1 - w0, c1 - c0, t1 - t0], dtype=torch.float64)
    return times, out


def reduce_times(times: Tensor, only_rank0: bool, device: torch.device) -> Result:
    """Combine every rank's ``(iters, 3)`` times: per iteration the slowest rank, then the median.

    Args:
        times: this rank's times.
        only_rank0: use rank 0's times alone (the single-rank baseline).
        device: where the collective's tensors must live (CUDA for NCCL).

    Returns:
        The :class:`Result` (identical on every rank).
    """
    parts = [torch.empty_like(times, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, times.to(device))
    every = torch.stack(parts).cpu()  # (ranks, iters, 3)
    every = every[:1] if only_rank0 else every
    slowest = every.max(dim=0).values  # (iters, 3)
    med = [statistics.median(slowest[:, j].tolist()) for j in range(3)]
    rank_cpu = [statistics.median(every[r, :, 1].tolist()) for r in range(every.shape[0])]
    return Result(wall=med[0], cpu=med[1], thread=med[2], rank_cpu=rank_cpu)


def gather_contiguous(x: Tensor, group: Any) -> Tensor:
    """All-gather contiguous sequence shards (dim 1) of ``group`` in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def check(label: str, got: Sequence[Tensor], ref: Optional[Reference], dtype: torch.dtype,
          device: torch.device) -> float:
    """Compare gathered (out, dq, dk, dv) with the single-rank reference on rank 0; fail on every rank if off.

    Returns:
        The largest absolute error (same on every rank).

    Raises:
        AssertionError: on every rank, when any tensor is outside the tolerance.
    """
    atol, rtol = TOLERANCES[dtype]
    status = torch.zeros(2, dtype=torch.float64)  # (failed, max abs error)
    message = ""
    if dist.get_rank() == 0:
        if ref is None:
            raise RuntimeError("the single-rank reference must be measured before the distributed rows")
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, (ref.out, ref.dq, ref.dk, ref.dv)):
            g, r = g.float().cpu(), r.float().cpu()
            status[1] = max(status[1].item(), (g - r).abs().max().item())
            try:
                torch.testing.assert_close(g, r, atol=atol, rtol=rtol)
            except AssertionError as err:
                status[0] = 1.0
                message += f"\n{name}: {err}"
    status = status.to(device)
    dist.broadcast(status, src=0)
    status = status.cpu()
    if status[0].item():
        raise AssertionError(f"{label}: result differs from the single-rank attention (atol={atol}, rtol={rtol})"
                             f"{message or ' (details on rank 0)'}")
    return status[1].item()


def run_single(args: argparse.Namespace, device: torch.device, full: Sequence[Tensor],
               scale: float) -> tuple[Result, Optional[Reference]]:
    """Time the whole-sequence attention on rank 0 while the other ranks wait at the barrier."""
    rank0 = dist.get_rank() == 0
    step: Step = lambda: None  # noqa: E731 - idle ranks only join the barriers
    if rank0:
        q, k, v = leaves(*full[:3])
        step = fwd_bwd(lambda a, b, c: sdpa_bshd(a, b, c, args.causal, scale), q, k, v, full[3])
    times, out = time_step(step, args, device)
    ref = Reference(out.detach(), q.grad, k.grad, v.grad) if rank0 else None
    return reduce_times(times, only_rank0=True, device=device), ref


def run_ceiling(args: argparse.Namespace, device: torch.device, full: Sequence[Tensor], scale: float) -> Result:
    """Time the ideal per-rank work with no communication: every rank at once runs SDPA over the whole
    sequence for its ``1/N`` of the heads. Its efficiency is the most this machine's contention allows."""
    n, me = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = (x.chunk(n, dim=2)[me] for x in full)  # (b, S, h/N, d): head group ``me``
    q, k, v = leaves(q, k, v)
    step = fwd_bwd(lambda a, b, c: sdpa_bshd(a, b, c, args.causal, scale), q, k, v, dout.contiguous())
    times, _ = time_step(step, args, device)
    return reduce_times(times, only_rank0=False, device=device)


def run_deepspeed(args: argparse.Namespace, device: torch.device, full: Sequence[Tensor], scale: float,
                  group: Any, ref: Optional[Reference]) -> Result:
    """Time DeepSpeed's ``DistributedAttention`` (Ulysses over ``group``) on contiguous shards."""
    from deepspeed.sequence.layer import DistributedAttention

    n, me = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = (x.chunk(n, dim=1)[me] for x in full)  # contiguous shards, (b, S/N, h, d)
    q, k, v = leaves(q, k, v)
    dout = dout.contiguous()
    layer = DistributedAttention(SDPALocal(args.causal, scale), group, scatter_idx=2, gather_idx=1)
    # batch_dim_idx=0: the tensors are (batch, seq, heads, head_dim)
    times, out = time_step(fwd_bwd(lambda a, b, c: layer(a, b, c, 0), q, k, v, dout), args, device)
    result = reduce_times(times, only_rank0=False, device=device)
    with torch.no_grad():
        got = [gather_contiguous(x, group) for x in (out, q.grad, k.grad, v.grad)]
    result.max_err = check("DeepSpeed-Ulysses", got, ref, q.dtype, device)
    return result


def run_usp(args: argparse.Namespace, device: torch.device, full: Sequence[Tensor], scale: float, topo: Any,
            layout: str, label: str, ref: Optional[Reference]) -> Result:
    """Time ``ds_usp.usp_attention`` on one topology and layout."""
    import ds_usp

    q, k, v, dout = (ds_usp.shard_sequence(x, topo, dim=1, layout=layout) for x in full)
    q, k, v = leaves(q, k, v)
    dout = dout.contiguous()

    extra = {} if args.native_op is None else {"native_op": NATIVE_OP[args.native_op]}

    def attn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return ds_usp.usp_attention(a, b, c, topo, causal=args.causal, layout=layout, softmax_scale=scale,
                                    seq_len=args.seq, **extra)

    times, out = time_step(fwd_bwd(attn, q, k, v, dout), args, device)
    result = reduce_times(times, only_rank0=False, device=device)
    with torch.no_grad():
        got = [ds_usp.gather_sequence(x, topo, dim=1, layout=layout, seq_len=args.seq)
               for x in (out, q.grad, k.grad, v.grad)]
    result.max_err = check(label, got, ref, q.dtype, device)
    return result


def fmt(x: Optional[float], spec: str) -> str:
    """Format a number, or ``-`` when there is none."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render(args: argparse.Namespace, world: int, cores: int, cpu_valid: bool,
           rows: list[tuple[Method, Optional[Result]]], native: str) -> str:
    """The results table, its notes and the skipped rows, as text."""
    single = next(r for m, r in rows if m.kind == "single")
    ds = next((r for m, r in rows if m.kind == "deepspeed"), None)
    head = (f"{'method':<22} {'UxR':>4} {'layout':<10} {'wall ms':>8} {'cpu ms':>8} {'thr ms':>8} {'eff cpu':>7} "
            f"{'eff thr':>7} {'eff wall':>8} {'/DS cpu':>7} {'/DS wall':>8} {'cpu imb':>7} {'max|err|':>8} "
            f"{'target':>6}")
    lines = [f"attention fwd+bwd: N={world} ranks, S={args.seq}, batch={args.batch}, heads={args.heads}, "
             f"kv_heads={args.kv_heads}, head_dim={args.head_dim}, {args.dtype}, "
             f"{'causal' if args.causal else 'non-causal'}, iters={args.iters} (median), warmup={args.warmup}, "
             f"1 thread/rank, {cores} cores; {native}", head, "-" * len(head)]
    skipped = []
    for m, r in rows:
        if r is None:
            skipped.append(f"  {m.label} {m.ulysses}x{m.ring} {m.layout}: skipped, {m.skip}")
            continue
        n = 1 if m.kind == "single" else world
        eff_cpu = single.cpu / (n * r.cpu) if cpu_valid else None
        eff_thr = single.thread / (n * r.thread) if cpu_valid else None
        eff_wall = single.wall / (n * r.wall)
        vs_cpu = r.cpu / ds.cpu if ds is not None and cpu_valid else None
        vs_wall = r.wall / ds.wall if ds is not None else None
        target = "-"
        if m.kind == "usp" and m.layout == "zigzag":
            eff = eff_cpu if cpu_valid else eff_wall
            vs = vs_cpu if cpu_valid else vs_wall
            ok = eff >= TARGET_EFFICIENCY and (vs is None or vs <= TARGET_VS_DEEPSPEED)
            target = "ok" if ok else "MISS"
        ms = (lambda x: fmt(x * 1e3 if cpu_valid else None, ".1f"))  # noqa: E731
        lines.append(f"{m.label:<22} {f'{m.ulysses}x{m.ring}':>4} {m.layout:<10} {r.wall * 1e3:>8.1f} "
                     f"{ms(r.cpu):>8} {ms(r.thread):>8} {fmt(eff_cpu, '.2f'):>7} {fmt(eff_thr, '.2f'):>7} "
                     f"{eff_wall:>8.2f} {fmt(vs_cpu, '.2f'):>7} {fmt(vs_wall, '.2f'):>8} "
                     f"{fmt(r.imbalance if cpu_valid else None, '.2f'):>7} "
                     f"{fmt(r.max_err if m.kind in ('usp', 'deepspeed') else None, '.1e'):>8} {target:>6}")
    if skipped:
        lines += ["skipped:"] + skipped
    atol, rtol = TOLERANCES[DTYPES[args.dtype]]
    lines += [
        "notes:",
        "  times: median over iterations of the slowest rank. wall = perf_counter; cpu = process CPU time (compute",
        "    thread + gloo's transfer threads: all work done, no time descheduled or waiting); thr = CPU time of",
        "    the compute thread only (transfers excluded, as if they overlapped for free).",
        "  eff = t_single / (N x t). 'eff cpu' is the headline: one device per rank, transfers costed as CPU work.",
        "    'eff wall' is what this machine gives; with more ranks than cores it is bounded by cores/ranks = "
        f"{min(cores, world) / world:.2f}.",
        "  compute only (ceiling): every rank at once runs SDPA over the whole sequence for its 1/N of the heads,",
        "    no communication: the efficiency that contention between concurrently running ranks leaves.",
        "  /DS = time / DeepSpeed-Ulysses time (same clock); cpu imb = slowest rank's CPU / mean rank's CPU.",
        f"  target: issue 3 (at S=8192, H=8, D=64, causal, fp32): eff >= {TARGET_EFFICIENCY:.2f} and "
        f"/DS <= {TARGET_VS_DEEPSPEED:.2f}, on {'cpu' if cpu_valid else 'wall'} time, zigzag rows.",
        f"  max|err|: gathered out/dq/dk/dv vs the single-rank ones; checked with atol={atol:g}, rtol={rtol:g}.",
    ]
    if args.causal:
        lines.append("  the basic (contiguous) ring is unbalanced under a causal mask (ring rank r does r+1/2 blocks"
                     " of work, the last one the most): the reason for zigzag.")
    return "\n".join(lines)


def init(args: argparse.Namespace) -> torch.device:
    """Join the process group (NCCL on CUDA, else gloo) with a timeout, one intra-op thread per rank."""
    import deepspeed

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False,
                               timeout=datetime.timedelta(seconds=args.timeout))
    if cuda:
        torch.cuda.set_device(args.local_rank)
        return torch.device("cuda", args.local_rank)
    return torch.device("cpu")


def native_op_note(args: argparse.Namespace, device: torch.device) -> str:
    """Which implementation ds-usp's ``native_op`` setting resolved to (call after the ds-usp rows ran: cached)."""
    import ds_usp

    param = inspect.signature(ds_usp.usp_attention).parameters.get("native_op")
    if param is None:
        return "ds-usp native op: none in this ds-usp"
    setting = param.default if args.native_op is None else NATIVE_OP[args.native_op]
    try:
        from ds_usp.ops import resolve_native_op

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            used = "native op" if resolve_native_op(setting, device) is not None else "PyTorch twins"
    except Exception as err:  # noqa: BLE001 - a note, not a result
        used = f"unknown ({type(err).__name__}: {err})"
    return f"ds-usp native_op={setting!r}: {used}"


def run_method(m: Method, args: argparse.Namespace, device: torch.device, full: Sequence[Tensor], scale: float,
               ref: Optional[Reference], cache: dict[Any, Any], name: str) -> tuple[Result, Optional[Reference]]:
    """Measure one runnable method; ``cache`` keeps process groups across methods (created collectively).

    Returns:
        The result and the reference (set by the single-rank row, passed through otherwise).
    """
    import ds_usp

    timeout = datetime.timedelta(seconds=args.timeout)
    if m.kind == "single":
        return run_single(args, device, full, scale)
    if m.kind == "ceiling":
        return run_ceiling(args, device, full, scale), ref
    if m.kind == "deepspeed":
        if "deepspeed" not in cache:
            cache["deepspeed"] = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
        return run_deepspeed(args, device, full, scale, cache["deepspeed"], ref), ref
    key = (m.ulysses, m.ring)
    if key not in cache:
        cache[key] = ds_usp.USPTopology.build(m.ulysses, m.ring, timeout=timeout)
    return run_usp(args, device, full, scale, cache[key], m.layout, name, ref), ref


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Measure every method, check it, print the table (rank 0); raise on any failure."""
    args = parse_args(argv)
    device = init(args)
    import ds_usp

    if args.native_op is not None and "native_op" not in inspect.signature(ds_usp.usp_attention).parameters:
        raise SystemExit("--native-op: this ds-usp's usp_attention has no native_op parameter")
    world, rank = dist.get_world_size(), dist.get_rank()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpu_valid = device.type == "cpu"
    methods = plan_methods(args, world)
    full = make_inputs(args, device)
    scale = 1.0 / math.sqrt(args.head_dim)
    cache: dict[Any, Any] = {}
    results: dict[int, Result] = {}
    ref: Optional[Reference] = None
    runnable = [m for m in methods if m.skip is None]
    log(f"N={world} ranks on {device.type}, {cores} cores; {len(runnable)} of {len(methods)} methods run")
    for m in methods:
        if m.skip is not None:
            log(f"skip {m.label} {m.ulysses}x{m.ring} {m.layout}: {m.skip}")
    for i, m in enumerate(runnable, 1):
        name = f"({i}/{len(runnable)}) {m.label} {m.ulysses}x{m.ring} {m.layout}"
        log(f"{name}: warmup {args.warmup}, iters {args.iters} ...")
        start = time.perf_counter()
        result, ref = run_method(m, args, device, full, scale, ref, cache, name)
        result.elapsed = time.perf_counter() - start
        results[id(m)] = result
        cpu = f", cpu {result.cpu * 1e3:.1f} ms" if cpu_valid else ""
        check_note = f", check ok (max|err| {result.max_err:.1e})" if m.kind in ("usp", "deepspeed") else ""
        log(f"{name}: wall {result.wall * 1e3:.1f} ms{cpu}{check_note} [{result.elapsed:.1f} s]")
    rows = [(m, results.get(id(m))) for m in methods]
    if rank == 0:
        native = native_op_note(args, device) if any(m.kind == "usp" for m in runnable) else "ds-usp did not run"
        print(render(args, world, cores, cpu_valid, rows, native), flush=True)
        if args.json:
            payload = {"args": {k: v for k, v in vars(args).items() if k != "local_rank"}, "world": world,
                       "cores": cores, "device": device.type, "native_op": native,
                       "rows": [{"method": asdict(m), "result": None if r is None else asdict(r)} for m, r in rows]}
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
            log(f"results written to {args.json}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
