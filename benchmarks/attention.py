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
import functools
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from _common import (DTYPES, NATIVE_OP, close_distributed, init_distributed, log, parse, parser, random_qkv,
                     save_results, sdpa, split_refusal, splits, table)

# (atol, rtol) of the correctness check against the single-rank output and gradients.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-4, 2e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}
TARGET_EFFICIENCY = 0.90  # issue 3: every split, on CPU time
TARGET_VS_DEEPSPEED = 1.10  # issue 3: ds-usp time / DeepSpeed-Ulysses time

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
    """The shared flags (one ``--seq`` and ``--dtype``, ``--iters``/``--warmup``) and ``--causal``."""
    p = parser("ds-usp attention benchmark (forward+backward)", timing=(5, 2))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    return parse(p, argv)


def plan_methods(args: Any, world: int) -> list[Method]:
    """The rows to measure, each with a skip reason when it cannot run (a pure function: same on every rank).

    Args:
        args: the command line.
        world: number of ranks N.

    Returns:
        The methods in measurement order: single rank, compute-only ceiling, DeepSpeed-Ulysses, then the
        ds-usp splits.
    """
    heads_skip = None
    if args.heads % world or args.kv_heads % world:
        heads_skip = f"needs q heads ({args.heads}) and kv heads ({args.kv_heads}) divisible by the {world} ranks"
    ds_skip = f"DeepSpeed-Ulysses {heads_skip}" if heads_skip else None
    if ds_skip is None and args.seq % world:
        ds_skip = f"DeepSpeed-Ulysses needs the sequence ({args.seq}) divisible by the {world} ranks (no padding)"
    methods = [Method("single-rank SDPA", "single", 1, 1, "-"),
               Method("compute only (ceiling)", "ceiling", world, 1, "-", heads_skip),
               Method("DeepSpeed-Ulysses", "deepspeed", world, 1, "contiguous", ds_skip)]
    for u, r in splits(world):
        skip = split_refusal(args.heads, args.kv_heads, u)
        methods.append(Method("ds-usp", "usp", u, r, "zigzag", skip))
        if r > 1:
            methods.append(Method("ds-usp (basic ring)", "usp", u, r, "contiguous", skip))
    return methods


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


def time_step(step: Step, args: Any, device: torch.device) -> tuple[Tensor, Optional[Tensor]]:
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


def run_single(args: Any, device: torch.device, full: Sequence[Tensor]) -> tuple[Result, Optional[Reference]]:
    """Time the whole-sequence attention on rank 0 while the other ranks wait at the barrier."""
    rank0 = dist.get_rank() == 0
    step: Step = lambda: None  # noqa: E731 - idle ranks only join the barriers
    if rank0:
        q, k, v = leaves(*full[:3])
        step = fwd_bwd(functools.partial(sdpa, causal=args.causal), q, k, v, full[3])
    times, out = time_step(step, args, device)
    ref = Reference(out.detach(), q.grad, k.grad, v.grad) if rank0 else None
    return reduce_times(times, only_rank0=True, device=device), ref


def run_ceiling(args: Any, device: torch.device, full: Sequence[Tensor]) -> Result:
    """Time the ideal per-rank work with no communication: every rank at once runs SDPA over the whole
    sequence for its ``1/N`` of the heads. Its efficiency is the most this machine's contention allows."""
    n, me = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = (x.chunk(n, dim=2)[me] for x in full)  # (b, S, h/N, d): head group ``me``
    q, k, v = leaves(q, k, v)
    times, _ = time_step(fwd_bwd(functools.partial(sdpa, causal=args.causal), q, k, v, dout.contiguous()), args,
                         device)
    return reduce_times(times, only_rank0=False, device=device)


