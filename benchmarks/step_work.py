"""One training step's work, ds-usp against DeepSpeed's ALST full recipe, counted on CPU (issue 49, item 3).

    python benchmarks/step_work.py --json step_work.json                 # the 1.5B layer sizes, S 8192 and 16384
    python benchmarks/step_work.py --shape small --seqs 2048 --systems "ds-usp as ALST" --json step_work_small.json

Each system at each length is its own job of ``--ranks`` gloo ranks (``torch.distributed.run``, ``--master-port``
counting up), fp32 (CPU bf16 matmuls without AVX512-BF16 run about 100x slower), ZeRO-3 with AdamW, one sequence of
S random tokens per step: ``--warmup`` steps (optimizer states made; ZeRO-3 records its trace in the second, so its
prefetch runs from the third) whose matmuls and attention kernels write zeros
(:class:`ds_usp.instruments.work_meter.ZeroCompute`, the same counts after as after real steps:
tests/test_step_work.py), then one step counted by :class:`ds_usp.instruments.work_meter.StepMeter` and a second
counted under ``ZeroCompute`` (what both do is what every step repeats).

The model (``--shape``): a HuggingFace Llama with ``--layers`` decoder layers (default 2) of the ``1.5b`` sizes (hidden
2048, intermediate 8192, 32 query and 8 key/value heads of 64; vocab 32768, whose fp32 optimizer state fits this
machine where 128256's does not) or the ``small`` ones (hidden 256, intermediate 1024, 4/2 heads, vocab 8192: the
test's). Systems (:data:`SYSTEMS`), the memory features the same on both sides:

* ``ALST full``: benchmarks/long_seq.py's ``alst_system``: DeepSpeed's ``UlyssesSPAttentionHF``, ``TiledMLP`` with
  ``ceil(S_local / hidden)`` shards, ``TiledFusedLogitsLoss`` (1/8 GiB fp32 logits tiles) and HF's full
  non-reentrant gradient checkpointing;
* ``ds-usp as ALST``: ``chunked_loss`` true, ``tiled_mlp`` true, ``activation_checkpointing`` "full",
  ``offload_activations`` false and ``memory_gib`` ``--memory-gib`` (80: the sizes "auto" gives them on an 80 GiB GPU);
* ``ds-usp auto``: every memory key "auto" within ``memory_gib`` (for information: the features it takes differ).

ds-usp runs its PyTorch twins (``native_op`` false): the native op's C++ work is invisible to a dispatch mode.
Printed: both systems side by side with the ratio per count, and issue 49's CPU targets (ds-usp's FLOPs and aten ops
at or under ALST's at every length; no read of a device value inside a decoder layer and at most one per step in
ds-usp's own code; every allocation over 64 MiB that both metered steps make, with its call site and whether a
buffer kept across steps would avoid it). ``--json``: the raw counts with their provenance.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_job_flags, base_parser, comma_list, job_port, run_as_job, start_ranks, table,  # noqa: E402
                     write_result)
from ds_usp.instruments.work_meter import StepMeter, ZeroCompute  # noqa: E402

TAG = "[step_work]"
SHAPES = {
    "1.5b": dict(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=32768),
    "small": dict(hidden=256, intermediate=1024, heads=4, kv_heads=2, head_dim=64, vocab=8192),
}
ALST_FEATURES = {"chunked_loss": True, "tiled_mlp": True, "activation_checkpointing": "full",
                 "offload_activations": False}
USP_KEYS = {"ds-usp as ALST": ALST_FEATURES, "ds-usp auto": {}}
SYSTEMS = ("ALST full", *USP_KEYS)
REFERENCE, SAME_FEATURES = "ALST full", "ds-usp as ALST"
# buffers a code path asks for itself: a buffer kept across steps (same shape every step) would replace them
FACTORIES = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.zeros", "aten.zeros_like", "aten.new_empty",
             "aten.new_zeros", "aten.new_empty_strided", "aten.full", "aten.full_like", "aten.ones", "aten.ones_like",
             "aten.new_full", "aten.new_ones"}
OWNERS = (("ds_usp/", "ds-usp"), ("deepspeed/", "DeepSpeed"), ("transformers/", "transformers"),
          ("benchmarks/", "benchmark"))
COUNTS = (("ops", "aten ops", "d"), ("zero3_param_ops", "of them ZeRO-3 gathering/releasing parameters", "d"),
          ("ops_net", "aten ops, less those", "d"), ("ops_max", "aten ops, busiest rank", "d"),
          ("kernels", "kernels", "d"),
          ("matmuls", "matmuls", "d"), ("matmul_min_dim", "smallest matmul dim", "d"), ("tflop", "TFLOP", ".3f"),
          ("tflop_max", "TFLOP, busiest rank", ".3f"), ("syncs", "host syncs", "d"),
          ("own_syncs", "syncs in the system's own code", "d"), ("layer_syncs", "syncs inside a decoder layer", "d"),
          ("big_allocs", "outputs > 64 MiB", "d"), ("big_gib", "GiB in outputs > 64 MiB", ".2f"),
          ("sac_ops", "ops through SAC's modes", "d"), ("custom_ops", "custom ops", "d"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = base_parser(__doc__, ranks=2, master_port=29900, timeout=7200.0)
    p.add_argument("--shape", choices=list(SHAPES), default="1.5b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seqs", type=comma_list(int), default=[8192, 16384], help="comma-separated global lengths")
    p.add_argument("--systems", type=comma_list(str, SYSTEMS), default=list(SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEMS)}")
    p.add_argument("--warmup", type=int, default=2, help="steps before the metered one (ZeRO-3's trace: 2)")
    p.add_argument("--real-warmup", action="store_true", help="warm-up steps compute (default: ZeroCompute)")
    p.add_argument("--memory-gib", type=float, default=80.0, help="ds-usp's usp.memory_gib")
    p.add_argument("--note", default="", help="a line kept with the results (e.g. which ds_usp tree was counted)")
    add_job_flags(p)
    args = p.parse_args(argv)
    if args.ranks < 1 or args.warmup < 0 or args.layers < 1:
        p.error("--ranks and --layers must be at least 1, --warmup at least 0")
    return args


def model_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags benchmarks/long_seq.py's systems read (its model, DeepSpeed config and tokens)."""
    return argparse.Namespace(**SHAPES[args.shape], layers=args.layers, seed=0, batch=1, zero=3, ranks=args.ranks,
                              dtype="fp32", layout="zigzag", native_op="off")


