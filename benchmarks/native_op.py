"""The native op against its PyTorch twins: each of the six methods, same inputs, same outputs, best-of-N time.

Run (one process; the first run JIT-builds the op with ninja, about a minute, into torch's extension cache):

    python benchmarks/native_op.py --threads 1,2 --iters 50 --json native_op.json
    python benchmarks/native_op.py --table native_op.json     # docs/benchmarks.md's table from a run's file

``ds_usp.native.load_native_op`` (``NativeOps``) and ``ds_usp.native.TorchOps`` (the twins, what ``usp.native_op``
false runs and what ``"auto"`` falls back to) have the same methods. Each is called here the way ds-usp calls it
(:mod:`ds_usp.attention.ring` and :mod:`ds_usp.attention.ulysses`), at the shapes of three setups:

* ``cpu 4x1/1x4``: the CPU attention benchmark's ranks (S = 8192 over 4 ranks, H = H_kv = 8, D = 64, fp32);
* ``llama-8b 8x1/4x2``: a Llama-3-8B layer at 32K tokens over 8 ranks (H = 32, H_kv = 8, D = 128, bf16);
* ``gqa b=2 4x1/2x2``: two sequences per micro-batch of S = 8192 over 4 ranks, H = 16, H_kv = 2 (replicated 2x for
  U = 4), D = 64, bf16.

``merge_block_`` folds a block into half of a running ``(out, lse)`` (the views the ring passes: a zigzag half of
the rank's rows, the LSE strided); ``accumulate_`` adds a block's gradient into an fp32 accumulator, contiguous (dq)
and strided (dk, a slice of the last dim of the dk|dv buffer). Outputs must agree (the packing and accumulation
bitwise, the merge and the replica sums within fp32 rounding) or the run exits 1. Time: the best of ``--iters``
calls after ``--warmup``, twin and native in turn (in-place arguments restored, untimed, before each call), on
``--threads`` intra-op threads (default 1, as every rank of the multi-rank benchmarks runs). ``native/twin`` below 1
is the op faster.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from _common import base_parser, comma_list, log, result_path, save_results, table


@dataclasses.dataclass(frozen=True)
class Setup:
    """One workload: the attention's shape on one rank and its split."""

    name: str
    batch: int
    seq: int  # the rank's tokens before the all-to-all (S / N)
    heads: int
    kv_heads: int
    head_dim: int
    ulysses: int  # U of the all-to-all calls
    ring_rows: int  # the rank's ring piece (S / R) for the merge and the accumulations
    ring_heads: int  # heads a ring rank holds (H / U of its split)
    dtype: torch.dtype


