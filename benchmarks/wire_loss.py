r"""Does compressing activations on the wire hurt training? The demo's loss curve under ``usp.comm_dtype`` values.

Run (it launches the quick-start demo, ``examples/train_llama.py`` on 4 CPU ranks, U=2 x R=2, ZeRO-3, once per
``--runs`` entry, one after the other, then compares):

    python benchmarks/wire_loss.py --steps 200 --json wire_loss.json

``--runs`` lists ``comm_dtype:seed`` entries (default ``input:0,fp8:0,input:1``): the first is the reference;
the same seed gives the same weights and the same batches, so ``fp8:0`` against ``input:0`` is the wire's effect
alone, and ``input:1`` (other weights, other batch order) is the run-to-run spread a user sees anyway. Printed per
run: the mean loss of the last 20 steps, the mean and largest absolute loss difference from the reference (all
steps, and the last 50), the median tokens/s after the first step (4 ranks share the machine's cores: the
total work), and the bytes one rank sends per attention layer (forward + backward, the closed form of
:mod:`ds_usp.cost`, which tests/test_comm_volume.py checks against a meter).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import MIB, base_parser, job_port, log, save_results, start_ranks, table  # noqa: E402

DEMO_CONFIG = ROOT / "ds_configs" / "cpu_demo.json"
SHAPE = {"seq-len": 1024, "hidden": 128, "heads": 4, "kv-heads": 2}  # passed to the demo: the bytes below are its


def run_demo(wire: str, seed: int, steps: int, out: Path, port: int) -> list[dict]:
    """Train the demo once with ``usp.comm_dtype = wire``; returns its log rows (one per step)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(DEMO_CONFIG.read_text())
    config["usp"]["comm_dtype"] = wire
    path = out / "ds_config.json"
    path.write_text(json.dumps(config))
    (out / "log.jsonl").unlink(missing_ok=True)
    flags = ["--deepspeed_config", path, "--steps", steps, "--seed", seed, "--save-every", 0, "--out", out]
    log(f"{wire} seed {seed}:")
    start_ranks(ROOT / "examples" / "train_llama.py", flags + [x for key, value in SHAPE.items()
                                                              for x in (f"--{key}", value)],
                4, launcher="deepspeed", port=port, cwd=ROOT, check=True)
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) != steps:
        raise RuntimeError(f"{out}/log.jsonl has {len(rows)} steps, expected {steps}")
    return rows


def wire_bytes(wire: str) -> float:
    """Bytes one rank sends per attention layer, forward + backward, at the demo's shape, degrees and dtype."""
    from ds_usp.cost import backward_bytes, forward_bytes

    config = json.loads(DEMO_CONFIG.read_text())
    half = any(config.get(key, {}).get("enabled") for key in ("bf16", "fp16"))
    a = (1, SHAPE["seq-len"], SHAPE["heads"], SHAPE["kv-heads"], SHAPE["hidden"] // SHAPE["heads"],
         config["usp"]["ulysses_degree"], config["usp"]["ring_degree"], 2 if half else 4)
    return forward_bytes(*a, comm_dtype=wire).total + backward_bytes(*a, comm_dtype=wire).total


def compare(runs: dict[str, list[dict]], steps: int) -> list[dict]:
    """One row per run against the first run's losses."""
    ref_label, ref = next(iter(runs.items()))
    tail = min(50, steps)
    rows = []
    for label, rows_ in runs.items():
        diff = [abs(a["loss"] - b["loss"]) for a, b in zip(rows_, ref)]
        rows.append({"run": label, "vs": ref_label, "loss last 20": statistics.mean(r["loss"] for r in rows_[-20:]),
                     "mean |dloss|": statistics.mean(diff), "max |dloss|": max(diff),
                     f"mean |dloss| last {tail}": statistics.mean(diff[-tail:]),
                     "tokens/s": statistics.median(r["tokens_per_s"] for r in rows_[1:]) if steps > 1 else None,
                     "MiB sent/layer": wire_bytes(label.split(":")[0]) / MIB})
    return rows


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """The loss curves, and each run's difference from the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ref = next(iter(runs.values()))
    for label, rows in runs.items():
        top.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, lw=1)
        bottom.plot([r["step"] for r in rows], [a["loss"] - b["loss"] for a, b in zip(rows, ref)], label=label, lw=1)
    top.set_ylabel("loss")
    top.legend()
    bottom.set_ylabel(f"loss - {next(iter(runs))}")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # same bytes on every run


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo per ``--runs`` entry, print the comparison, write JSON and a plot."""
    p = base_parser(__doc__, master_port=29720)
    p.add_argument("--port", dest="master_port", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # --master-port's old name
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--runs", default="input:0,fp8:0,input:1", help="comma-separated comm_dtype:seed, the first is "
                   "the reference")
    p.add_argument("--out", default="runs/wire_loss", help="each run's log goes to OUT/<comm_dtype>-<seed>")
    args = p.parse_args(argv)
    runs = {}
    for i, entry in enumerate(args.runs.split(",")):
        wire, seed = entry.split(":")
        runs[entry] = run_demo(wire, int(seed), args.steps, ROOT / args.out / f"{wire}-{seed}", job_port(args, i))
    rows = compare(runs, args.steps)
    print(f"demo (examples/train_llama.py, 4 CPU ranks, U=2 x R=2, ZeRO-3, fp32, {args.steps} steps), each run against "
          f"{rows[0]['run']}:\n" + table(rows, fmt={c: ".4f" for c in rows[0] if "loss" in c} |
                                         {"tokens/s": ".0f", "MiB sent/layer": ".3f"}), flush=True)
    plot(runs, ROOT / args.out / "loss.png")
    log(f"plot: {ROOT / args.out / 'loss.png'}; results: "
        f"{save_results(args.json, vars(args), [dict(r, losses=[x['loss'] for x in runs[r['run']]]) for r in rows])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
