"""The planner's memory calibration: measure whole training steps, compare with ``ds_usp.cost.step_memory``, refit.

Run (one 4-rank job measures every row in turn, a few minutes on 2 cores):

    deepspeed --num_gpus 4 --master_port 29650 benchmarks/plan_calibration.py --json plan_calibration.json
    python benchmarks/plan_calibration.py --fit plan_calibration.json     # least squares on log(predicted/measured)
    python benchmarks/plan_calibration.py --table plan_calibration.json   # the rows against today's constants

Each row trains an HF Llama (fp32, AdamW, 8 heads, 4 key/value heads) through ``ds_usp.initialize`` for two steps
and records the per-rank peak, the largest over the ranks, in live bytes as ``max_memory_allocated`` counts them on
a GPU (``meters.step_peak``: glibc's mmap threshold fixed at 64 KiB, so a freed tensor leaves the resident set;
with glibc's default the heap keeps freed blocks resident, a slack that depends on the order of allocations and
that ds-usp trims on CPU only around checkpointed layers). The file (a bare name: in ``benchmarks/results/``) is
``{"provenance": ..., "benchmark", "rows": [{"row", "plan", "measured"}, ...]}`` (``_common.write_result``).
``--fit`` prints the :class:`ds_usp.cost.Calibration` constants that fit the rows best and each row's ratio with
them; ``--table`` each row's ratio with the library's constants (docs/planner.md's table).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys

import torch

ROWS = [  # S, U, R, ZeRO, features, layers, vocab, hidden, MLP
    (4096, 2, 2, 2, "off", 4, 8000, 256, 688),
    (4096, 2, 2, 2, "off", 8, 8000, 256, 688),
    (4096, 2, 2, 2, "off", 4, 32000, 256, 688),
    (8192, 2, 2, 2, "off", 4, 8000, 256, 688),
    (4096, 2, 2, 2, "off", 4, 8000, 256, 2048),
    (4096, 2, 2, 2, "off", 4, 8000, 512, 688),
    (8192, 2, 2, 2, "selective", 8, 8000, 256, 688),
    (8192, 2, 2, 2, "full", 8, 8000, 256, 688),
    (8192, 2, 2, 2, "tiled", 8, 8000, 256, 688),
    (8192, 2, 2, 2, "chunked", 8, 8000, 256, 688),
    (8192, 2, 2, 3, "off", 8, 8000, 256, 688),
    (8192, 2, 2, 1, "off", 8, 8000, 256, 688),
    (8192, 1, 4, 2, "off", 8, 8000, 256, 688),
    (8192, 4, 1, 2, "off", 8, 8000, 256, 688),
    (16384, 2, 2, 3, "auto", 4, 32000, 256, 896),
    (8192, 1, 4, 3, "auto", 4, 8000, 256, 688),
    (8192, 4, 1, 1, "full+tiled+chunked8", 4, 8000, 256, 688),
]
OFF = {"activation_checkpointing": False, "tiled_mlp": False, "chunked_loss": False}
FEATURES = {
    "off": OFF, "auto": {}, "selective": dict(OFF, activation_checkpointing="selective"),
    "full": dict(OFF, activation_checkpointing="full"), "tiled": dict(OFF, tiled_mlp=True),
    "chunked": dict(OFF, chunked_loss=True),
    "full+tiled+chunked8": {"activation_checkpointing": "full", "tiled_mlp": True, "chunked_loss": True, "tile_mib": 8},
}


def measure(row: list) -> tuple[int, tuple]:
    """This rank's live-bytes peak of ``row`` and the plan it ran (``meters.step_peak``)."""
    from ds_usp.instruments.meters import step_peak

    seq, u, r, zero, features, layers, vocab, hidden, mlp = row
    return step_peak(seq, u, r, zero, FEATURES[features], layers, vocab, hidden, mlp)