def run_deepspeed(args: Any, device: torch.device, full: Sequence[Tensor], group: Any,
                  ref: Optional[Reference]) -> Result:
    """Time DeepSpeed's ``DistributedAttention`` (Ulysses over ``group``) on contiguous shards."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # its layer talks to deepspeed.comm

    n, me = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = (x.chunk(n, dim=1)[me] for x in full)  # contiguous shards, (b, S/N, h, d)
    q, k, v = leaves(q, k, v)
    layer = DistributedAttention(functools.partial(sdpa, causal=args.causal), group, scatter_idx=2, gather_idx=1)
    # batch_dim_idx=0: the tensors are (batch, seq, heads, head_dim)
    times, out = time_step(fwd_bwd(lambda a, b, c: layer(a, b, c, 0), q, k, v, dout.contiguous()), args, device)
    result = reduce_times(times, only_rank0=False, device=device)
    with torch.no_grad():
        got = [gather_contiguous(x, group) for x in (out, q.grad, k.grad, v.grad)]
    result.max_err = check("DeepSpeed-Ulysses", got, ref, q.dtype, device)
    return result


def run_usp(args: Any, device: torch.device, full: Sequence[Tensor], topo: Any, layout: str, label: str,
            ref: Optional[Reference]) -> Result:
    """Time ``ds_usp.usp_attention`` on one topology and layout."""
    import ds_usp

    q, k, v, dout = (ds_usp.shard_sequence(x, topo, dim=1, layout=layout) for x in full)
    q, k, v = leaves(q, k, v)

    def attn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return ds_usp.usp_attention(a, b, c, topo, causal=args.causal, layout=layout, seq_len=args.seq,
                                    native_op=NATIVE_OP[args.native_op])

    times, out = time_step(fwd_bwd(attn, q, k, v, dout.contiguous()), args, device)
    result = reduce_times(times, only_rank0=False, device=device)
    with torch.no_grad():
        got = [ds_usp.gather_sequence(x, topo, dim=1, layout=layout, seq_len=args.seq)
               for x in (out, q.grad, k.grad, v.grad)]
    result.max_err = check(label, got, ref, q.dtype, device)
    return result


def table_rows(rows: list[tuple[Method, Result]], world: int, cpu_valid: bool) -> list[dict[str, Any]]:
    """One dict per measured method: its times (ms), efficiencies, ratios to DeepSpeed and target verdict."""
    single = next(r for m, r in rows if m.kind == "single")
    ds = next((r for m, r in rows if m.kind == "deepspeed"), None)
    out = []
    for m, r in rows:
        n = 1 if m.kind == "single" else world
        eff_cpu = single.cpu / (n * r.cpu) if cpu_valid else None
        eff_wall = single.wall / (n * r.wall)
        vs_cpu = r.cpu / ds.cpu if ds is not None and cpu_valid else None
        vs_wall = r.wall / ds.wall if ds is not None else None
        target = "-"
        if m.kind == "usp" and m.layout == "zigzag":
            eff, vs = (eff_cpu, vs_cpu) if cpu_valid else (eff_wall, vs_wall)
            ok = eff >= TARGET_EFFICIENCY and (vs is None or vs <= TARGET_VS_DEEPSPEED)
            target = "ok" if ok else "MISS"
        out.append({"method": m.label, "UxR": f"{m.ulysses}x{m.ring}", "layout": m.layout, "wall ms": r.wall * 1e3,
                    "cpu ms": r.cpu * 1e3 if cpu_valid else None, "thr ms": r.thread * 1e3 if cpu_valid else None,
                    "eff cpu": eff_cpu, "eff thr": single.thread / (n * r.thread) if cpu_valid else None,
                    "eff wall": eff_wall, "/DS cpu": vs_cpu, "/DS wall": vs_wall,
                    "cpu imb": r.imbalance if cpu_valid else None,
                    "max|err|": r.max_err if m.kind in ("usp", "deepspeed") else None, "target": target,
                    "rank cpu ms": [t * 1e3 for t in r.rank_cpu], "elapsed s": r.elapsed})
    return out


def render(args: Any, world: int, cores: int, rows: list[dict[str, Any]], skipped: list[Method], native: str) -> str:
    """The results table, its notes and the skipped rows, as text."""
    cols = ["method", "UxR", "layout", "wall ms", "cpu ms", "thr ms", "eff cpu", "eff thr", "eff wall", "/DS cpu",
            "/DS wall", "cpu imb", "max|err|", "target"]
    fmt = {c: ".1f" if c.endswith(" ms") else ".2f" for c in cols} | {"max|err|": ".1e"}
    lines = [f"attention fwd+bwd: N={world} ranks, S={args.seq}, batch={args.batch}, heads={args.heads}, "
             f"kv_heads={args.kv_heads}, head_dim={args.head_dim}, {args.dtype}, "
             f"{'causal' if args.causal else 'non-causal'}, iters={args.iters} (median), warmup={args.warmup}, "
             f"1 thread/rank, {cores} cores; {native}",
             table(rows, cols, fmt)]
    if skipped:
        lines += ["skipped:"] + [f"  {m.label} {m.ulysses}x{m.ring} {m.layout}: {m.skip}" for m in skipped]
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
        f"/DS <= {TARGET_VS_DEEPSPEED:.2f}, on {'cpu' if rows[0]['cpu ms'] is not None else 'wall'} time, "
        "zigzag rows.",
        f"  max|err|: gathered out/dq/dk/dv vs the single-rank ones; checked with atol={atol:g}, rtol={rtol:g}.",
    ]
    if args.causal:
        lines.append("  the basic (contiguous) ring is unbalanced under a causal mask (ring rank r does r+1/2 blocks"
                     " of work, the last one the most): the reason for zigzag.")
    return "\n".join(lines)


def native_op_note(args: Any, device: torch.device) -> str:
    """Which implementation ds-usp's ``native_op`` setting resolved to (call after the ds-usp rows ran: cached)."""
    from ds_usp.ops import NativeOps, resolve_native_op

    setting = NATIVE_OP[args.native_op]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            used = "native op" if isinstance(resolve_native_op(setting, device), NativeOps) else "PyTorch twins"
    except Exception as err:  # noqa: BLE001 - a note, not a result
        used = f"unknown ({type(err).__name__}: {err})"
    return f"ds-usp native_op={setting!r}: {used}"


