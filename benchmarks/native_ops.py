"""Native op (issue 4) benchmark: each kernel vs its PyTorch twin, a copy as the bandwidth ceiling, and USP end to end.

Run (CPU; builds the op on first use):

    python benchmarks/native_ops.py                      # kernels, b=1 s_local=8192 h=8 d=64, fp32 and bf16
    python benchmarks/native_ops.py --e2e --ranks 4 --seq 4096 [--profile]   # USP fwd+bwd, native on vs off

Kernels (medians over ``--iters`` runs after ``--warmup``, ``--threads`` intra-op threads):

* ``merge``: fold a block's (out, lse) into the running fp32 (out, lse) of the same rows
  (twin: :func:`ds_usp.ring.merge_block_`).
* ``pack qkv``: q, k, v ``(b, s, h, d)`` straight into the Ulysses send buffer ``(U, b, s, H'/U, d)``
  with U = 4, kv heads 8 (MHA) and 2 (GQA, replicated to 4) (twin: ``repeat_interleave`` + ``cat`` +
  ``permute().contiguous()`` as in :func:`ds_usp.ulysses.qkv_seq_to_head` / :mod:`ds_usp.comm`).
* ``unpack out``: the received ``(U, b, s, h/U, d)`` buffer back to ``(b, s, h, d)`` (twin: ``permute`` +
  ``reshape``, one copy).
* ``unpack dqkv``: gradients' received buffer back to dq, dk, dv with the GQA replica sum (twin: the
  autograd backward of the packing: split, reshape, sum over replicas).
* ``accumulate``: ``acc += x`` into an fp32 accumulator (twin: ``+=``).

Bytes are the minimum traffic of the operation (every input read once, every output written once);
``GB/s`` = bytes / time. The copy column is the bandwidth ceiling, a plain fp32 copy: for in-place
kernels (merge, accumulate) ``dst.copy_(src)`` moving the same bytes (half read, half written); for
kernels that allocate their output (pack, unpack; marked ``*``) ``torch.empty_like(src).copy_(src)``
with ``src`` the size of the kernel's output, so that the ceiling goes through the same allocator
path (glibc hands blocks above 32 MB back to the OS, so each such allocation page-faults anew, for
the kernel, the twin and the copy alike). ``% copy`` = kernel GB/s / copy GB/s. Twin, native and
copy run in turn inside each iteration so that noise from other processes hits them alike; the
times are medians.

End to end (``--e2e``): ``--ranks`` gloo processes, one thread each, USP forward+backward of
``(1, seq, heads, head_dim)`` for each (U, R) split, median wall time and median CPU time of the
compute thread (``time.thread_time``, less sensitive to other processes taking the cores) of the
slowest rank, native op on vs off run in turn inside every iteration; ``--profile`` prints
torch.profiler's top ops (self CPU time, rank 0) for both.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time_interleaved(fns: list[Callable[[], object]], iters: int, warmup: int) -> list[float]:
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


def _twin_pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: int) -> torch.Tensor:
    """The twin's send buffer (ds_usp.ops.TorchOps.pack_seq_to_head)."""
    from ds_usp.ops import TorchOps

    rep = 1 if k.shape[2] % u == 0 else u // k.shape[2]
    return TorchOps().pack_seq_to_head([q, k, v], [1, rep, rep], u)


def _twin_unpack_grads(recv: torch.Tensor, heads: list[int], hkv: int, rep: int) -> list[torch.Tensor]:
    u, b, s, _, d = recv.shape
    seq = recv.permute(1, 2, 0, 3, 4).reshape(b, s, -1, d)  # (U, b, s, H', d) -> (b, s, U*H', d): one copy
    parts = seq.reshape(b, s, u, -1, d).split(heads, dim=3)  # (b, s, U, h_i, d) views
    out = [parts[0].reshape(b, s, -1, d)]  # (b, s, U, hq/U, d) -> (b, s, hq, d)
    for p in parts[1:]:
        x = p.reshape(b, s, -1, d)  # (b, s, U, hk/U, d) -> (b, s, hk, d)
        out.append(x if rep == 1 else x.reshape(b, s, hkv, rep, d).sum(3))  # replica sum
    return out


