"""The planner against brute force (issue 25): every split of 4 CPU ranks timed, beside the split the planner ranks first.

Run (each split is one ``benchmarks/long_seq.py`` job of 4 ranks, one after the other, on an idle machine):

    python benchmarks/plan_check.py --seq 8192 --json plan_check.json

The model is long_seq.py's (HF Llama, vocab 32000, hidden 256, 4 layers, 8 heads, 4 kv heads by default), ZeRO-3,
the memory features ds-usp's "auto" picks (selective checkpointing, tiled MLP, chunked loss: the planner's
``selective`` preset). The planner gets this machine's numbers, measured here first: the matmul rate of one thread
(fp32, as the ranks train) and the copy bandwidth of one thread, both divided by the ranks sharing a core. On
CPU a step's wall time with 4 ranks on fewer cores is total work, which is also what the planner's per-rank time
ranks when every rank does the same work. Printed: each split's predicted and measured step time, and the
measured time of the planner's first pick over the fastest measured (target <= 1.10).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from _common import parse, parser, save_results, start_ranks, table

TAG = "[plan_check]"
TARGET = 1.10


def measured_hardware(ranks: int) -> dict:
    """One thread's fp32 matmul TFLOP/s and copy GB/s, shared by the ranks on this machine's cores."""
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    tflops = 10 * 2 * 1024 ** 3 / (time.perf_counter() - t) / 1e12
    x = torch.empty(64 * 2 ** 20 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    gbps = 10 * 2 * x.numel() * 4 / (time.perf_counter() - t) / 1e9
    share = min(1.0, (os.cpu_count() or 1) / ranks)
    return {"peak_tflops": tflops * share, "intra_bw": gbps * share}


def main() -> int:
    p = parser(__doc__, seq=8192, dtype=None, heads=8, ranks=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=896)
    p.add_argument("--vocab", type=int, default=32000)
    args = parse(p)
    if args.kv_heads == args.heads:
        args.kv_heads = args.heads // 2
    from ds_usp.cost import Hardware
    from ds_usp.plan import plans, shape_by_hand

    hw_numbers = measured_hardware(args.ranks)
    hw = Hardware(1, args.ranks, 1024.0, hw_numbers["peak_tflops"], hw_numbers["intra_bw"], hw_numbers["intra_bw"], 1.0)
    shape = shape_by_hand(args)
    priced = [c for c in plans(shape, hw, args.seq, elem_bytes=4, zero=3, presets=["selective"])
              if c.problem is None and c.settings.dp == 1]
    print(f"{TAG} this machine, per rank: {hw.peak_tflops * 1e3:.1f} GFLOP/s, {hw.intra_bw:.1f} GB/s; planner order: "
          + ", ".join(f"{c.settings.ulysses}x{c.settings.ring} ({c.time.total:.2f} s)" for c in priced), flush=True)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"plan_check_{os.getpid()}.json"
    systems = [f"ds-usp {c.settings.ulysses}x{c.settings.ring}" for c in priced]
    start_ranks(Path(__file__).with_name("long_seq.py"),  # one process, which starts a job per split
                ["--seqs", args.seq, "--systems", ",".join(systems), "--ranks", args.ranks, "--zero", 3, "--layers",
                 args.layers, "--hidden", args.hidden, "--intermediate", args.intermediate, "--vocab", args.vocab,
                 "--heads", args.heads, "--kv-heads", args.kv_heads, "--json", out], check=True)
    measured = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    rows = [{"split": f"{c.settings.ulysses}x{c.settings.ring}", "planner_rank": i + 1, "predicted_s": c.time.total,
             "predicted_GiB": c.memory.total / 2 ** 30, "measured_s": measured[s]["step_s"],
             "growth_MiB": measured[s]["peak_MiB"]} for i, (c, s) in enumerate(zip(priced, systems))]
    print(table(rows, fmt={"predicted_s": ".3f", "predicted_GiB": ".3f", "measured_s": ".1f"}))
    fastest = min(r["measured_s"] for r in rows)
    ratio = rows[0]["measured_s"] / fastest
    print(f"{TAG} the planner's first pick {rows[0]['split']} takes {ratio:.2f} x the fastest split measured "
          f"(target <= {TARGET}: {'met' if ratio <= TARGET else 'missed'})")
    print(f"{TAG} results written to {save_results(args.json, dict(vars(args), hardware=hw_numbers), rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