def run_method(m: Method, args: Any, device: torch.device, full: Sequence[Tensor], ref: Optional[Reference],
               cache: dict[Any, Any], name: str) -> tuple[Result, Optional[Reference]]:
    """Measure one runnable method; ``cache`` keeps process groups across methods (created collectively).

    Returns:
        The result and the reference (set by the single-rank row, passed through otherwise).
    """
    import ds_usp

    timeout = datetime.timedelta(seconds=args.timeout)
    if m.kind == "single":
        return run_single(args, device, full)
    if m.kind == "ceiling":
        return run_ceiling(args, device, full), ref
    if m.kind == "deepspeed":
        if "deepspeed" not in cache:
            cache["deepspeed"] = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
        return run_deepspeed(args, device, full, cache["deepspeed"], ref), ref
    key = (m.ulysses, m.ring)
    if key not in cache:
        cache[key] = ds_usp.USPTopology.build(m.ulysses, m.ring, timeout=timeout)
    return run_usp(args, device, full, cache[key], m.layout, name, ref), ref


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Measure every method, check it, print the table (rank 0); raise on any failure."""
    args = parse_args(argv)
    device = init_distributed(args.timeout)
    world = dist.get_world_size()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    methods = plan_methods(args, world)
    full = random_qkv(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], device,
                      args.seed)
    cache: dict[Any, Any] = {}
    measured: list[tuple[Method, Result]] = []
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
        result, ref = run_method(m, args, device, full, ref, cache, name)
        result.elapsed = time.perf_counter() - start
        measured.append((m, result))
        check_note = f", check ok (max|err| {result.max_err:.1e})" if m.kind in ("usp", "deepspeed") else ""
        log(f"{name}: wall {result.wall * 1e3:.1f} ms, cpu {result.cpu * 1e3:.1f} ms{check_note} "
            f"[{result.elapsed:.1f} s]")
    if dist.get_rank() == 0:
        native = native_op_note(args, device) if any(m.kind == "usp" for m in runnable) else "ds-usp did not run"
        rows = table_rows(measured, world, cpu_valid=device.type == "cpu")
        skipped = [m for m in methods if m.skip is not None]
        print(render(args, world, cores, rows, skipped, native), flush=True)
        meta = dict(vars(args), native_op_used=native, skipped=[f"{m.label} {m.ulysses}x{m.ring}: {m.skip}"
                                                                  for m in skipped])
        log(f"results written to {save_results(args.json, meta, rows)}")
    close_distributed()


if __name__ == "__main__":
    main()