def bench_kernels(args: argparse.Namespace) -> None:
    from ds_usp.ops import load_native_op
    from ds_usp.ops import TorchOps

    merge_block_ = TorchOps().merge_block_

    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_native_op("cpu")
    b, s, h, d, u = 1, args.s_local, args.heads, args.head_dim, 4
    g = torch.Generator().manual_seed(0)
    print(f"# kernels: b={b} s_local={s} h={h} d={d} U={u}, torch threads={torch.get_num_threads()}, "
          f"iters={args.iters} (median), op={ops}")
    print("| kernel | dtype | MB moved | twin ms | native ms | speedup | native GB/s | copy GB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    def row(name: str, dtype_name: str, nbytes: int, twin: Callable[[], object], nat: Callable[[], object],
            out_bytes: int = 0) -> None:
        """One table row; ``out_bytes`` > 0: the op allocates an output of that size (the ceiling does too)."""
        if out_bytes:  # allocate + copy a tensor of the op's output size: the same allocator/page-fault path
            src = torch.randn(out_bytes // 4, generator=g)
            copy = lambda: torch.empty_like(src).copy_(src)  # noqa: E731
            copy_bytes = 2 * out_bytes
        else:  # in place: copy into an existing tensor, nbytes in all
            src = torch.randn(nbytes // 8, generator=g)
            dst = torch.empty_like(src)
            copy = lambda: dst.copy_(src)  # noqa: E731
            copy_bytes = 8 * (nbytes // 8)
        t_twin, t_nat, t_copy = _time_interleaved([twin, nat, copy], args.iters, args.warmup)
        gbs, cgbs = nbytes / t_nat / 1e9, copy_bytes / t_copy / 1e9
        print(f"| {name} | {dtype_name} | {nbytes / 1e6:.1f} | {t_twin * 1e3:.2f} | {t_nat * 1e3:.2f} | "
              f"{t_twin / t_nat:.2f}x | {gbs:.1f} | {cgbs:.1f}{'*' if out_bytes else ''} | "
              f"{100 * gbs / cgbs:.0f}% |", flush=True)

    for dname, dtype in DTYPES.items():
        es = torch.finfo(dtype).bits // 8
        n = b * s * h * d
        # merge: out r/w fp32, block_out read, lse r/w + block_lse read (fp32)
        out0 = torch.randn(b, s, h, d, generator=g)
        lse0 = torch.randn(b, h, s, generator=g)
        bo = torch.randn(b, s, h, d, generator=g).to(dtype)
        bl = torch.randn(b, h, s, generator=g)
        out, lse = out0.clone(), lse0.clone()
        row("merge", dname, 8 * n + es * n + 12 * b * h * s,
            lambda: merge_block_(out, lse, bo, bl), lambda: ops.merge_block_(out, lse, bo, bl))
        for hkv in (h, 2):
            rep = 1 if hkv % u == 0 else u // hkv
            q = torch.randn(b, s, h, d, generator=g).to(dtype)
            k = torch.randn(b, s, hkv, d, generator=g).to(dtype)
            v = torch.randn(b, s, hkv, d, generator=g).to(dtype)
            hp = h + 2 * hkv * rep
            nbytes = es * b * s * d * ((h + 2 * hkv) + hp)  # read q, k, v; write the buffer
            row(f"pack qkv (hkv={hkv})", dname, nbytes, lambda: _twin_pack(q, k, v, u),
                lambda: ops.pack_seq_to_head([q, k, v], [1, rep, rep], u), es * b * s * d * hp)
            heads = [h // u, hkv * rep // u, hkv * rep // u]
            recv = torch.randn(u, b, s, hp // u, d, generator=g).to(dtype)
            nbytes = es * b * s * d * (hp + h + 2 * hkv)  # read the buffer, write dq, dk, dv
            row(f"unpack dqkv (hkv={hkv})", dname, nbytes, lambda: _twin_unpack_grads(recv, heads, hkv, rep),
                lambda: ops.unpack_head_to_seq(recv, heads, [1, rep, rep]), es * b * s * d * (h + 2 * hkv))
        recv = torch.randn(u, b, s, h // u, d, generator=g).to(dtype)
        # (U, b, s, h/U, d) -> (b, s, U, h/U, d) -> (b, s, h, d)
        row("unpack out", dname, 2 * es * n, lambda: recv.permute(1, 2, 0, 3, 4).reshape(b, s, h, d),
            lambda: ops.unpack_head_to_seq(recv, [h // u], [1]), es * n)
        acc = torch.randn(b, s, h, d, generator=g)
        x = torch.randn(b, s, h, d, generator=g).to(dtype)

        def twin_acc() -> None:
            acc[:, :] += x  # as the ring does it: dq[:, qs] += dq_b

        row("accumulate", dname, 8 * n + es * n, twin_acc, lambda: ops.accumulate_(acc[:, :], x))


# -------------------------------------------------------------------------------------------- e2e


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _e2e_worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import ds_usp

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, args.seq, hh, args.head_dim, generator=g).to(dtype)
            for hh in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
    splits = [(u, world // u) for u in (world, 2, 1) if world % u == 0 and args.heads % u == 0]
    splits = list(dict.fromkeys(splits))
    for u, r in splits:
        topo = ds_usp.USPTopology.build(u, r)
        local = [ds_usp.shard_sequence(x, topo, dim=1, layout="zigzag") for x in full]

        def step(flag: bool) -> None:
            q, k, v = (x.clone().requires_grad_() for x in local[:3])
            out = ds_usp.usp_attention(q, k, v, topo, causal=True, layout="zigzag", native_op=flag)
            out.backward(local[3])

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
        res = {flag: [statistics.median(x[i] for x in ts) for i in range(2)] for flag, ts in times.items()}
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            for flag in (False, True):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step(flag)
                if rank == 0:
                    print(f"\n## profile rank 0, U={u} R={r}, native_op={flag} (one fwd+bwd)")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
        if rank == 0:
            (w0, c0), (w1, c1) = res[False], res[True]
            print(f"| U={u} R={r} | {args.dtype} | {w0 * 1e3:.1f} | {w1 * 1e3:.1f} | {w0 / w1:.3f}x | "
                  f"{c0 * 1e3:.1f} | {c1 * 1e3:.1f} | {c0 / c1:.3f}x |", flush=True)
    dist.destroy_process_group()


def bench_e2e(args: argparse.Namespace) -> None:
    from ds_usp.ops import load_native_op

    load_native_op("cpu")  # build once here, not in every rank
    print(f"# USP fwd+bwd: {args.ranks} gloo ranks x 1 thread, seq={args.seq}, heads={args.heads}, "
          f"kv_heads={args.kv_heads}, head_dim={args.head_dim}, causal zigzag, median of {args.iters} "
          f"(slowest rank)")
    print("| split | dtype | twin wall ms | native wall ms | speedup wall | twin thread-CPU ms | "
          "native thread-CPU ms | speedup CPU |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    mp.spawn(_e2e_worker, args=(args.ranks, _free_port(), args), nprocs=args.ranks, join=True)


def main() -> None:
    """Parse the arguments and run the kernel or end-to-end benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--s-local", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="kernels: torch intra-op threads (0: torch's default)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--e2e", action="store_true", help="USP forward+backward end to end instead of the kernels")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--profile", action="store_true", help="with --e2e: torch.profiler table on rank 0")
    p.add_argument("--profile-rows", type=int, default=18)
    args = p.parse_args()
    if args.e2e:
        bench_e2e(args)
    else:
        bench_kernels(args)


if __name__ == "__main__":
    main()
