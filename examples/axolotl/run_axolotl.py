"""Train the tiny Llama with axolotl, one process without sequence parallelism and several ranks with the JSON key,
and compare the per-step losses.

    python examples/axolotl/run_axolotl.py [--out runs/axolotl] [--runs ref,z2_usp2,z3_usp2,z2_usp2x2,z3_usp2x2]
                                          [--packed] [--gpu] [--python PY] [--port 29711]

Run it with the Python of the environment that has axolotl, DeepSpeed and ds-usp (``pip install -e .`` there: the
``.pth`` makes axolotl's trainer sequence-parallel when the JSON says so; nothing here imports ds-usp). The
environment is passed on to the runs, so ``PYTHONPATH=/other/checkout`` tries another ds-usp source tree.

What it does:

1. ``make_tiny_llama.py`` builds the model and tokenizer (``OUT/tiny_llama``) unless they exist; the data is
   ``data/tiny_alpaca.jsonl`` (48 alpaca rows, of which axolotl drops the few longer than ``sequence_len`` 128).
2. For each run it writes ``OUT/<run>/config.yaml`` from ``sft.yaml`` (``sft_packed.yaml`` with ``--packed``):
   absolute paths, its own ``output_dir`` and ``dataset_prepared_path``, the run's DeepSpeed JSON, and
   ``use_tensorboard: true`` (the losses are read, unrounded, from the TensorBoard events HF's Trainer writes on
   rank 0; axolotl prints them rounded to 4 digits).
3. It launches each run, one after the other, with its own master port, output in ``OUT/<run>/log.txt``:

   ========== ====== ==================== ==================================================================
   run        ranks  DeepSpeed JSON       launch (CPU)
   ========== ====== ==================== ==================================================================
   ref        1      ds_z2.json (no key)  ``python cpu_launch.py config.yaml``
   z2_usp2    2      ds_z2_usp2.json      ``accelerate launch --multi_gpu --num_processes 2 --main_process_port
                                          P cpu_launch.py config.yaml``
   z3_usp2    2      ds_z3_usp2.json      the same
   z2_usp2x2  4      ds_z2_usp2x2.json    ``... --num_processes 4 ...`` (2 Ulysses x 2 ring)
   z3_usp2x2  4      ds_z3_usp2x2.json    the same
   ========== ====== ==================== ==================================================================

   ``ref3`` (one process, ds_z3.json) is there too, to tell a ZeRO-3 difference from an SP one.
   ``cpu_launch.py`` bridges axolotl's two CUDA assumptions on a CPU-only machine (it says which); with ``--gpu``
   the runs use axolotl's own command instead, ``axolotl train config.yaml --num-processes N --main-process-port P``
   (``--launcher python`` for the one-process reference).
4. It prints each run's per-step losses beside the reference's, their largest difference, and each failed run's
   last error line, and writes ``OUT/summary.json``.

The global batch is the same in every run: the YAML's ``micro_batch_size`` 2 x ``gradient_accumulation_steps`` 2
x the data-parallel replicas. With sequence parallelism of size ``sp`` over ``world`` ranks the replicas are
``world / sp``: 1 for SP 2 on 2 ranks and for SP 4 (2x2) on 4 ranks, as for the one-process reference, so every
optimizer step sees the same 4 rows, each row's tokens split over the SP group. (axolotl itself counts
``world_size`` replicas in its own ``batch_size``, which it only logs; HF's ``"auto"`` ``train_batch_size`` is what
DeepSpeed checks, and ds-usp counts it over ``world / sequence_parallel_size``.)
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

# name: (ranks, DeepSpeed JSON, sequence_parallel_size)
RUNS = {
    "ref": (1, "ds_z2.json", 1),
    "ref3": (1, "ds_z3.json", 1),
    "z2_usp2": (2, "ds_z2_usp2.json", 2),
    "z3_usp2": (2, "ds_z3_usp2.json", 2),
    "z2_usp2x2": (4, "ds_z2_usp2x2.json", 4),
    "z3_usp2x2": (4, "ds_z3_usp2x2.json", 4),
}
DEFAULT_RUNS = "ref,z2_usp2,z3_usp2,z2_usp2x2,z3_usp2x2"


def write_config(template: Path, run_dir: Path, model: Path, ds_json: Path) -> Path:
    """The template YAML with this run's absolute paths (plain line edits: the template's comments stay)."""
    data = (HERE / "data" / "tiny_alpaca.jsonl").resolve()
    keys = {"base_model": str(model), "deepspeed": str(ds_json), "output_dir": str(run_dir / "output"),
            "dataset_prepared_path": str(run_dir / "prepared")}
    lines = []
    for line in template.read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in keys:
            line = f"{key}: {keys.pop(key)}"
        elif line.strip().startswith("- path:") and "tiny_alpaca.jsonl" in line:
            line = line.split("- path:")[0] + f"- path: {data}"
        elif key == "use_tensorboard":
            continue
        lines.append(line)
    lines += [f"{k}: {v}" for k, v in keys.items()] + ["use_tensorboard: true"]
    cfg = run_dir / "config.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def command(args, ranks: int, port: int, cfg: Path) -> list[str]:
    bindir = Path(args.python).parent
    if args.gpu:
        axolotl = [str(bindir / "axolotl"), "train", str(cfg)]
        if ranks == 1:
            return axolotl + ["--launcher", "python"]
        return axolotl + ["--num-processes", str(ranks), "--main-process-port", str(port)]
    wrapper = str(HERE / "cpu_launch.py")
    if ranks == 1:
        return [args.python, wrapper, str(cfg)]
    return [str(bindir / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(ranks),
            "--main_process_port", str(port), wrapper, str(cfg)]


def losses_from_events(output_dir: Path) -> tuple[dict[int, float], float | None]:
    """The ``train/loss`` scalars of the TensorBoard event files under ``output_dir/runs``, and, when there are
    several files, the largest difference between them at a step.

    On a CPU-only host every rank writes a file: under DeepSpeed without ``use_cpu`` accelerate (1.13) counts one
    process per rank (no backend for it to name), so each rank is its own "process 0"; with sequence parallelism
    their losses must agree (the loss is the whole sequence's on every rank)."""
    files = sorted(output_dir.glob("runs/**/events.out.tfevents.*"))
    if not files:
        return {}, None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    per_file = []
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if "train/loss" in acc.Tags().get("scalars", []):
            per_file.append({e.step: e.value for e in acc.Scalars("train/loss")})
    if not per_file:
        return {}, None
    spread = None
    if len(per_file) > 1:
        spread = max((abs(d[s] - per_file[0][s]) for d in per_file[1:] for s in d if s in per_file[0]), default=0.0)
    return per_file[0], spread


LOG_DICT = re.compile(r"\{'loss': [^{}]*\}")
TOKENS_LINE = re.compile(r"'tokens/trainable': '?(\d+)'?")


def losses_from_log(text: str) -> dict[int, float]:
    """Fallback: the Trainer's printed dicts (rounded to 4 digits), one per logged step (told apart by their epoch:
    several ranks may print the same step)."""
    import ast

    by_epoch: dict[float, float] = {}
    for m in LOG_DICT.finditer(text):
        try:
            d = ast.literal_eval(m.group(0))
            by_epoch.setdefault(float(d["epoch"]), float(d["loss"]))
        except (ValueError, SyntaxError, KeyError):
            continue
    return {i + 1: by_epoch[e] for i, e in enumerate(sorted(by_epoch))}


def last_error(text: str) -> str:
    """The last exception line a rank printed (``[rankN]: SomethingError: ...``), or the last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln) for ln in text.splitlines() if ln.strip()]
    pat = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Changed|Refused|Interrupt)|AssertionError|"
                     r"ValueError|RuntimeError|TypeError|KeyError|NotImplementedError)\b.*")
    errors = [ln for ln in lines if pat.match(ln) and not ln.startswith("subprocess.CalledProcessError")
              and "ChildFailedError" not in ln]
    return errors[-1] if errors else (lines[-1] if lines else "")


def usp_lines(text: str) -> list[str]:
    """ds-usp's start-up lines (the trainer it made, the layout it built), once each, without their log prefix."""
    keep = re.compile(r"(\w+Trainer -> USP\w+.*|sequence_parallel=usp: .*)")
    out: list[str] = []
    for ln in text.splitlines():
        m = keep.search(ln)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """End the launcher and every rank under it (torch's launcher starts each rank in a session of its own, so
    killing the launcher's process group would leave them running)."""
    try:
        import psutil

        procs = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing or the launcher gone: the launcher alone
        procs = []
    for p in procs:
        try:
            p.kill()
        except Exception:
            pass
    proc.kill()
    proc.wait()


def run_one(args, name: str, index: int, model: Path, env: dict) -> dict:
    ranks, ds_name, sp = RUNS[name]
    run_dir = Path(args.out).resolve() / name
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    template = HERE / ("sft_packed.yaml" if args.packed else "sft.yaml")
    cfg = write_config(template, run_dir, model, (HERE / ds_name).resolve())
    port = args.port + index
    cmd = command(args, ranks, port, cfg)
    run_env = dict(env, MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
    if ranks == 1:
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            run_env.pop(k, None)
    print(f"[{name}] {ranks} rank(s), {ds_name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(run_dir), env=run_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = "timeout"
    wall = time.time() - t0
    text = (run_dir / "log.txt").read_text(errors="replace")
    losses, spread = losses_from_events(run_dir / "output")
    source = "tensorboard"
    if not losses:
        losses, source = losses_from_log(text), "stdout (4 digits)"
    if not losses:
        source = "nowhere (none logged)"
    # axolotl's compute_loss counts the label tokens (all-reduced over the world) for its tokens/trainable log: with
    # sequence parallelism the count should equal the reference's (each rank counts its shard only)
    tokens = sorted({int(m.group(1)) for m in TOKENS_LINE.finditer(text)})  # cumulative: one value per step
    result = {"run": name, "ranks": ranks, "json": ds_name, "sequence_parallel_size": sp,
              "data_parallel": ranks // sp, "rc": rc, "wall_s": round(wall, 1), "losses": losses,
              "loss_source": source, "tokens_trainable": tokens, "rank_spread": spread, "usp_log": usp_lines(text),
              "command": cmd, "dir": str(run_dir)}
    if rc != 0:
        result["error"] = (f"timed out after {args.timeout:g} s (the launcher and its ranks were killed); last line: "
                           f"{last_error(text)}" if rc == "timeout" else last_error(text))
    status = "ok" if rc == 0 else f"FAILED (rc {rc}): {result['error'][:400]}"
    print(f"[{name}] {wall:.0f} s, {len(losses)} losses; {status}", flush=True)
    return result


def table(results: list[dict], tol: float) -> str:
    ref = next((r for r in results if r["run"] == "ref"), None)
    ref_losses = ref["losses"] if ref else {}
    steps = sorted({s for r in results for s in r["losses"]})
    lines = ["global batch per step: micro_batch_size 2 x gradient_accumulation_steps 2 x data-parallel replicas "
             "(world / sequence_parallel_size) = 4 rows in every run"]
    for r in results:
        lines.append(f"  {r['run']:>10}: {r['ranks']} rank(s), {r['json']}, SP {r['sequence_parallel_size']}, "
                     f"DP {r['data_parallel']} -> {2 * 2 * r['data_parallel']} rows/step; "
                     f"{'ok' if r['rc'] == 0 else 'FAILED'} in {r['wall_s']} s; losses from {r['loss_source']}"
                     + ("" if r["rank_spread"] is None else
                        f" (every rank's events; largest difference between ranks {r['rank_spread']:.1e})"))
        for ln in r["usp_log"]:
            lines.append(f"{'':>14}{ln[:200]}")
        if r["rc"] != 0:
            lines.append(f"{'':>14}error: {r['error'][:600]}")
    head = f"{'step':>4} " + " ".join(f"{r['run']:>22}" for r in results)
    lines += ["", head]
    for s in steps:
        cells = []
        for r in results:
            v = r["losses"].get(s)
            if v is None:
                cells.append(f"{'-':>22}")
            elif r["run"] == "ref" or s not in ref_losses:
                cells.append(f"{v:>22.6f}")
            else:
                cells.append(f"{v:>10.6f} ({v - ref_losses[s]:+.1e})")
        lines.append(f"{s:>4} " + " ".join(cells))
    lines.append("")
    for r in results:
        if r["run"] == "ref" or not ref_losses:
            continue
        common = [s for s in ref_losses if s in r["losses"]]
        if r["rc"] != 0 or not common:
            verdict = "no losses to compare" if not common else "failed"
        else:
            diff = max(abs(r["losses"][s] - ref_losses[s]) for s in common)
            full = len(common) == len(ref_losses)
            verdict = (f"max |loss - ref| = {diff:.2e} over {len(common)} steps: "
                       f"{'MATCH' if diff <= tol and full else 'DIFFERS'} (tolerance {tol:g})")
        if r["tokens_trainable"] and ref["tokens_trainable"]:
            same = r["tokens_trainable"] == ref["tokens_trainable"]
            verdict += (f"; tokens/trainable {r['tokens_trainable']} "
                        f"{'as the reference' if same else 'vs the reference ' + str(ref['tokens_trainable'])}")
        lines.append(f"{r['run']:>10} vs ref: {verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/axolotl", help="model, per-run folders, summary.json")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--packed", action="store_true", help="sft_packed.yaml (sample_packing: true)")
    parser.add_argument("--gpu", action="store_true", help="launch with `axolotl train` (no CPU wrapper)")
    parser.add_argument("--python", default=sys.executable, help="the environment's Python (its bin/ has "
                                                                  "accelerate and axolotl)")
    parser.add_argument("--port", type=int, default=29711, help="master port of the first run (+1 per run)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--tol", type=float, default=2e-5, help="largest |loss - ref| counted as a match")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the model even if it exists")
    args = parser.parse_args()

    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(out / "extensions"))
    env.setdefault("OMP_NUM_THREADS", "1")
    # axolotl's logging config lets other libraries' records through at LOG_LEVEL (default WARNING) only: INFO shows
    # ds-usp's two start-up lines (the trainer it became, the layout it built)
    env.setdefault("LOG_LEVEL", "INFO")
    for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "WANDB_MODE": "disabled", "AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1",
                 "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}.items():
        env[k] = v
    if not args.gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
    env["PATH"] = f"{Path(args.python).parent}{os.pathsep}{env.get('PATH', '')}"

    model = out / "tiny_llama"
    if args.rebuild or not (model / "model.safetensors").exists():
        subprocess.run([args.python, str(HERE / "make_tiny_llama.py"), str(model)], check=True, env=env)

    results = [run_one(args, n, i, model, env) for i, n in enumerate(names)]
    report = table(results, args.tol)
    print("\n" + report)
    (out / "summary.txt").write_text(report + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    sys.exit(0 if all(r["rc"] == 0 for r in results) else 1)


if __name__ == "__main__":
    main()
