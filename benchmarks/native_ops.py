"""Native op (issue 4) benchmark: each kernel vs its PyTorch twin, a copy as the bandwidth ceiling, and USP end to end.

Run (CPU; builds the op on first use):

    python benchmarks/native_ops.py                      # kernels, b=1 s_local=8192 h=8 d=64, fp32 and bf16
    deepspeed --num_gpus 4 benchmarks/native_ops.py --e2e --seq 4096 [--profile]   # USP fwd+bwd, native on vs off

Kernels (medians over ``--iters`` runs after ``--warmup``, ``--threads`` intra-op threads), each a
method of :class:`ds_usp.ops.NativeOps` against the same method of its twin :class:`ds_usp.ops.TorchOps`:

* ``merge``: fold a block's (out, lse) into the running fp32 (out, lse) of the same rows (``merge_block_``).
* ``pack qkv``: q, k, v ``(b, s, h, d)`` straight into the Ulysses send buffer ``(U, b, s, H'/U, d)``
  with U = 4, kv heads ``--kv-heads`` (MHA) and 2 (GQA, replicated to 4) (``pack_seq_to_head``).
* ``unpack out``: the received ``(U, b, s, h/U, d)`` buffer back to ``(b, s, h, d)`` (``unpack_head_to_seq``).
* ``unpack dqkv``: gradients' received buffer back to dq, dk, dv with the GQA replica sum (the same).
* ``accumulate``: ``acc += x`` into an fp32 accumulator (``accumulate_``).

Bytes are the minimum traffic of the operation (every input read once, every output written once);
``GB/s`` = bytes / time. The copy column is the bandwidth ceiling, a plain fp32 copy: for in-place
kernels (merge, accumulate) ``dst.copy_(src)`` moving the same bytes (half read, half written); for
kernels that allocate their output (pack, unpack; marked ``*``) ``torch.empty_like(src).copy_(src)``
with ``src`` the size of the kernel's output, so that the ceiling goes through the same allocator
path (glibc hands blocks above 32 MB back to the OS, so each such allocation page-faults anew, for
the kernel, the twin and the copy alike). ``% copy`` = kernel GB/s / copy GB/s. Twin, native and
copy run in turn inside each iteration so that noise from other processes hits them alike; the
times are medians.

End to end (``--e2e``, under the launcher): every rank one thread, USP forward+backward of
``(1, seq, heads, head_dim)`` for each (U, R) split the heads allow, median wall time and median
CPU time of the compute thread (``time.thread_time``, less sensitive to other processes taking the
cores) of the slowest rank, native op on vs off run in turn inside every iteration; ``--profile``
prints torch.profiler's top ops (self CPU time, rank 0) for both.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from _common import (DTYPES, close_distributed, init_distributed, log, parse, parser, random_qkv, save_results,
                     split_refusal, splits, table)
from ds_usp.ops import TorchOps, load_native_op

U = 4  # the kernels' Ulysses degree


def time_interleaved(fns: Sequence[Callable[[], object]], iters: int, warmup: int) -> list[float]:
    """Median seconds of each fn, the fns run in turn inside every iteration (so noise hits them alike)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def bench_kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every kernel, every ``--dtypes``: twin, native and copy ceiling times, printed as one Markdown table."""
    if args.threads:
        torch.set_num_threads(args.threads)
    twin, ops = TorchOps(), load_native_op("cpu")
    b, s, h, d = 1, args.s_local, args.heads, args.head_dim
    g = torch.Generator().manual_seed(args.seed)
    log(f"kernels: b={b} s_local={s} h={h} d={d} U={U}, torch threads={torch.get_num_threads()}, "
        f"iters={args.iters} (median), op={ops}")
    rows: list[dict[str, Any]] = []

    def row(name: str, dtype_name: str, nbytes: int, method: str, call_args: Callable[[], tuple],
            out_bytes: int = 0) -> None:
        """Time ``twin.method`` and ``ops.method``; ``out_bytes`` > 0: the op allocates an output that size."""
        if out_bytes:  # allocate + copy a tensor of the op's output size: the same allocator/page-fault path
            src = torch.randn(out_bytes // 4, generator=g)
            copy = lambda: torch.empty_like(src).copy_(src)  # noqa: E731
            copy_bytes = 2 * out_bytes
        else:  # in place: copy into an existing tensor, nbytes in all
            src = torch.randn(nbytes // 8, generator=g)
            dst = torch.empty_like(src)
            copy = lambda: dst.copy_(src)  # noqa: E731
            copy_bytes = 8 * (nbytes // 8)
        a = call_args()
        t_twin, t_nat, t_copy = time_interleaved([lambda: getattr(twin, method)(*a), lambda: getattr(ops, method)(*a),
                                                  copy], args.iters, args.warmup)
        gbs, cgbs = nbytes / t_nat / 1e9, copy_bytes / t_copy / 1e9
        rows.append({"kernel": name, "dtype": dtype_name, "MB moved": nbytes / 1e6, "twin ms": t_twin * 1e3,
                     "native ms": t_nat * 1e3, "speedup": f"{t_twin / t_nat:.2f}x", "native GB/s": gbs,
                     "copy GB/s": f"{cgbs:.1f}{'*' if out_bytes else ''}", "% copy": f"{100 * gbs / cgbs:.0f}%"})
        log(f"{name} {dtype_name}: twin {t_twin * 1e3:.2f} ms, native {t_nat * 1e3:.2f} ms")

    for dname in args.dtypes:
        dtype = DTYPES[dname]
        es = torch.finfo(dtype).bits // 8
        n = b * s * h * d
        # merge: out r/w fp32, block_out read, lse r/w + block_lse read (fp32)
        out, lse = torch.randn(b, s, h, d, generator=g), torch.randn(b, h, s, generator=g)
        bo, bl = torch.randn(b, s, h, d, generator=g).to(dtype), torch.randn(b, h, s, generator=g)
        row("merge", dname, 8 * n + es * n + 12 * b * h * s, "merge_block_", lambda: (out, lse, bo, bl))
        for hkv in (args.kv_heads, 2):
            rep = 1 if hkv % U == 0 else U // hkv
            q, k, v, _ = random_qkv(b, s, h, hkv, d, dtype, torch.device("cpu"), args.seed + hkv)
            hp = h + 2 * hkv * rep
            nbytes = es * b * s * d * ((h + 2 * hkv) + hp)  # read q, k, v; write the buffer
            row(f"pack qkv (hkv={hkv})", dname, nbytes, "pack_seq_to_head", lambda: ([q, k, v], [1, rep, rep], U),
                es * b * s * d * hp)
            heads = [h // U, hkv * rep // U, hkv * rep // U]
            recv = torch.randn(U, b, s, hp // U, d, generator=g).to(dtype)
            nbytes = es * b * s * d * (hp + h + 2 * hkv)  # read the buffer, write dq, dk, dv
            row(f"unpack dqkv (hkv={hkv})", dname, nbytes, "unpack_head_to_seq", lambda: (recv, heads, [1, rep, rep]),
                es * b * s * d * (h + 2 * hkv))
        recv_out = torch.randn(U, b, s, h // U, d, generator=g).to(dtype)
        row("unpack out", dname, 2 * es * n, "unpack_head_to_seq", lambda: (recv_out, [h // U], [1]), es * n)
        acc, x = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g).to(dtype)
        # a strided view, as the ring does it: dq[:, qs] += dq_b
        row("accumulate", dname, 8 * n + es * n, "accumulate_", lambda: (acc[:, :], x))
    print(table(rows, fmt={"MB moved": ".1f", "twin ms": ".2f", "native ms": ".2f", "native GB/s": ".1f"},
                markdown=True), flush=True)
    return rows


def bench_e2e(args: argparse.Namespace) -> list[dict[str, Any]]:
    """USP forward+backward per split, native op off and on in turn; rank 0 prints one Markdown table."""
    import ds_usp

    init_distributed(args.timeout)
    world, rows = dist.get_world_size(), []
    log(f"USP fwd+bwd: {world} ranks x 1 thread, seq={args.seq}, heads={args.heads}, kv_heads={args.kv_heads}, "
        f"head_dim={args.head_dim}, causal zigzag, median of {args.iters} (slowest rank)")
    for dname in args.dtypes:
        full = random_qkv(1, args.seq, args.heads, args.kv_heads, args.head_dim, DTYPES[dname], torch.device("cpu"),
                          args.seed)
        for u, r in splits(world):
            if split_refusal(args.heads, args.kv_heads, u):
                continue
            topo = ds_usp.USPTopology.build(u, r)
            local = [ds_usp.shard_sequence(x, topo, dim=1, layout="zigzag") for x in full]

            def step(flag: bool) -> None:
                q, k, v = (x.clone().requires_grad_() for x in local[:3])
                ds_usp.usp_attention(q, k, v, topo, causal=True, layout="zigzag", seq_len=args.seq,
                                     native_op=flag).backward(local[3])

            for _ in range(args.warmup):
                step(False)
                step(True)
            times: dict[bool, list[list[float]]] = {False: [], True: []}
            for _ in range(args.iters):
                for flag in (False, True):  # in turn, so that noise from other processes hits both alike
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    step(flag)
                    t = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # slowest rank: wall, compute-thread CPU time
                    times[flag].append(t.tolist())
            (w0, c0), (w1, c1) = ([statistics.median(x[i] for x in times[f]) for i in range(2)] for f in (False, True))
            rows.append({"split": f"U={u} R={r}", "dtype": dname, "twin wall ms": w0 * 1e3,
                         "native wall ms": w1 * 1e3, "speedup wall": f"{w0 / w1:.3f}x",
                         "twin thread-CPU ms": c0 * 1e3, "native thread-CPU ms": c1 * 1e3,
                         "speedup CPU": f"{c0 / c1:.3f}x"})
            log(f"U={u} R={r} {dname}: twin {w0 * 1e3:.1f} ms, native {w1 * 1e3:.1f} ms (wall)")
            if args.profile:
                profile_step(step, u, r, args.profile_rows)
    if dist.get_rank() == 0:
        print(table(rows, fmt={c: ".1f" for c in rows[0] if c.endswith(" ms")}, markdown=True), flush=True)
    return rows


def profile_step(step: Callable[[bool], None], u: int, r: int, row_limit: int) -> None:
    """torch.profiler's top ops by self CPU time for one forward+backward, twin and native (printed on rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    for flag in (False, True):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(flag)
        log(f"profile rank 0, U={u} R={r}, native_op={flag} (one fwd+bwd)\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the kernel benchmark, or with ``--e2e`` (under the launcher) the end-to-end one; save the rows."""
    p = parser(__doc__.split("\n")[0], seq=4096, dtype=["fp32", "bf16"], timing=(20, 3), native_op=False)
    p.add_argument("--s-local", type=int, default=8192, help="kernels: tokens of one rank's shard")
    p.add_argument("--threads", type=int, default=0, help="kernels: torch intra-op threads (0: torch's default)")
    p.add_argument("--e2e", action="store_true", help="USP forward+backward end to end instead of the kernels")
    p.add_argument("--profile", action="store_true", help="with --e2e: torch.profiler table on rank 0")
    p.add_argument("--profile-rows", type=int, default=18)
    args = parse(p, argv)
    if args.e2e:
        rows = bench_e2e(args)
        if dist.get_rank() == 0:
            log(f"results written to {save_results(args.json, vars(args), rows)}")
        close_distributed()
    else:
        rows = bench_kernels(args)
        log(f"results written to {save_results(args.json, vars(args), rows)}")


if __name__ == "__main__":
    main()