# ------------------------------------------------------------------------------------------------ one job


@contextlib.contextmanager
def engines_made() -> Iterator[list]:
    """The DeepSpeed engines constructed inside (ds-usp's and ALST's builders make theirs)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    made, original = [], DeepSpeedEngine.__init__

    def init(self: Any, *a: Any, **k: Any) -> None:
        original(self, *a, **k)
        made.append(self)

    DeepSpeedEngine.__init__ = init
    try:
        yield made
    finally:
        DeepSpeedEngine.__init__ = original


@contextlib.contextmanager
def engine_phases(meter: StepMeter, engine: Any) -> Iterator[None]:
    """The engine's backward counted as ``bwd`` (its hooks and reductions outside autograd too), its step as
    ``optimizer`` (wrapped on the instance, where ds-usp's failure notes wrap them too)."""
    saved = {}
    for method, phase in (("backward", "bwd"), ("step", "optimizer")):
        original = getattr(engine, method)
        saved[method] = vars(engine).get(method)  # an instance attribute (ds-usp's), or None: the class's method

        def wrapped(*a: Any, _original: Any = original, _phase: str = phase, **k: Any) -> Any:
            with meter.phase(_phase):
                return _original(*a, **k)

        setattr(engine, method, wrapped)
    try:
        yield
    finally:
        for method, original in saved.items():
            if original is None:
                delattr(engine, method)
            else:
                setattr(engine, method, original)


def usp_system(name: str, seq: int, margs: argparse.Namespace, memory_gib: float) -> tuple[Callable[[], float],
                                                                                         Callable[[], str]]:
    """A ds-usp system's step, as benchmarks/long_seq.py's ``usp_system`` with this benchmark's ``usp`` keys."""
    from long_seq import usp_engine

    usp = dict(USP_KEYS[name], memory_gib=memory_gib, layout=margs.layout, native_op=False)
    engine, step = usp_engine(margs, usp, seq)
    topo = engine.usp.topo

    def describe() -> str:
        choices = engine.usp.memory.choices if engine.usp.memory else None
        return f"{topo.ulysses_degree}x{topo.ring_degree} {engine.usp.layout}; " + (
            choices.describe(margs.layers) if choices is not None else "no memory features")

    return step, describe


def trace_state(engine: Any) -> str:
    """ZeRO-3's parameter trace: INVALID (fetch on demand), RECORD or COMPLETE (prefetch from it)."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None:
        return "no ZeRO-3 coordinator"
    coordinator = offload.get_param_coordinator()
    return next((state for state, check in (("COMPLETE", "is_complete_trace"), ("RECORD", "is_record_trace"),
                                             ("INVALID", "is_invalid_trace")) if getattr(coordinator, check)()), "?")


def count_step(system: str, seq: int, args: argparse.Namespace) -> dict:
    """On every rank of a running world: build ``system``, warm up, count a step and a second under ZeroCompute.

    Returns:
        This rank's ``{"system", "S", "rank", "plan", "trace", "seconds", "loss", "counted": report of the real
        step, "again": report of the second}``.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    margs = model_args(args)
    with engines_made() as engines:
        if system in USP_KEYS:
            step, describe = usp_system(system, seq, margs, args.memory_gib)
        else:
            from long_seq import alst_system

            step, describe = alst_system(system, seq, margs)
    for _ in range(args.warmup):
        with contextlib.nullcontext() if args.real_warmup else ZeroCompute():
            step()
    trace = trace_state(engines[-1])
    reports, loss, seconds = [], None, None
    for real in (True, False):
        meter = StepMeter()
        dist.barrier()
        start = time.perf_counter()
        with contextlib.nullcontext() if real else ZeroCompute(), engine_phases(meter, engines[-1]), meter:
            value = step()
        if real:
            loss, seconds = value, time.perf_counter() - start
        reports.append(meter.report())
    return {"system": system, "S": seq, "rank": dist.get_rank(), "plan": describe(), "trace": trace,
            "seconds": seconds, "loss": loss, "counted": reports[0], "again": reports[1]}