def predicted(row: list, plan: list, cal=None) -> float:
    """The planner's figure for ``row`` run with ``plan`` (``meters.predicted_peak``)."""
    from ds_usp.instruments.meters import predicted_peak

    seq, u, r, zero, _, layers, vocab, hidden, mlp = row
    return predicted_peak(seq, u, r, zero, plan if isinstance(plan, dict) else tuple(plan), layers, vocab, hidden,
                          mlp, cal)


def run_rows(path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = []
    for row in ROWS:
        peak, plan = measure(row)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        measured = max(peaks)
        results.append({"row": list(row), "plan": plan, "measured": measured})
        if dist.get_rank() == 0:
            print(f"[plan_calibration] {row}: measured {measured / 2 ** 20:.0f} MiB, predicted "
                  f"{predicted(list(row), plan) / 2 ** 20:.0f} MiB", flush=True)
    if dist.get_rank() == 0:
        from _common import write_result

        written = write_result(path, {"benchmark": "plan_calibration", "rows": results})
        print(f"[plan_calibration] rows written to {written}")


def load_rows(path: str) -> list[dict]:
    """The measured rows of a file written by :func:`run_rows` (a bare name: in ``benchmarks/results/``)."""
    from _common import result_path

    return json.loads(result_path(path).read_text())["rows"]


def print_table(rows: list[dict], cal=None) -> None:
    """docs/planner.md's table: each row's prediction with ``cal`` (default: the library's constants), measured."""
    print("| S | U x R | ZeRO | features | layers | vocab | hidden | MLP | predicted MiB | measured MiB | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        seq, u, rr, zero, features, layers, vocab, hidden, mlp = r["row"]
        p, m = predicted(r["row"], r["plan"], cal), r["measured"]
        print(f"| {seq} | {u}x{rr} | {zero} | {features} | {layers} | {vocab} | {hidden} | {mlp} | {p / 2 ** 20:.0f} | "
              f"{m / 2 ** 20:.0f} | {p / m:.2f} |")


def fit(path: str) -> None:
    """Least squares on log(predicted / measured) over the constants of :class:`ds_usp.cost.Calibration`."""
    from scipy.optimize import least_squares

    from ds_usp.cost import Calibration

    rows = load_rows(path)
    names = ["per_layer_hidden", "per_layer_mlp", "selective_hidden", "logits", "fixed"]
    start = Calibration()
    x0 = [getattr(start, n) for n in names[:-1]] + [start.fixed / 2 ** 20] + list(start.per_param)

    def calibration(x) -> Calibration:
        return Calibration(*x[:4], fixed=x[4] * 2 ** 20, per_param=tuple(x[5:8]))

    def residuals(x) -> list:
        cal = calibration(x)
        return [math.log(predicted(r["row"], r["plan"], cal) / r["measured"]) for r in rows]

    # selective checkpointing keeps at least the ring's output (h per token): the rows alone barely tell it apart
    lower = [0, 0, 1, 0, 0, 0, 0, 0]
    best = least_squares(residuals, [max(v, lo) for v, lo in zip(x0, lower)], bounds=(lower, [math.inf] * 8))
    cal = calibration(best.x)
    print("Calibration(" + ", ".join(f"{n}={getattr(cal, n)!r}" for n in names[:4]) +
          f", fixed={best.x[4]:.0f} * 2 ** 20, per_param={tuple(round(v, 2) for v in best.x[5:8])})")
    print_table(rows, cal)
    print("today's constants:", dataclasses.asdict(Calibration()))


if __name__ == "__main__":
    from _common import base_parser

    p = base_parser(__doc__, json_file="plan_calibration.json")  # --json: where the measured rows go
    p.add_argument("--fit", default="", help="fit the constants to this file of measured rows instead of running")
    p.add_argument("--table", default="", help="print this file's rows against the library's constants, run nothing")
    args = p.parse_args()
    if args.fit:
        fit(args.fit)
    elif args.table:
        print_table(load_rows(args.table))
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        run_rows(args.json)
        sys.exit(0)
