"""Packed documents and sliding windows (issue 13): time, work and balance of USP attention on 4 CPU ranks.

Run:

    deepspeed --num_gpus 4 --master_port 29690 benchmarks/packed.py --seq 16384 --json packed.json

A packed row of ``--seq`` tokens is drawn from a long-tail mix of document lengths (lognormal, median
about 400 tokens, fixed seed). For every ``(U, R)`` split of the ranks and every layout that differs
there (all three with a ring; zigzag alone for Ulysses only), ``ds_usp.usp_attention`` runs forward
and backward (causal, ``--heads`` x ``--head-dim``, fp32) on:

* ``one``: the row as one sequence;
* ``packed``: the row with its documents (``doc_lens``);
* ``window``: the row as one sequence with a sliding window of ``--window`` tokens (zigzag only).

Reported per row: the wall time of a step (:func:`_common.timed`), its ratio to ``one``, the work
ratio (allowed causal pairs over those of one sequence: ``sum d_i (d_i + 1) / S (S + 1)`` for the
documents), ``vs_ideal`` = (ratio to ``one``) / work ratio, the per-rank imbalance (max/mean) of the work
the ring computes (counted from the block plan) and of the CPU time the ranks spent
(``time.thread_time``; 4 ranks share 2 cores, so the wall time is the total work, the CPU times show
who did how much). Targets: packed ``vs_ideal`` <= 1.2; work imbalance <= 1.15 with the balanced layout.
"""
from __future__ import annotations

import random
import statistics
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from _common import (DTYPES, NATIVE_OP, Timing, close_distributed, init_distributed, log, parse, parser, random_qkv,
                     save_results, splits, table, timed)

TIME_TARGET = 1.2  # packed time <= 1.2 x work ratio x one-document time
BALANCE_TARGET = 1.15  # max/mean per-rank work with the balanced layout


def long_tail_docs(seq: int, seed: int) -> list[int]:
    """Document lengths summing to ``seq``: lognormal (median ~400 tokens), the last one cut to fit."""
    rng, docs, total = random.Random(seed), [], 0
    while total < seq:
        docs.append(min(max(1, int(rng.lognormvariate(6.0, 1.3))), seq - total))
        total += docs[-1]
    return docs


def ring_work(seq: int, u: int, r: int, layout: str, docs: Optional[list[int]], window: Optional[int]) -> list[int]:
    """Allowed (query, key) pairs each ring rank computes, from the ring's block plan."""
    from ds_usp.attention.masks import MaskSpec, RowMask, block_parts
    from ds_usp.sharding import normalize_docs, padded_length, piece_runs, segment_bounds

    padded = padded_length(seq, u, r, layout)
    starts = normalize_docs(docs, 1, seq)
    spec = MaskSpec(causal=True, seq_len=seq, docs=starts, window=None if window is None else (window - 1, 0))
    pieces = [piece_runs(padded, r, i, layout, segment_bounds(starts, seq, padded)) for i in range(r)]
    work = []
    for me in range(r):
        pairs = 0
        for src in range(r):
            for part in block_parts(spec, RowMask(starts[0] if starts else (0,)), pieces[me], pieces[src]):
                nq, nk = part.q.stop - part.q.start, part.k.stop - part.k.start
                i = torch.arange(nq).unsqueeze(1)
                j = torch.arange(nk).unsqueeze(0)
                keep = torch.ones(nq, nk, dtype=torch.bool)
                if part.lo is not None:
                    keep &= j - i >= part.lo
                if part.hi is not None:
                    keep &= j - i <= part.hi
                pairs += int(keep.sum())
        work.append(pairs)
    return work


def time_attention(args: Any, topo: Any, layout: str, full: Sequence[torch.Tensor], docs: Optional[list[int]],
                   window: Optional[int], device: torch.device) -> Timing:
    """Forward+backward of ``usp_attention`` on this layout's shards, timed by :func:`_common.timed`."""
    import ds_usp

    q, k, v, dout = (ds_usp.shard_sequence(x, topo, layout=layout, doc_lens=docs) for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kwargs = dict(causal=True, layout=layout, seq_len=args.seq, doc_lens=docs, native_op=NATIVE_OP[args.native_op],
                  window=None if window is None else (window - 1, 0))

    def step() -> None:
        q.grad = k.grad = v.grad = None
        ds_usp.usp_attention(q, k, v, topo, **kwargs).backward(dout)

    return timed(step, args.iters, args.warmup, device)[0]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Measure every split and layout; print the table and the targets on rank 0."""
    p = parser(__doc__, seq=16384, timing=(3, 1))
    p.add_argument("--window", type=int, default=4096, help="sliding window (tokens a query sees, itself included)")
    p.add_argument("--docs-seed", type=int, default=0, help="seed of the document mix")
    args = parse(p, argv)
    import ds_usp

    device = init_distributed(args.timeout)
    world = dist.get_world_size()
    docs = long_tail_docs(args.seq, args.docs_seed)
    total_pairs = args.seq * (args.seq + 1) // 2
    ratio = sum(d * (d + 1) // 2 for d in docs) / total_pairs
    log(f"{len(docs)} documents (median {statistics.median(docs):.0f}, longest {max(docs)}), work ratio {ratio:.3f}")
    full = random_qkv(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], device,
                      args.seed)
    rows = []
    for u, r in splits(world):
        topo = ds_usp.USPTopology.build(u, r)
        layouts = ("zigzag", "balanced", "contiguous") if r > 1 else ("zigzag",)
        for layout in layouts:
            cases = [("one", None, None, 1.0), ("packed", docs, None, ratio)]
            if layout == "zigzag":
                w = ring_work(args.seq, u, r, layout, None, args.window)
                cases.append((f"window {args.window}", None, args.window, sum(w) / total_pairs))
            one = None
            for name, d, window, work_ratio in cases:
                t = time_attention(args, topo, layout, full, d, window, device)
                wall = t.wall
                one = one or wall
                work = ring_work(args.seq, u, r, layout, d, window)
                row = {"split": f"{u}x{r}", "layout": layout, "case": name, "wall_s": wall, "vs_one": wall / one,
                       "work_ratio": work_ratio, "vs_ideal": wall / one / work_ratio,
                       "work_imbalance": max(work) / (sum(work) / len(work)), "cpu_imbalance": t.imbalance(2)}
                rows.append(row)
                log(f"{u}x{r} {layout} {name}: {wall:.2f} s ({row['vs_one']:.2f} x one, work ratio "
                    f"{work_ratio:.3f}), work imbalance {row['work_imbalance']:.2f}")
    if dist.get_rank() == 0:
        print(table(rows, fmt={"wall_s": ".2f", "vs_one": ".2f", "work_ratio": ".3f", "vs_ideal": ".2f",
                               "work_imbalance": ".2f", "cpu_imbalance": ".2f"}))
        packed = [r for r in rows if r["case"] == "packed"]
        timing = all(r["vs_ideal"] <= TIME_TARGET for r in packed)
        balance = all(r["work_imbalance"] <= BALANCE_TARGET for r in packed if r["layout"] == "balanced")
        detail = ", ".join(f"{r['split']} {r['layout']} {r['vs_ideal']:.2f}" for r in packed)
        log(f"packed time / (work ratio x one time) <= {TIME_TARGET}: {'met' if timing else 'MISSED'} ({detail})")
        log(f"balanced layout work imbalance <= {BALANCE_TARGET}: {'met' if balance else 'MISSED'}")
        log(f"results written to {save_results(args.json, args, rows)}")
    close_distributed()


if __name__ == "__main__":
    main()
