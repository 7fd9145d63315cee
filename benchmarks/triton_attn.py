"""Triton backend on one GPU (issue 15): TFLOPS of forward+backward per backend, and a zigzag ring step.

Run (CUDA only; refused on CPU, where the interpreter makes timings meaningless):

    python benchmarks/triton_attn.py --seqs 8192,16384,32768,65536 --heads 32 --head-dim 128 --dtype bf16

Rows, for each length and causal / not: ``triton`` (ds-usp's kernels), ``flash_attn`` (when
flash-attn imports) and ``torch`` (``torch.nn.functional.scaled_dot_product_attention``), each forward
then backward on the same inputs; time from CUDA events, median over ``--iters``. FLOPs:
``4 b h s^2 d`` for the forward and 2.5 times that for the backward, halved under a causal mask.

Ring step (a zigzag rank's later half of queries against an earlier K/V block, which is a full
rectangle, plus its diagonal block, causal): ``triton fused`` merges into the running fp32
``(out, lse)`` inside the kernel (``band_forward_merge_``); ``kernel + merge`` runs the backend's
forward and then ds-usp's separate merge (the native op's when it builds, else PyTorch's).
Targets: Triton >= 0.9 x flash-attn's TFLOPS on the plain block; the fused ring step faster than the
kernel followed by the merge.

``--sweep`` first times the Triton kernels under a few tile configurations (block sizes, warps, stages)
at the first length, the table from which ``triton_attn._config``'s defaults were chosen.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from _common import DTYPES, parse, parser, random_qkv, save_results, table
from ds_usp.kernels import available_backends, get_backend, triton_attn
from ds_usp.native import resolve_native_op


def _time(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` CUDA-event-timed calls after ``warmup`` ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def plain_rows(args, seq: int, causal: bool, dtype: torch.dtype) -> list[dict]:
    q, k, v, dout = random_qkv(args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype,
                               torch.device("cuda"), args.seed)
    flops = 4 * args.batch * args.heads * seq * seq * args.head_dim * (0.5 if causal else 1.0)
    usable = [n for n, r in available_backends("cuda").items() if r is None]
    rows = []
    for name in ("triton", "flash_attn", "torch"):
        if name not in usable:
            continue
        backend = get_backend(name, "cuda", dtype)
        cap = args.softcap
        try:
            out, lse = backend.forward(q, k, v, causal, None, cap)
            fwd = _time(lambda: backend.forward(q, k, v, causal, None, cap), args.iters, args.warmup)
            bwd = _time(lambda: backend.backward(dout, q, k, v, out, lse, causal, None, cap), args.iters, args.warmup)
        except torch.OutOfMemoryError as e:  # a backend's unfused (soft-capped) path at length: a row, not a crash
            rows.append(dict(S=seq, causal=causal, backend=name, softcap=cap, error=str(e).split("\n")[0][:100]))
            torch.cuda.empty_cache()
            continue
        rows.append(dict(S=seq, causal=causal, backend=name, softcap=cap, fwd_ms=fwd, bwd_ms=bwd,
                         fwd_tflops=flops / fwd / 1e9, fwd_bwd_tflops=3.5 * flops / (fwd + bwd) / 1e9))
    return rows


def _fused_ring_step(q, k, v, scale: float) -> Callable[[], None]:
    """A zigzag rank's ring step with the fused kernel: a full block and a causal one merged into fp32 (out, lse)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)

    def step() -> None:
        triton_attn.band_forward_merge_(q, k, v, None, None, scale, out, lse)
        triton_attn.band_forward_merge_(q, k, v, None, 0, scale, out, lse)

    return step


