"""Attention (issues 3 and 6): time, peak memory and correctness of one forward+backward per rank.

Run (4 CPU ranks over gloo; NCCL with one GPU per rank on a CUDA machine):

    deepspeed --num_gpus 4 benchmarks/attention.py --seq 8192 --iters 5 --warmup 2

Rows: one rank running SDPA over the whole sequence (the others wait: ``t_single``); every rank at
once running SDPA over the whole sequence for its 1/N of the heads, no communication (the ceiling
that contention between the ranks leaves); DeepSpeed's ``DistributedAttention`` (Ulysses over the N
ranks) when the heads and the length allow it; ``ds_usp.usp_attention`` for every split U x R = N,
zigzag, and contiguous for the splits with a ring. Times: :func:`_common.timed` (slowest rank per
iteration, median); efficiency ``t_single / (N t)``. Memory: one more forward+backward under a meter
(:func:`peak_memory`). Every row's gathered output and q/k/v gradients are checked against the
single rank's. See docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _common import (DTYPES, MIB, NATIVE_OP, close_distributed, init_distributed, log, parse, parser, random_qkv,
                     save_results, sdpa, split_refusal, splits, table, timed)

TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}  # atol, rtol
TARGET_EFFICIENCY = 0.90  # issue 3: every zigzag split, on CPU time
TARGET_VS_DEEPSPEED = 1.10  # issue 3: ds-usp time / DeepSpeed-Ulysses time
TARGET_MEMORY = 1.2  # issue 6: per-rank peak <= 1.2 x single-rank peak / N
SETTLE_S = 0.2  # after the forward, let gloo's worker thread drop its reference to the last send buffer


@dataclass
class Method:
    """One row: ``kind`` is single, ceiling, deepspeed or usp; ``skip`` why it cannot run (None: it runs)."""

    label: str
    kind: str
    ulysses: int
    ring: int
    layout: str
    skip: Optional[str] = None


def plan_methods(args: Any, world: int) -> list[Method]:
    """The rows in measurement order, each with its skip reason (the same on every rank)."""
    heads_skip = None
    if args.heads % world or args.kv_heads % world:
        heads_skip = f"needs q heads ({args.heads}) and kv heads ({args.kv_heads}) divisible by the {world} ranks"
    ds_skip = heads_skip or (f"needs the sequence ({args.seq}) divisible by the {world} ranks (no padding)"
                             if args.seq % world else None)
    methods = [Method("single-rank SDPA", "single", 1, 1, "-"),
               Method("compute only (ceiling)", "ceiling", world, 1, "-", heads_skip),
               Method("DeepSpeed-Ulysses", "deepspeed", world, 1, "contiguous", ds_skip)]
    for u, r in splits(world):
        skip = split_refusal(args.heads, args.kv_heads, u)
        methods += [Method("ds-usp", "usp", u, r, layout, skip) for layout in ("zigzag", "contiguous")[:1 + (r > 1)]]
    return methods


# ------------------------------------------------------------------------------------------ memory


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages that ATen ops allocate while active, and their peak (CPU tensors have
    no allocator statistics). A storage is registered when an op returns it (not a view or in-place result of an
    argument, not an excluded input) and dropped when it dies (a weakref finalizer on the storage object).
    ds-usp's custom ops are entered: the mode runs their Python bodies, so their buffers count too."""

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        super().__init__()
        self._external = {t.untyped_storage()._cdata for t in exclude}
        self._bytes: dict[int, int] = {}
        self.live = self.peak = 0

    def _free(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        opdef = OPDEFS.get(func._schema.name) if func.namespace == "ds_usp" else None
        if opdef is not None:
            with self:
                out = opdef._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        arg_keys = {x.untyped_storage()._cdata for x in tree_leaves((args, kwargs)) if isinstance(x, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key, n = st._cdata, st.nbytes()
            if n and key not in self._bytes and key not in self._external and key not in arg_keys:
                self._bytes[key] = n
                weakref.finalize(st, self._free, key)
                self.live += n
                self.peak = max(self.peak, self.live)
        return out


def peak_memory(attn: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor
                ) -> tuple[int, int]:
    """``(peak, kept)`` bytes of one ``attn`` forward+backward beyond its inputs and ``dout``: the most alive at
    once, and what is alive between forward and backward (the output and what autograd saved). CUDA: the
    allocator's statistics; CPU: :class:`LiveBytes`."""
    q.grad = k.grad = v.grad = None
    if q.device.type == "cuda":
        torch.cuda.synchronize(q.device)
        base = torch.cuda.memory_allocated(q.device)
        torch.cuda.reset_peak_memory_stats(q.device)
        out = attn(q, k, v)
        torch.cuda.synchronize(q.device)
        kept = torch.cuda.memory_allocated(q.device) - base
        out.backward(dout)
        torch.cuda.synchronize(q.device)
        return torch.cuda.max_memory_allocated(q.device) - base, kept
    with LiveBytes(exclude=[q, k, v, dout]) as meter:
        out = attn(q, k, v)
        time.sleep(SETTLE_S)
        kept = meter.live
        out.backward(dout)
    return meter.peak, kept


def model_memory(args: Any, m: Method) -> tuple[float, float]:
    """ds_usp.cost.attention_memory of a split: ``(kept, peak)`` MiB, peak = max(forward, kept + backward)."""
    from ds_usp.cost import attention_memory
    from ds_usp.sharding import padded_length

    e = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    a = attention_memory(args.batch, padded_length(args.seq, m.ulysses, m.ring, m.layout), args.heads, args.kv_heads,
                         args.head_dim, m.ulysses, m.ring, e)
    kept = a.output + a.saved
    return kept / MIB, max(a.forward_peak, kept + a.backward_peak) / MIB


# -------------------------------------------------------------------------------------------- rows


def check(label: str, got: Sequence[Tensor], ref: Optional[Sequence[Tensor]], dtype: torch.dtype,
          device: torch.device) -> float:
    """Compare gathered (out, dq, dk, dv) with the single rank's on rank 0; raise on every rank if off.
    Returns the largest absolute error."""
    atol, rtol = TOLERANCES[dtype]
    status = torch.zeros(2, dtype=torch.float64)  # (failed, max abs error)
    message = ""
    if dist.get_rank() == 0:
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            g, r = g.float().cpu(), r.float().cpu()
            status[1] = max(status[1].item(), (g - r).abs().max().item())
            try:
                torch.testing.assert_close(g, r, atol=atol, rtol=rtol)
            except AssertionError as err:
                status[0], message = 1.0, f"{message}\n{name}: {err}"
    status = status.to(device)
    dist.broadcast(status, src=0)
    if status[0].item():
        raise AssertionError(f"{label}: differs from the single-rank attention (atol={atol}, rtol={rtol})"
                             f"{message or ' (details on rank 0)'}")
    return status[1].item()


def setup(m: Method, args: Any, full: Sequence[Tensor], cache: dict) -> tuple[Optional[Callable], list[Tensor],
                                                                              Optional[Callable]]:
    """What method ``m`` runs on this rank: ``(attn or None to idle, [q, k, v, dout], gather to global order)``."""
    import ds_usp

    rank, world = dist.get_rank(), dist.get_world_size()
    causal_sdpa = functools.partial(sdpa, causal=args.causal)
    if m.kind == "single":
        return (causal_sdpa if rank == 0 else None), list(full), None
    if m.kind == "ceiling":  # head group ``rank``, whole sequence
        return causal_sdpa, [x.chunk(world, dim=2)[rank].contiguous() for x in full], None
    timeout = datetime.timedelta(seconds=args.timeout)
    if m.kind == "deepspeed":
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # its layer uses deepspeed.comm
        group = cache.setdefault("deepspeed", dist.new_group(list(range(world)), timeout=timeout))
        layer = DistributedAttention(causal_sdpa, group, scatter_idx=2, gather_idx=1)

        def gather(x: Tensor) -> Tensor:
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=1)

        return (lambda a, b, c: layer(a, b, c, 0)), [x.chunk(world, dim=1)[rank].contiguous() for x in full], gather
    if (m.ulysses, m.ring) not in cache:
        cache[m.ulysses, m.ring] = ds_usp.USPTopology.build(m.ulysses, m.ring, timeout=timeout)
    topo = cache[m.ulysses, m.ring]
    kw = dict(layout=m.layout, seq_len=args.seq)

    def attn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return ds_usp.usp_attention(a, b, c, topo, causal=args.causal, native_op=NATIVE_OP[args.native_op], **kw)

    return (attn, [ds_usp.shard_sequence(x, topo, dim=1, layout=m.layout) for x in full],
            lambda x: ds_usp.gather_sequence(x, topo, dim=1, **kw))


def measure(m: Method, args: Any, device: torch.device, full: Sequence[Tensor], cache: dict,
            ref: Optional[list[Tensor]]) -> dict[str, Any]:
    """Time, check and meter one method; returns its raw figures (the same on every rank except ``ref``)."""
    attn, (q, k, v, dout), gather = setup(m, args, full, cache)
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def step() -> Optional[Tensor]:
        if attn is None:
            return None
        q.grad = k.grad = v.grad = None
        out = attn(q, k, v)
        out.backward(dout)
        return out

    timing, out = timed(step, args.iters, args.warmup, device, only_rank0=m.kind == "single")
    raw: dict[str, Any] = {"timing": timing, "max_err": None, "ref": None}
    if m.kind == "single" and out is not None:
        raw["ref"] = [out.detach(), q.grad, k.grad, v.grad]
    if gather is not None:
        with torch.no_grad():
            got = [gather(x) for x in (out, q.grad, k.grad, v.grad)]
        raw["max_err"] = check(f"{m.label} {m.ulysses}x{m.ring} {m.layout}", got, ref, q.dtype, device)
    mem = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    if args.memory and attn is not None and m.kind != "ceiling":
        mem = torch.tensor(peak_memory(attn, q, k, v, dout), dtype=torch.float64)
    parts = [torch.empty_like(mem, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mem.to(device))
    measured = [p.cpu() for p in parts if p[0] >= 0]
    raw["peak"], raw["kept"] = (max(p[i].item() for p in measured) if measured else None for i in (0, 1))
    return raw


def rows_of(measured: list[tuple[Method, dict]], args: Any, world: int, cpu_valid: bool) -> list[dict[str, Any]]:
    """The table's rows: times (ms), efficiencies, ratios to DeepSpeed, memory (MiB) and the targets."""
    single = next(raw for m, raw in measured if m.kind == "single")
    ds = next((raw["timing"] for m, raw in measured if m.kind == "deepspeed"), None)
    t1 = single["timing"]
    out = []
    for m, raw in measured:
        t, n = raw["timing"], 1 if m.kind == "single" else world
        eff = {c: getattr(t1, c) / (n * getattr(t, c)) for c in ("wall", "cpu", "thread")}
        vs = {c: getattr(t, c) / getattr(ds, c) if ds else None for c in ("wall", "cpu")}
        clock = "cpu" if cpu_valid else "wall"
        peak, kept = raw["peak"], raw["kept"]
        ideal = single["peak"] / n if single["peak"] and peak is not None and n > 1 else None
        model = model_memory(args, m) if m.kind == "usp" else (None, None)
        target = "-"
        if m.kind == "usp" and m.layout == "zigzag":
            ok = eff[clock] >= TARGET_EFFICIENCY and (vs[clock] is None or vs[clock] <= TARGET_VS_DEEPSPEED)
            target = ("ok" if ok else "MISS") + ("" if ideal is None else
                                                 (" / ok" if peak <= TARGET_MEMORY * ideal else " / MISS"))
        out.append({"method": m.label, "UxR": f"{m.ulysses}x{m.ring}", "layout": m.layout, "wall ms": t.wall * 1e3,
                    "cpu ms": t.cpu * 1e3 if cpu_valid else None, "thr ms": t.thread * 1e3 if cpu_valid else None,
                    "eff cpu": eff["cpu"] if cpu_valid else None, "eff thr": eff["thread"] if cpu_valid else None,
                    "eff wall": eff["wall"], "/DS cpu": vs["cpu"] if cpu_valid else None, "/DS wall": vs["wall"],
                    "cpu imb": t.imbalance() if cpu_valid else None, "max|err|": raw["max_err"],
                    "peak MiB": peak and peak / MIB, "mem ratio": ideal and peak / ideal,
                    "kept MiB": kept and kept / MIB,
                    "kept ratio": ideal and kept / (single["kept"] / n),
                    "model kept": model[0], "model peak": model[1], "target": target,
                    "rank ms": [[x * 1e3 for x in r] for r in t.ranks]})
    return out


def native_op_note(args: Any, device: torch.device) -> str:
    """What ds-usp's ``native_op`` setting resolved to."""
    from ds_usp.native import NativeOps, resolve_native_op

    try:
        used = isinstance(resolve_native_op(NATIVE_OP[args.native_op], device), NativeOps)
        return f"native_op={args.native_op}: {'native op' if used else 'PyTorch twins'}"
    except Exception as err:  # noqa: BLE001 - a note, not a result
        return f"native_op={args.native_op}: unknown ({type(err).__name__}: {err})"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Measure every method, check it, print the table (rank 0); raise on any failure."""
    p = parser(__doc__, timing=(5, 2))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="meter one more forward+backward per row for its peak memory")
    args = parse(p, argv)
    device = init_distributed(args.timeout)
    world = dist.get_world_size()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    methods = plan_methods(args, world)
    full = random_qkv(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], device,
                      args.seed)
    runnable = [m for m in methods if m.skip is None]
    skipped = [f"{m.label} {m.ulysses}x{m.ring} {m.layout}: {m.skip}" for m in methods if m.skip]
    for s in skipped:
        log(f"skip {s}")
    cache: dict[Any, Any] = {}
    measured: list[tuple[Method, dict]] = []
    ref = None
    for i, m in enumerate(runnable, 1):
        name = f"({i}/{len(runnable)}) {m.label} {m.ulysses}x{m.ring} {m.layout}"
        start = time.perf_counter()
        raw = measure(m, args, device, full, cache, ref)
        ref = raw.pop("ref") or ref
        measured.append((m, raw))
        log(f"{name}: wall {raw['timing'].wall * 1e3:.1f} ms, cpu {raw['timing'].cpu * 1e3:.1f} ms"
            + (f", check ok (max|err| {raw['max_err']:.1e})" if raw["max_err"] is not None else "")
            + f" [{time.perf_counter() - start:.1f} s]")
    if dist.get_rank() == 0:
        rows = rows_of(measured, args, world, cpu_valid=device.type == "cpu")
        native = native_op_note(args, device)
        cols = [c for c in rows[0] if c != "rank ms" and (args.memory or "MiB" not in c and "model" not in c
                                                          and "ratio" not in c)]
        fmt = {c: ".1f" if c.endswith(" ms") else ".2f" for c in cols} | {"max|err|": ".1e"}
        print(f"attention fwd+bwd: N={world} ranks on {device.type} ({cores} cores), S={args.seq}, b={args.batch}, "
              f"H={args.heads}, H_kv={args.kv_heads}, D={args.head_dim}, {args.dtype}, "
              f"{'causal' if args.causal else 'non-causal'}, median of {args.iters} after {args.warmup}, "
              f"1 thread/rank, {native}\n{table(rows, cols, fmt)}", flush=True)
        print(f"target: eff >= {TARGET_EFFICIENCY} and /DS <= {TARGET_VS_DEEPSPEED} on "
              f"{'cpu' if device.type == 'cpu' else 'wall'} time (issue 3, at S=8192); after '/': "
              f"mem ratio (peak / (single peak / N)) <= {TARGET_MEMORY} (issue 6)", flush=True)
        meta = dict(vars(args), native_op_used=native, skipped=skipped)
        log(f"results written to {save_results(args.json, meta, rows)}")
    close_distributed()


if __name__ == "__main__":
    main()
