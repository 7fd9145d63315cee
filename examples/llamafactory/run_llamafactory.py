"""LLaMA-Factory 0.9.5 (`llamafactory-cli train`) with ds-usp's JSON key: per-step losses of sequence-parallel runs
against one-rank references, on CPU ranks.

    python examples/llamafactory/run_llamafactory.py [--out runs/llamafactory] [--stages sft pt] [--runs ...]

Run it with the Python of the environment that has LLaMA-Factory, DeepSpeed and ds-usp installed (see
examples/llamafactory/README.md); `llamafactory-cli` is taken from beside that Python. From the repository root:

1. builds the tiny Llama, its tokenizer and the datasets (make_tiny_llama.py) in OUT/assets;
2. for each stage (sft.yaml, pt.yaml) runs, one after the other (2 cores: never two at once):

   =========== ===== ============================ ====================================================
   run         ranks DeepSpeed JSON               what
   =========== ===== ============================ ====================================================
   ref_z2      1     ds_z2.json                   the reference: no "sequence_parallel" key, ZeRO-2
   ref_z3      1     ds_z3.json                   the same with ZeRO-3
   usp2_z2     2     ds_z2_usp2.json              "sequence_parallel": "usp", size 2 (1 replica)
   usp2_z3     2     ds_z3_usp2.json              the same, ZeRO-3
   usp2x2_z2   4     ds_z2_usp2x2.json            size 4 = ulysses 2 x ring 2 (1 replica)
   usp2x2_z3   4     ds_z3_usp2x2.json            the same, ZeRO-3
   usp2dp2_z2  4     ds_z2_usp2.json              size 2 on 4 ranks: 2 replicas, per_device_train_batch_size 1
   usp2dp2_z3  4     ds_z3_usp2.json              the same, ZeRO-3
   =========== ===== ============================ ====================================================

   each as `FORCE_TORCHRUN=1 NNODES=1 NPROC_PER_NODE=<ranks> MASTER_PORT=<own port> llamafactory-cli train
   examples/llamafactory/<stage>.yaml model_name_or_path=... dataset_dir=... output_dir=OUT/<stage>_<run>
   deepspeed=examples/llamafactory/<json>` with `DS_ACCELERATOR=cpu` (gloo), its output in OUT/<stage>_<run>.log;
3. reads each run's per-step losses from OUT/<stage>_<run>/trainer_log.jsonl (LLaMA-Factory's log: the Trainer's
   unrounded `loss` per logging step) and prints a table: each run's losses and the largest difference from the
   reference of its ZeRO stage (ref_z2 for *_z2, ref_z3 for *_z3; ref_z3 itself against ref_z2), or the error it
   stopped on. OUT/summary.json holds the same.

The global batch is the same in every run: per_device_train_batch_size 2 x gradient_accumulation_steps 2 x
data-parallel replicas 1 = 4 rows per optimizer step. The references are one rank; every sequence-parallel run
puts all its ranks into one sequence-parallel group (sequence_parallel_size = world size), so it has one replica,
and its ranks each hold a shard of the same 2 rows' sequence; the usp2dp2 runs (size 2 on 4 ranks, 2 replicas) take
per_device_train_batch_size 1, so their global batch is the same 4 rows.

Exit status 0 when every run that was asked for finished and each sequence-parallel run's losses are within --tol
of its reference at every step; 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# name: (DeepSpeed JSON, ranks, extra YAML overrides)
RUNS = {
    "ref_z2": ("ds_z2.json", 1, []),
    "ref_z3": ("ds_z3.json", 1, []),
    "usp2_z2": ("ds_z2_usp2.json", 2, []),
    "usp2_z3": ("ds_z3_usp2.json", 2, []),
    "usp2x2_z2": ("ds_z2_usp2x2.json", 4, []),
    "usp2x2_z3": ("ds_z3_usp2x2.json", 4, []),
    # size 2 on 4 ranks: 2 replicas, each 1 row per device, the same global batch
    "usp2dp2_z2": ("ds_z2_usp2.json", 4, ["per_device_train_batch_size=1"]),
    "usp2dp2_z3": ("ds_z3_usp2.json", 4, ["per_device_train_batch_size=1"]),
}
ERROR = re.compile(r"^(?:\[rank\d+\]: )?((?:[\w]+\.)*\w*(?:Error|Exception|Changed|Refused|Interrupt)\w*: .*)$")


def reference_of(run: str) -> str | None:
    if run == "ref_z2":
        return None
    if run == "ref_z3":
        return "ref_z2"
    return "ref_z3" if run.endswith("_z3") else "ref_z2"


def run_env(ranks: int, port: int, args) -> dict:
    env = {**os.environ, "FORCE_TORCHRUN": "1", "NNODES": "1", "NODE_RANK": "0", "NPROC_PER_NODE": str(ranks),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": args.extensions_dir, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "WANDB_DISABLED": "true", "HF_DATASETS_CACHE": str(Path(args.out).resolve() / "hf_datasets_cache"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if args.disable_version_check:
        env["DISABLE_VERSION_CHECK"] = "1"
    return env


def first_error(log: Path) -> str | None:
    """The exception a run stopped on: the last `...Error: message` line of rank 0 (or of any process)."""
    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    found = [m.group(1) for m in map(ERROR.match, lines) if m]
    rank0 = [m.group(1) for line in lines if line.startswith("[rank0]: ") for m in [ERROR.match(line)] if m]
    pick = (rank0 or found or [None])[-1]
    if pick and "CalledProcessError" in pick and found:
        pick = next((f for f in reversed(found) if "CalledProcessError" not in f and "ChildFailedError" not in f),
                    pick)
    return pick[:600] if pick else None


def ds_usp_lines(log: Path) -> list[str]:
    if not log.exists():
        return []
    return [line.strip() for line in log.read_text(errors="replace").splitlines() if line.startswith("[ds_usp] INFO")
            and ("->" in line or "sequence_parallel=usp" in line or "degrees" in line)]


def losses(out_dir: Path) -> list[float]:
    path = out_dir / "trainer_log.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if r.get("loss") is not None]


def run_one(stage: str, name: str, ds_json: str, ranks: int, extra: list[str], port: int, assets: Path, args) -> dict:
    out = Path(args.out).resolve()
    out_dir = out / f"{stage}_{name}"
    log = out / f"{stage}_{name}.log"
    cli = Path(sys.executable).parent / "llamafactory-cli"
    cmd = [str(cli), "train", str(HERE / f"{stage}.yaml"), f"model_name_or_path={assets / 'model'}",
           f"dataset_dir={assets / 'data'}", f"output_dir={out_dir}", f"deepspeed={HERE / ds_json}",
           f"max_steps={args.steps}", *extra]
    env = run_env(ranks, port, args)
    shown = (f"FORCE_TORCHRUN=1 NNODES=1 NPROC_PER_NODE={ranks} MASTER_PORT={port} DS_ACCELERATOR=cpu "
             f"TORCH_EXTENSIONS_DIR={args.extensions_dir} " + " ".join(cmd))
    print(f"[{stage} {name}] {shown}", flush=True)
    start = time.time()
    with open(log, "w") as f:
        f.write(f"$ {shown}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"stage": stage, "run": name, "ranks": ranks, "deepspeed": ds_json, "rc": rc,
              "seconds": round(time.time() - start, 1), "loss": losses(out_dir), "log": str(log),
              "error": None if rc == 0 else first_error(log), "ds_usp": ds_usp_lines(log), "command": shown}
    status = "ok" if rc == 0 else f"rc={rc}: {result['error']}"
    print(f"[{stage} {name}] {result['seconds']} s, losses {result['loss']}, {status}", flush=True)
    return result


def table(results: list[dict], tol: float) -> tuple[str, bool]:
    by = {(r["stage"], r["run"]): r for r in results}
    ok = True
    lines = []
    for stage in dict.fromkeys(r["stage"] for r in results):
        lines.append(f"\n== stage: {stage} (global batch 2 rows x 2 accumulation x 1 replica = 4 rows per step) ==")
        lines.append(f"{'run':<11} {'ranks':>5} {'rc':>4} {'secs':>6}  {'per-step loss':<48} {'max|d| vs ref':>14}")
        for r in (x for x in results if x["stage"] == stage):
            ref = by.get((stage, reference_of(r["run"]) or ""))
            loss = " ".join(f"{v:.6f}" for v in r["loss"]) or "-"
            diff = ""
            if r["rc"] != 0:
                ok = False
            if ref is not None:
                if r["loss"] and ref["loss"] and len(r["loss"]) == len(ref["loss"]):
                    d = max(abs(a - b) for a, b in zip(r["loss"], ref["loss"]))
                    diff = f"{d:.2e} ({ref['run']})"
                    if r["run"].startswith("usp") and d > tol:
                        ok = False
                        diff += " DIFFERS"
                else:
                    diff = "n/a"
                    ok = False
            lines.append(f"{r['run']:<11} {r['ranks']:>5} {str(r['rc']):>4} {r['seconds']:>6.0f}  {loss:<48} {diff:>14}")
            if r["rc"] != 0:
                lines.append(f"    error: {r['error']}")
            for info in r["ds_usp"][:3]:
                lines.append(f"    {info[:220]}")
    return "\n".join(lines), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/llamafactory", help="assets, output dirs, logs, summary.json")
    parser.add_argument("--stages", nargs="+", default=["sft", "pt"], choices=["sft", "pt"])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=4, help="max_steps of every run")
    parser.add_argument("--tol", type=float, default=1e-4, help="largest per-step loss difference from the reference")
    parser.add_argument("--port", type=int, default=29611, help="MASTER_PORT of the first run, +1 for each next one")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--extensions-dir", default=None,
                        help="TORCH_EXTENSIONS_DIR (JIT ops, built once; default OUT/extensions)")
    parser.add_argument("--disable-version-check", action="store_true", help="DISABLE_VERSION_CHECK=1 for LLaMA-Factory")
    parser.add_argument("--extra-run", action="append", default=[], metavar="NAME:JSON:RANKS[:key=value,...]",
                        help="another run, e.g. usp4_z2:ds_z2_usp2x2.json:4:per_device_train_batch_size=2")
    args = parser.parse_args()
    if args.extensions_dir is None:
        args.extensions_dir = str(Path(args.out).resolve() / "extensions")

    runs = {k: RUNS[k] for k in args.runs}
    for spec in args.extra_run:
        name, ds_json, ranks, *over = spec.split(":")
        runs[name] = (ds_json, int(ranks), over[0].split(",") if over else [])
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets = out / "assets"
    subprocess.run([sys.executable, str(HERE / "make_tiny_llama.py"), str(assets)], check=True, cwd=ROOT,
                   env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})

    results = []
    port = args.port
    for stage in args.stages:
        for name, (ds_json, ranks, extra) in runs.items():
            results.append(run_one(stage, name, ds_json, ranks, extra, port, assets, args))
            port += 1
            (out / "summary.json").write_text(json.dumps(results, indent=1))
    text, ok = table(results, args.tol)
    print(text)
    (out / "summary.txt").write_text(text + "\n")
    print(f"\n{'all runs match their references' if ok else 'NOT all runs finished and matched'} (tol {args.tol}); "
          f"logs and summary.json in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