def ring_rows(args, seq: int, dtype: torch.dtype) -> list[dict]:
    """One zigzag ring step of a rank: its queries (2 halves) against a K/V block: full + causal diagonal."""
    q, k, v, _ = random_qkv(args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype,
                            torch.device("cuda"), args.seed)
    ops = resolve_native_op("auto", q.device)
    scale = args.head_dim ** -0.5
    out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full((q.shape[0], q.shape[2], seq), float("-inf"), device="cuda")
    rows = [dict(S=seq, step="triton fused", ms=_time(_fused_ring_step(q, k, v, scale), args.iters, args.warmup))]
    for name in ("triton", "flash_attn", "torch"):
        if available_backends("cuda")[name] is not None:
            continue
        backend = get_backend(name, "cuda", dtype)

        def separate() -> None:
            for causal in (False, True):
                block_out, block_lse = backend.forward(q, k, v, causal, scale)
                ops.merge_block_(out, lse, block_out, block_lse)

        rows.append(dict(S=seq, step=f"{name} + merge ({ops.source})", ms=_time(separate, args.iters, args.warmup)))
    return rows


SWEEP = [dict(BM=bm, BN=bn, warps=w, stages=st) for bm, bn, w, st in
         ((128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 2),
          (64, 64, 8, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 128, 4, 3), (32, 64, 4, 3))]


def sweep_rows(args, seq: int, dtype: torch.dtype) -> list[dict]:
    """Per tile configuration of :data:`SWEEP`: forward and backward ms (full and causal) and the fused ring step."""
    q, k, v, dout = random_qkv(args.batch, seq, args.heads, args.kv_heads, args.head_dim, dtype,
                               torch.device("cuda"), args.seed)
    scale = args.head_dim ** -0.5
    chosen, rows = triton_attn._config, []
    try:
        for cfg in SWEEP:
            triton_attn._config = lambda device, backward=False, cfg=cfg: cfg
            row = dict(S=seq, **cfg)
            try:
                for causal, tag in ((False, "full"), (True, "causal")):
                    out, lse = triton_attn.attention_forward(q, k, v, causal, scale)
                    row[f"fwd_{tag}"] = _time(lambda: triton_attn.attention_forward(q, k, v, causal, scale),
                                              args.iters, args.warmup)
                    row[f"bwd_{tag}"] = _time(lambda: triton_attn.attention_backward(dout, q, k, v, out, lse, causal,
                                                                                     scale), args.iters, args.warmup)
                row["ring_fused"] = _time(_fused_ring_step(q, k, v, scale), args.iters, args.warmup)
            except Exception as e:  # a configuration that does not fit (shared memory) is a row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
            rows.append(row)
    finally:
        triton_attn._config = chosen
    return rows


def main() -> None:
    p = parser(__doc__, seq=[8192, 16384, 32768, 65536], dtype="bf16", heads=32, head_dim=128,
               timing=(10, 3), native_op=False)
    p.add_argument("--sweep", action="store_true", help="first time the Triton kernels under several tile configs")
    p.add_argument("--softcap", type=float, default=0.0,
                   help="logit soft-cap of the plain rows (Gemma 2: 50); 0: none. A backend without it in its "
                        "kernel (torch SDPA) runs its soft-capped path")
    args = parse(p)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/triton_attn.py needs a CUDA GPU (on CPU Triton runs in its interpreter)")
    dtype = DTYPES[args.dtype]
    sweep = []
    if args.sweep:
        sweep = sweep_rows(args, args.seqs[0], dtype)
        timed = ["fwd_full", "bwd_full", "fwd_causal", "bwd_causal", "ring_fused"]
        print(table(sweep, ["S", "BM", "BN", "warps", "stages", *timed, "error"], fmt={c: ".2f" for c in timed}))
    plain = [row for seq in args.seqs for causal in (False, True) for row in plain_rows(args, seq, causal, dtype)]
    print(table(plain, ["S", "causal", "backend", "softcap", "fwd_ms", "bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
                        "error"],
                fmt={"fwd_ms": ".2f", "bwd_ms": ".2f", "fwd_tflops": ".0f", "fwd_bwd_tflops": ".0f"}))
    ring = [row for seq in args.seqs for row in ring_rows(args, seq, dtype)]
    print(table(ring, ["S", "step", "ms"], fmt={"ms": ".2f"}))
    save_results(args.json, args, sweep + plain + ring)


if __name__ == "__main__":
    main()