def run_job(args: argparse.Namespace) -> dict:
    """One job (``--role "system|S"``): :func:`count_step` on every rank; rank 0 returns rank 0's row with every rank's
    totals (``ranks``), the others nothing."""
    import torch.distributed as dist

    from _common import close_distributed

    system, seq = args.role.split("|")
    row = count_step(system, int(seq), args)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"total": row["counted"]["total"], "again": row["again"]["total"]})
    close_distributed()
    return dict(row, ranks=every) if row["rank"] == 0 else {}


def launch(system: str, seq: int, port: int, args: argparse.Namespace, argv: Sequence[str]) -> dict:
    """Run one job of ``--ranks`` ranks and return its row (``error`` set when it failed)."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"step_work_{os.getpid()}_{system.replace(' ', '_')}_{seq}.json"
    out.unlink(missing_ok=True)
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/meter_ext"), "OMP_NUM_THREADS": "1"}
    print(f"{TAG} {system} S={seq}: counting ({args.ranks} ranks, port {port})", flush=True)
    start = time.perf_counter()
    log = out.with_suffix(".log")
    try:
        proc = start_ranks(__file__, [*argv, "--role", f"{system}|{seq}", "--out", out], args.ranks, port=port,
                           env=env, timeout=args.timeout, capture=True, echo=False)
        log.write_text(proc.stdout + proc.stderr)
        errors = [line for line in proc.stderr.splitlines() if "Error" in line and "elastic" not in line]
        failed = proc.returncode != 0 and f"{(errors or ['exit ' + str(proc.returncode)])[0][:300]} (log: {log})"
    except subprocess.TimeoutExpired:
        failed = f"timed out after {args.timeout:.0f} s"
    wall = time.perf_counter() - start
    if failed or not out.exists():
        return {"system": system, "S": seq, "error": failed or "no result written", "job_seconds": wall}
    log.unlink(missing_ok=True)
    row = json.loads(out.read_text())
    out.unlink()
    print(f"{TAG} {system} S={seq}: {row['plan']}; {wall:.0f} s\n{_describe(row['counted'])}", flush=True)
    return dict(row, job_seconds=wall)


# ---------------------------------------------------------------------------------------------- the report


def owner(site: str) -> str:
    """Whose code a call site is in (:data:`OWNERS`)."""
    return next((who for prefix, who in OWNERS if site.startswith(prefix)), "other")


def figures(row: dict, system: str) -> dict:
    """The counts of :data:`COUNTS` for one row: the real step's on rank 0, and the busiest rank's ops and FLOPs."""
    report = row["counted"]
    total = report["total"]
    mine = "ds-usp" if system.startswith("ds-usp") else "DeepSpeed"  # ALST's recipe is DeepSpeed's code
    ranks = [r["total"] for r in row.get("ranks") or [report]]
    zero3 = total.get("zero3_param_ops", 0)  # (not in rows counted before the meter counted it)
    return dict(total, zero3_param_ops=zero3, ops_net=total["ops"] - zero3,
                tflop=total["flops"] / 1e12, big_gib=total["big_alloc_bytes"] / 2 ** 30,
                ops_max=max(r["ops"] for r in ranks), flops_max=max(r["flops"] for r in ranks),
                tflop_max=max(r["flops"] for r in ranks) / 1e12,
                own_syncs=sum(s["count"] for s in report["syncs"] if owner(s["site"]) == mine),
                layer_syncs=sum(s["count"] for s in report["syncs"] if s["in_layer"]))


def repeated_allocs(row: dict) -> list[dict]:
    """The outputs over 64 MiB both metered steps made at the same call site, each with whether a buffer kept across
    steps would avoid it (a buffer the code asks for itself, a factory, in ds-usp's code or DeepSpeed's)."""
    again = {(a["op"], a["mib"], a["site"]): a["count"] for a in row["again"]["big_allocs"]}
    out = []
    for a in row["counted"]["big_allocs"]:
        n = min(a["count"], again.get((a["op"], a["mib"], a["site"]), 0))
        if n:
            out.append(dict(a, count=n, owner=owner(a["site"]),
                            kept_buffer_avoids=a["op"] in FACTORIES and owner(a["site"]) != "benchmark"))
    return out


def compare(rows: list[dict]) -> tuple[str, list[dict], dict]:
    """The side-by-side table (one line per count; per S the systems and ds-usp's ratio to ALST), and the targets."""
    by = {(r["system"], r["S"]): r for r in rows if "error" not in r}
    seqs = sorted({r["S"] for r in rows})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    lines = []
    for key, label, spec in COUNTS:
        line = {"count": label}
        for seq in seqs:
            ref = by.get((REFERENCE, seq))
            for system in systems:
                row = by.get((system, seq))
                value = figures(row, system)[key] if row else None
                line[f"{system} {seq // 1024}K"] = None if value is None else format(value, spec)
                if system != REFERENCE and ref and value is not None:
                    base = figures(ref, REFERENCE)[key]
                    line[f"{system} {seq // 1024}K / ALST"] = f"{value / base:.2f}" if base else "-"
        lines.append(line)
    targets: dict[str, Any] = {}
    for seq in seqs:
        usp, ref = by.get((SAME_FEATURES, seq)), by.get((REFERENCE, seq))
        if not usp:
            continue
        f = figures(usp, SAME_FEATURES)
        syncs = usp["counted"]["syncs"]
        t = {"own_syncs": f["own_syncs"], "own_syncs_met": f["own_syncs"] <= 1,
             "own_syncs_in_layer": sum(s["count"] for s in syncs if s["in_layer"] and owner(s["site"]) == "ds-usp"),
             "syncs_in_layer": f["layer_syncs"], "syncs_in_layer_met": f["layer_syncs"] == 0,
             "repeated_allocs": repeated_allocs(usp)}
        t["repeated_allocs_met"] = not any(a["kept_buffer_avoids"] for a in t["repeated_allocs"])
        if ref:
            g = figures(ref, REFERENCE)
            t.update(flops=f["flops_max"], flops_alst=g["flops_max"], flops_met=f["flops_max"] <= g["flops_max"],
                     ops=f["ops_max"], ops_alst=g["ops_max"], ops_met=f["ops_max"] <= g["ops_max"])
        targets[str(seq)] = t
    return table(lines, markdown=True), lines, targets


def _describe(report: dict) -> str:
    total = report["total"]
    lines = [f"  {total['ops']} ops, {total['matmuls']} matmuls (smallest dim {total['matmul_min_dim']}), "
             f"{total['flops'] / 1e12:.3f} TFLOP, {total['syncs']} syncs, {total['big_allocs']} outputs > 64 MiB"]
    lines += [f"  sync {s['count']}x {s['kind']}{' [in a decoder layer]' if s['in_layer'] else ''} at {s['site']}"
              + (f" (via {s['via']})" if s["via"] else "") for s in report["syncs"]]
    return "\n".join(lines)


def targets_text(targets: dict) -> str:
    """Issue 49's CPU targets in words."""
    out = []
    for seq, t in targets.items():
        if "flops" in t:  # the busiest rank's
            out.append(f"S={seq}: FLOPs {t['flops'] / 1e12:.3f} vs ALST {t['flops_alst'] / 1e12:.3f} TFLOP "
                       f"({'met' if t['flops_met'] else 'MISSED'}); aten ops {t['ops']} vs ALST {t['ops_alst']} "
                       f"({'met' if t['ops_met'] else 'MISSED'})")
        out.append(f"S={seq}: syncs in ds-usp's own code {t['own_syncs']} (at most 1: "
                   f"{'met' if t['own_syncs_met'] else 'MISSED'}), inside a decoder layer {t['syncs_in_layer']} "
                   f"(none: {'met' if t['syncs_in_layer_met'] else 'MISSED'})")
        for a in t["repeated_allocs"]:
            out.append(f"S={seq}:   repeated every step: {a['count']}x {a['op']} {a['mib']} MiB at {a['site']}"
                       + (f" (via {a['via']})" if a["via"] else "") + f" [{a['owner']}; a kept buffer "
                       + ("would avoid it]" if a["kept_buffer_avoids"] else "would not: an op's result]"))
        out.append(f"S={seq}: no repeated allocation a kept buffer would avoid: "
                   f"{'met' if t['repeated_allocs_met'] else 'MISSED'}")
    return "\n".join(f"{TAG} {line}" for line in out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if run_as_job(args, run_job):
        return 0
    rows = []
    for seq in args.seqs:
        for system in args.systems:
            rows.append(launch(system, seq, job_port(args, len(rows)), args, argv))
    for r in rows:
        if "error" in r:
            print(f"{TAG} {r['system']} S={r['S']} FAILED: {r['error']}")
    text, lines, targets = compare(rows)
    print(f"{TAG} one training step, rank 0 of {args.ranks}, {args.shape} sizes x {args.layers} layers, fp32, ZeRO-3")
    print(text)
    print(targets_text(targets))
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k not in ("role", "out")}
        spec = importlib.util.find_spec("ds_usp")
        path = write_result(args.json, {"benchmark": "step_work", "args": meta, "shape": SHAPES[args.shape],
                                        "layers": args.layers, "dtype": "fp32", "ds_usp": spec and spec.origin,
                                        "minutes": sum(r["job_seconds"] for r in rows) / 60, "table": lines,
                                        "targets": targets, "rows": rows})
        print(f"{TAG} results written to {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