SETUPS = {
    "cpu": Setup("cpu 4x1/1x4", 1, 2048, 8, 8, 64, 4, 8192 // 4, 8, torch.float32),
    "llama8b": Setup("llama-8b 8x1/4x2", 1, 4096, 32, 8, 128, 8, 32768 // 2, 32 // 4, torch.bfloat16),
    "gqa": Setup("gqa b=2 4x1/2x2", 2, 2048, 16, 2, 64, 4, 4096, 4, torch.bfloat16),
}


def rep_of(kv_heads: int, u: int) -> int:
    """How often each kv head is repeated for a Ulysses degree ``u`` (as ``ds_usp.attention.ulysses``)."""
    return u // kv_heads if kv_heads < u else 1


Case = tuple[str, Callable[[Any], Any], Callable[[], None], Callable[[Any], Any]]


def cases(s: Setup, gen: torch.Generator) -> list[Case]:
    """``(method, call(ops), restore(), output(returned))`` for every call of the six methods at setup ``s``:
    ``call`` is what is timed; ``output`` turns its return value (or the buffers it updated in place) into what
    is compared."""
    b, d, dt = s.batch, s.head_dim, s.dtype

    def rand(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    def nothing() -> None:
        return None

    out: list[Case] = []
    # the ring's merge: the running fp32 (out, lse) of the rank's piece, a block folded into one zigzag half
    rows, h, half = s.ring_rows, s.ring_heads, slice(s.ring_rows // 2, s.ring_rows)
    run_out, run_lse = rand(b, rows, h, d, dtype=torch.float32), rand(b, h, rows, dtype=torch.float32)
    run_lse[:, :, half.start: half.start + 7] = float("-inf")  # padding rows that saw no key yet
    block_out, block_lse = rand(b, rows // 2, h, d), rand(b, h, rows // 2, dtype=torch.float32)
    saved = run_out.clone(), run_lse.clone()

    def restore_merge() -> None:
        run_out.copy_(saved[0])
        run_lse.copy_(saved[1])

    out.append(("merge_block_",
                lambda ops: ops.merge_block_(run_out[:, half], run_lse[:, :, half], block_out, block_lse),
                restore_merge, lambda _: (run_out.clone(), run_lse.clone())))
    # the ring backward's accumulations: dq (contiguous) and dk (the first half of the last dim of dk|dv)
    hkv = max(1, s.ring_heads * s.kv_heads // s.heads)
    dq, dq_b = torch.zeros(b, rows, h, d), rand(b, rows // 2, h, d)
    dkv, dk_b = torch.zeros(b, rows, hkv, 2 * d), rand(b, rows // 2, hkv, d)
    out.append(("accumulate_ dq", lambda ops: ops.accumulate_(dq[:, half], dq_b), dq.zero_, lambda _: dq.clone()))
    out.append(("accumulate_ dk (strided)", lambda ops: ops.accumulate_(dkv[..., :d][:, half], dk_b), dkv.zero_,
                lambda _: dkv.clone()))
    # Ulysses: q, k, v into the send buffer and back; the output (or the gradients) the way back
    u, rep = s.ulysses, rep_of(s.kv_heads, s.ulysses)
    q, k, v = rand(b, s.seq, s.heads, d), rand(b, s.seq, s.kv_heads, d), rand(b, s.seq, s.kv_heads, d)
    heads = [s.heads // u, s.kv_heads * rep // u, s.kv_heads * rep // u]
    recv = rand(u, b, s.seq, sum(heads), d)
    out_heads = rand(b, u * s.seq, s.heads // u, d)
    same = lambda x: x  # noqa: E731 - the return value is the output
    out.append(("pack_seq_to_head", lambda ops: ops.pack_seq_to_head([q, k, v], [1, rep, rep], u), nothing, same))
    view = " (b=1: a view)" if b == 1 else ""  # both return a view of their input then: nothing to time but Python
    out.append(("unpack_seq_to_head" + view, lambda ops: ops.unpack_seq_to_head(recv), nothing, same))
    out.append(("pack_head_to_seq" + view, lambda ops: ops.pack_head_to_seq([out_heads], u), nothing, same))
    out.append(("unpack_head_to_seq", lambda ops: ops.unpack_head_to_seq(recv, heads, [1, rep, rep]), nothing, same))
    return out


def best_of(calls: Sequence[Callable[[], Any]], restore: Callable[[], None], iters: int, warmup: int) -> list[float]:
    """The fastest of ``iters`` timed calls of each of ``calls`` (seconds), taken in turn (twin, native, twin, ...)
    so that both see the same machine, ``restore`` untimed before each."""
    best = [float("inf")] * len(calls)
    for i in range(warmup + iters):
        for j, call in enumerate(calls):
            restore()
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            if i >= warmup:
                best[j] = min(best[j], dt)
    return best


def flat(x: Any) -> list[torch.Tensor]:
    return [t for y in x for t in flat(y)] if isinstance(x, (list, tuple)) else [x]


def compare(got: Any, want: Any) -> tuple[float, bool, Optional[str]]:
    """Largest absolute difference (over finite entries), bitwise equality, and why they are not close (or None:
    ``torch.testing.assert_close``'s tolerances for the dtype, infinities where the twin has them)."""
    diff, bitwise, why = 0.0, True, None
    for a, b in zip(flat(got), flat(want)):
        bitwise &= a.shape == b.shape and torch.equal(a, b)
        finite = torch.isfinite(b)
        if finite.any():
            diff = max(diff, (a.float() - b.float())[finite].abs().max().item())
        try:
            torch.testing.assert_close(a, b)
        except AssertionError as e:
            why = why or str(e).splitlines()[0]
    return diff, bitwise, why


def markdown(rows: list[dict], threads: Sequence[int]) -> str:
    """docs/benchmarks.md's table: per setup and method the times at the first thread count and the ratio at each,
    then per setup the sum of its rows (each method called once)."""
    first, cells = threads[0], []
    by = {(r["setup"], r["method"], r["threads"]): r for r in rows}
    for setup in dict.fromkeys(r["setup"] for r in rows):
        methods = list(dict.fromkeys(r["method"] for r in rows if r["setup"] == setup))
        for method in methods + ["all of the above, once each"]:
            at = {t: [by[(setup, m, t)] for m in (methods if method not in methods else [method])] for t in threads}
            line = {"setup": setup, "method": method,
                    f"twin ms ({first} thr)": sum(r["twin_ms"] for r in at[first]),
                    f"native ms ({first} thr)": sum(r["native_ms"] for r in at[first])}
            for t in threads:
                line[f"native/twin, {t} thr"] = (sum(r["native_ms"] for r in at[t]) / sum(r["twin_ms"] for r in at[t]))
            cells.append(line)
    fmt = {c: (".3f" if "ms" in c else ".2f") for c in cells[0]} if cells else {}
    return table(cells, fmt=fmt, markdown=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = base_parser(__doc__, seed=0)
    p.add_argument("--setups", type=comma_list(str, list(SETUPS)), default=list(SETUPS),
                   help=f"comma-separated, from {', '.join(SETUPS)}")
    p.add_argument("--threads", type=comma_list(int), default=[1], help="intra-op threads, comma-separated")
    p.add_argument("--iters", type=int, default=20, help="timed calls per method (the fastest is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    p.add_argument("--table", default="", help="print the Markdown table of this results file, run nothing")
    args = p.parse_args(argv)
    if args.table:
        run = json.loads(result_path(args.table).read_text())
        print(markdown(run["rows"], run["args"]["threads"]))
        return 0

    from ds_usp.native import TorchOps, load_native_op

    t0 = time.perf_counter()
    native = load_native_op("cpu")
    log(f"native op: {native.source} ({native.module.__file__}), loaded in {time.perf_counter() - t0:.1f} s")
    twins = TorchOps()
    rows, bad = [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for key in args.setups:
            setup = SETUPS[key]
            for method, call, restore, output in cases(setup, torch.Generator().manual_seed(args.seed)):
                restore()
                want = output(call(twins))
                restore()
                got = output(call(native))
                diff, bitwise, why = compare(got, want)
                if method.startswith(("accumulate_", "pack_", "unpack_seq")) and not bitwise:
                    why = why or "not bitwise equal"  # documented as bitwise equal (ds_usp/native/__init__.py)
                if why:
                    bad.append(f"{setup.name} {method}: {why}")
                t_twin, t_native = best_of([lambda: call(twins), lambda: call(native)], restore, args.iters,
                                           args.warmup)
                rows.append({"setup": setup.name, "method": method, "threads": threads, "dtype": str(setup.dtype)[6:],
                             "twin_ms": 1e3 * t_twin, "native_ms": 1e3 * t_native, "native/twin": t_native / t_twin,
                             "max_abs_diff": diff, "bitwise": bitwise})
                log(f"{setup.name:<17} {method:<25} threads {threads}: twin {1e3 * t_twin:8.3f} ms, native "
                    f"{1e3 * t_native:8.3f} ms, native/twin {t_native / t_twin:.2f}")
    print(table(rows, fmt={"twin_ms": ".3f", "native_ms": ".3f", "native/twin": ".2f", "max_abs_diff": ".2g"}))
    print(markdown(rows, args.threads))
    meta = dict(vars(args), native_source=native.source, setups={k: dataclasses.asdict(SETUPS[k]) for k in args.setups})
    log(f"results written to {save_results(args.json, meta, rows)}")
    if bad:
        print("outputs differ:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
