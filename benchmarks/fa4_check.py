"""FlashAttention-4 against cuDNN's attention op on one GPU (issue 65): equality, then speed, forward and backward.

Run (CUDA; Hopper or Blackwell for FA4, with flash-attn-4 installed, e.g. ``pip install -e ".[fa4]"``):

    python benchmarks/fa4_check.py --out fa4_check_h200.json
    python benchmarks/fa4_check.py --dry-run --out /tmp/fa4_dry.json   # CPU: tiny shapes, the torch backend stands in

For each head dim (64: the 1.5B Llama shape, 32 query and 8 kv heads; 128: Llama-3.2 3B's, 24 and 8) and each
length (16K to 128K), bf16, causal, batch 1, shortest lengths first (a run stopped early keeps both head dims), each
kernel runs forward then backward on the same inputs, the backward from its own forward's ``(out, lse)`` as ds-usp's
ring does:

* ``cudnn``: PyTorch's cuDNN attention op as ds-usp's torch backend calls it (``torch_sdpa._cuda_cudnn_forward``);
* ``flash_attn_4``: ds-usp's FA4 adapter (``flash_attn4.attention_forward``), after its once-per-kind device check
  (``flash_attn4.disagreement``, whose answer the row keeps).

Errors (``err_*``: max absolute difference over the max magnitude of the reference): out, lse and dq against exact
fp32 attention of ``--rows`` sampled query rows (the last row among them) over all their keys, computed here from
the same bf16 inputs; dk and dv, which need every row, against the other kernel (cuDNN's for FA4's row). ``merge``:
FA4's second half of queries as ds-usp's ring computes it (the earlier half of the keys, a full block, merged by
log-sum-exp with the causal diagonal block) against its one-call result. Times: CUDA events, median of ``--iters``
after ``--warmup``; ``first_s`` the first forward+backward (FA4 compiles its kernels then). TFLOP/s: ``4 b h s^2 d``
for the forward, 2.5 times that for the backward, halved for the causal mask (the benchmark's convention).

The JSON (``--out``; a bare name goes into benchmarks/results/) has the provenance, the arguments, the versions of
FA4 and of what it runs on (None: not installed), why a kernel could not run (``unavailable``: where flash-attn-4 is
not installed or does not import, the reason, and the cuDNN rows alone), and the rows; each is written as soon as it
is measured. On the project's GPU machine FA4 travels in two device calls (``benchmarks/gpu_wheels.sh fa4``, then
``benchmarks/gpu_session.sh``'s ``fa4stage`` and ``fa4`` steps; docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from _common import comma_list, log, table, write_result
from ds_usp.kernels import flash_attn4 as fa4
from ds_usp.kernels import torch_sdpa

SHAPES = {64: (32, 8), 128: (24, 8)}  # head dim -> (query heads, kv heads): the two Llama shapes
DRY_SHAPES = {16: (4, 2), 32: (4, 1)}
Kernel = tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, Tensor, Tensor]]]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (the dry run's defaults are tiny)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file (a bare name goes into benchmarks/results/)")
    p.add_argument("--head-dims", type=comma_list(int), default=None, help="default 64,128 (dry run: 16,32)")
    p.add_argument("--seqs", type=comma_list(int), default=None, help="default 16K,32K,64K,128K (dry run: 64,96)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", type=int, default=64, help="query rows the exact reference is computed for")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the torch backend for both kernels")
    args = p.parse_args(argv)
    args.head_dims = args.head_dims or (list(DRY_SHAPES) if args.dry_run else list(SHAPES))
    args.seqs = args.seqs or ([64, 96] if args.dry_run else [16384, 32768, 65536, 131072])
    return args


def kernels(device: torch.device) -> tuple[dict[str, Kernel], dict[str, str]]:
    """The kernels to time on ``device`` and, for any that cannot run, why. On CPU (the dry run) the torch backend
    stands in for both."""
    if device.type == "cpu":
        plain = (torch_sdpa.attention_forward, torch_sdpa.attention_backward)
        return {"cudnn": plain, "flash_attn_4": plain}, {}
    found: dict[str, Kernel] = {}
    missing: dict[str, str] = {}
    if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        found["cudnn"] = (torch_sdpa._cuda_cudnn_forward, lambda dout, q, k, v, out, lse, causal, scale, cap:
                          torch_sdpa._cuda_cudnn_backward(dout, q, k, v, out, lse, causal, scale))
    else:
        missing["cudnn"] = "this torch has no _scaled_dot_product_cudnn_attention"
    reason = fa4.unavailable_reason(device)
    if reason is None:
        found["flash_attn_4"] = (fa4.attention_forward, fa4.attention_backward)
    else:
        missing["flash_attn_4"] = reason
    return found, missing


def exact_rows(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, rows: Tensor, scale: float) -> dict[str, Tensor]:
    """Causal attention of the query ``rows`` over all their keys in fp32: out, lse and dq (exact per row:
    ``dq_i = scale sum_j p_ij (dout_i.v_j - dout_i.out_i) k_j``), each ``(b, len(rows), h, ...)``/``(b, h, rows)``."""
    groups = q.shape[2] // k.shape[2]
    kf, vf = (x.float().repeat_interleave(groups, dim=2) for x in (k, v))  # (b, s, hq, d)
    qr, dr = q[:, rows].float(), dout[:, rows].float()  # (b, r, hq, d)
    s = torch.einsum("brhd,bshd->bhrs", qr, kf) * scale  # (b, hq, r, s)
    keys = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(keys[None, None, None, :] > rows[None, None, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, hq, r)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhrs,bshd->brhd", p, vf)
    dp = torch.einsum("brhd,bshd->bhrs", dr, vf)
    ds = p * (dp - (dr * out).sum(-1).transpose(1, 2)[..., None])
    dq = torch.einsum("bhrs,bshd->brhd", ds, kf) * scale
    return {"out": out, "lse": lse, "dq": dq}


def rel_err(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want|."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def timed(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, the wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def merge_error(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float) -> float:
    """The ring's use of ``kernel``: the later half of the queries against the earlier half of the keys (full) and
    the diagonal block (causal), merged by log-sum-exp, against the one-call ``out`` of those rows."""
    fwd, h = kernel[0], q.shape[1] // 2
    o1, l1 = fwd(q[:, h:], k[:, :h], v[:, :h], False, scale, 0.0)
    o2, l2 = fwd(q[:, h:], k[:, h:], v[:, h:], True, scale, 0.0)
    merged = torch.logaddexp(l1, l2)  # (b, hq, s/2)
    w1, w2 = (torch.exp(x - merged).transpose(1, 2)[..., None] for x in (l1, l2))
    merged_out = o1.float() * w1 + o2.float() * w2
    return max(rel_err(merged_out, out[:, h:]), rel_err(merged, lse[:, :, h:]))


def measure(name: str, kernel: Kernel, inputs: tuple[Tensor, ...], exact: dict[str, Tensor], rows: Tensor,
            args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], tuple[Tensor, ...]]:
    """One kernel's row at one shape (first call, errors against the exact rows, times and TFLOP/s) and its
    gradients."""
    q, k, v, dout = inputs
    fwd, bwd = kernel
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    out, lse = fwd(q, k, v, True, scale, 0.0)
    grads = bwd(dout, q, k, v, out, lse, True, scale, 0.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    row: dict[str, Any] = {"kernel": name, "first_s": time.perf_counter() - t0,
                           "err_out": rel_err(out[:, rows], exact["out"]),
                           "err_lse": rel_err(lse[:, :, rows], exact["lse"]),
                           "err_dq": rel_err(grads[0][:, rows], exact["dq"])}
    fwd_ms = timed(lambda: fwd(q, k, v, True, scale, 0.0), args.iters, args.warmup, device)
    bwd_ms = timed(lambda: bwd(dout, q, k, v, out, lse, True, scale, 0.0), args.iters, args.warmup, device)
    b, s, h, d = q.shape
    flops = 4 * b * h * s * s * d / 2  # causal: half the square
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops / fwd_ms / 1e9, bwd_tflops=2.5 * flops / bwd_ms / 1e9,
               tflops=3.5 * flops / (fwd_ms + bwd_ms) / 1e9)
    if name == "flash_attn_4":
        row["merge_err"] = merge_error(kernel, q, k, v, out, lse, scale)
    return row, grads


def shape_rows(d: int, s: int, found: dict[str, Kernel], args: argparse.Namespace,
               device: torch.device) -> list[dict[str, Any]]:
    """Every kernel's row at head dim ``d`` and length ``s`` (one that fails or runs out of memory: its error)."""
    hq, hkv = (DRY_SHAPES if args.dry_run else SHAPES).get(d, (max(1, 2048 // d), max(1, 512 // d)))
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    inputs = tuple(torch.randn(1, s, h, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv, hq))
    rows = torch.linspace(0, s - 1, min(args.rows, s), device=device).round().long().unique()
    exact = exact_rows(*inputs, rows, d ** -0.5)
    out, grads = [], {}
    for name, kernel in found.items():
        base = {"head_dim": d, "heads": hq, "kv_heads": hkv, "seq": s}
        if name == "flash_attn_4" and device.type == "cuda":
            base["check"] = fa4.disagreement(device, dtype, d, hq != hkv, True, 0.0) or "equal"
        try:
            row, grads[name] = measure(name, kernel, inputs, exact, rows, args, device)
        except Exception as exc:  # out of memory, FA4's assertions, the CuTe DSL's compile errors: the row says which
            row = {"kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out.append({**base, **row})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "cudnn" in grads and "flash_attn_4" in grads:  # dk, dv: against the other kernel (they need every row)
        for row in out:
            if row["kernel"] == "flash_attn_4":
                row["err_dk_vs_cudnn"] = rel_err(grads["flash_attn_4"][1], grads["cudnn"][1])
                row["err_dv_vs_cudnn"] = rel_err(grads["flash_attn_4"][2], grads["cudnn"][2])
    return out


def versions() -> dict[str, Optional[str]]:
    """The versions of FA4 and what it runs on (None: not installed), and cuDNN's."""
    from importlib import metadata

    found: dict[str, Optional[str]] = {}
    for name in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                 "nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-cu12", "quack-kernels", "apache-tvm-ffi",
                 "torch-c-dlpack-ext", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    return found


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Measure every row, print the table, and return (and write) the result."""
    args = parse_args(argv)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    found, missing = kernels(device)
    result: dict[str, Any] = {"benchmark": "fa4_check", "dry_run": args.dry_run, "args": vars(args),
                              "versions": versions(), "unavailable": missing, "rows": []}
    for name, why in missing.items():
        log(f"{name} not run: {why}")
    for s in args.seqs:  # shortest first: a run stopped early keeps every head dim's short rows
        for d in args.head_dims:
            result["rows"] += shape_rows(d, s, found, args, device)
            write_result(args.out, result)
            log(f"head dim {d}, {s} tokens: done")
    cols = ["kernel", "head_dim", "seq", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "err_out", "err_lse",
            "err_dq", "err_dk_vs_cudnn", "merge_err", "first_s", "check", "error"]
    print(table(result["rows"], cols, fmt={c: ".3g" for c in cols[3:13]}))
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
