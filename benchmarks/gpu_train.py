"""Training on one GPU (issue 27): ds-usp's whole step against DeepSpeed's ALST recipe, bf16, ZeRO-3, S doubling.

Run (on a machine with one CUDA GPU; each system is one process, S doubles from ``--start`` until it runs out
of memory, reaches ``--max-seq`` or the next length would not finish inside ``--budget`` seconds):

    python benchmarks/gpu_train.py --shape 1b --json gpu_train_h100.json --plot docs/img/gpu_train.png

The model: a Llama-3-shaped decoder with random weights (``--shape 1b``: hidden 2048, 16 layers, 32 heads,
8 kv heads, intermediate 8192, vocab 128256; ``8b``: hidden 4096, 32 layers, intermediate 14336), bf16 with
DeepSpeed's fp32 master weights, ZeRO-3, AdamW, one sequence of S random tokens per step, world size 1
(``sequence_parallel_size: 1``: every piece of the step but the collectives). Systems (:data:`SYSTEMS`):

* ``ds-usp``: ``"sequence_parallel": "usp"`` and nothing else (memory features "auto": chunked loss, tiled
  MLP, checkpointing, offload of the checkpointed inputs as the step plan decides);
* ``ds-usp off``: the same with every memory feature false (only the attention path);
* ``ds-usp offload`` / ``ds-usp no offload``: "auto" with ``offload_activations`` true / false (what offloading
  the checkpointed inputs saves and costs);
* ``ALST full``: DeepSpeed's own pieces as its ALST tutorial wires them at sequence parallel 1: HF Llama
  with sdpa attention, ``TiledMLP`` (``ceil(S / hidden)`` shards), ``TiledFusedLogitsLoss`` (1/8 GiB fp32
  logits tiles) and HF gradient checkpointing (ALST's checkpoint offload lives in ArcticTraining, not in
  DeepSpeed, and is not part of this recipe).

Per (system, S): the median step time over the steps after the first at that S (one step only from
``--one-step-from`` on: then the time is that step's, marked), tokens/s, model TFLOP/s and MFU, and
``torch.cuda.max_memory_allocated`` over the step (absolute: weights, optimizer state and activations).
FLOPs of a step (MFU convention, recomputation not counted): ``6 N S`` with ``N`` the parameters that multiply
(all but the input embedding) plus causal attention ``6 L H d S^2`` (QK^T and PV, forward and backward,
half the square). MFU divides by ``--peak-tflops`` (default: the bf16 dense peak of the device's name).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from _common import save_results, table, world_of_one
from long_seq import alst_full, alst_tiled_loss

TAG = "[gpu_train]"
SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1000),  # a CPU smoke run
}
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # bf16 dense, the vendors' data sheets
Step = Callable[[], float]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="1b")
    p.add_argument("--systems", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=["ds-usp", "ds-usp off", "ALST full"])
    p.add_argument("--start", type=int, default=16384, help="first S")
    p.add_argument("--max-seq", type=int, default=1 << 20, help="last S tried")
    p.add_argument("--steps", type=int, default=3, help="steps per S (the first untimed)")
    p.add_argument("--one-step-from", type=int, default=262144, help="from this S on, one (timed) step per S")
    p.add_argument("--budget", type=float, default=240.0, help="seconds a system may spend on its steps")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 dense peak (MFU)")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-3 optimizer state in host memory")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps at the first S, one more step under torch.profiler: its kernels by "
                        "device time go into the row ('profile') and the log")
    p.add_argument("--json", default=None, help="result file (bare name: benchmarks/results/)")
    p.add_argument("--plot", default="", help="write a plot of tokens/s and peak memory against S here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "system|rows file"
    return p.parse_args(argv)


def flops_per_step(shape: dict, params: int, seq: int) -> float:
    """Model FLOPs of one training step on one sequence (see the module docstring)."""
    dense = 6.0 * (params - shape["vocab"] * shape["hidden"]) * seq
    attention = 6.0 * shape["layers"] * shape["hidden"] * seq * seq  # H * d = hidden for Llama-3 shapes
    return dense + attention


def peak_tflops(args: argparse.Namespace) -> float:
    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name() if CUDA else "cpu"
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), float("nan"))


# ---------------------------------------------------------------------------------------- systems


def build_model(shape: dict, attn: str) -> Any:
    """Random Llama-3-shaped weights, the same for every system (seeded, made on the GPU in bf16)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=1 << 21, rope_theta=500000.0,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16)


def ds_config(args: argparse.Namespace) -> dict:
    zero: dict = {"stage": 3}
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0,
                                                      "torch_adam": not args.offload_optimizer}}}


def tokens(shape: dict, seq: int) -> torch.Tensor:
    return torch.randint(0, shape["vocab"], (1, seq), generator=torch.Generator().manual_seed(seq))


def usp_system(name: str, shape: dict, args: argparse.Namespace) -> tuple[Any, Callable[[int], Step]]:
    import ds_usp

    ds_usp.hf.register_usp_attention()
    usp = USP_SETTINGS[name]
    model = build_model(shape, "usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(),
                                   config=dict(ds_config(args), sequence_parallel="usp", usp=usp))

    def at(seq: int) -> Step:
        shard = ds_usp.shard_batch({"input_ids": tokens(shape, seq)}, engine.usp.topo, layout=engine.usp.layout)
        batch = {k: shard[k].to(engine.device) for k in ("input_ids", "position_ids", "shift_labels")}

        def step() -> float:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            return float(loss)
        return step

    return engine, at


def alst_system(name: str, shape: dict, args: argparse.Namespace) -> tuple[Any, Callable[[int], Step]]:
    """DeepSpeed's TiledMLP, TiledFusedLogitsLoss and HF checkpointing, as ALST's tutorial wires them."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo")
    model = build_model(shape, "sdpa")
    alst_full(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    module = engine.module

    def at(seq: int) -> Step:
        ids = tokens(shape, seq)
        batch = {"input_ids": ids.to(engine.device), "position_ids": torch.arange(seq, device=engine.device)[None]}
        shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1).to(engine.device)

        def step() -> float:
            hidden = module.model(**batch, use_cache=False).last_hidden_state
            loss = alst_tiled_loss(module, hidden, shift, shape["vocab"]) / (seq - 1)
            engine.backward(loss)
            engine.step()
            return float(loss)
        return step

    return engine, at


# the "usp" block of each ds-usp system: "auto" everywhere; every memory feature off; "auto" with the checkpointed
# inputs offloaded to host memory, and the same kept on the GPU (item 4 of issue 40: what offload saves and costs)
USP_SETTINGS = {"ds-usp": {},
                "ds-usp off": {"chunked_loss": False, "tiled_mlp": False, "activation_checkpointing": False,
                               "offload_activations": False},
                "ds-usp offload": {"offload_activations": True},
                "ds-usp no offload": {"offload_activations": False}}
SYSTEMS = {**{name: usp_system for name in USP_SETTINGS}, "ALST full": alst_system}


# ---------------------------------------------------------------------------------------- worker


def run_worker(args: argparse.Namespace) -> None:
    """One system: S doubling in one process; a JSON line per S (a crash or timeout keeps the lines so far)."""
    name, path = args.worker.split("|")
    shape = SHAPES[args.shape]
    world_of_one()
    if CUDA:
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    engine, at = SYSTEMS[name](name, shape, args)
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    out = open(path, "a")
    print(f"{TAG} {name}: built in {time.perf_counter() - t0:.0f} s, {params / 1e9:.3f} B parameters", flush=True)
    t0 = time.perf_counter()  # --budget counts the steps
    seq, last = args.start, None
    while seq <= args.max_seq:
        steps = 1 if seq >= args.one_step_from else args.steps
        if last is not None:  # attention grows as S^2: the next length costs up to 4x
            expected = 4 * last * steps
            if time.perf_counter() - t0 + expected > args.budget:
                out.write(json.dumps({"system": name, "S": seq, "note": f"not run: ~{expected:.0f} s would pass "
                                      f"--budget {args.budget:.0f} s"}) + "\n")
                break
        step = at(seq)
        times, losses, peaks, reserved, error = [], [], [], [], None
        retries = _alloc_retries()
        for _ in range(steps):
            if CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            w0 = time.perf_counter()
            try:
                losses.append(step())
            except torch.OutOfMemoryError as e:
                error = "out of memory: " + str(e).split("\n")[0][:160]
                break
            if CUDA:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - w0)
            peaks.append(torch.cuda.max_memory_allocated() if CUDA else 0)
            reserved.append(torch.cuda.max_memory_reserved() if CUDA else 0)
        if error:
            out.write(json.dumps({"system": name, "S": seq, "note": error}) + "\n")
            break
        timed = times[1:] or times
        last = statistics.median(timed)
        row = {"system": name, "S": seq, "step_s": last, "steps_timed": len(timed), "first_step_s": times[0],
               "peak_GiB": max(peaks) / 2 ** 30, "loss": losses[0], "params": params,
               # the caching allocator: what it held, and how often it had to free its cache and retry (a step
               # slower after the first with the same work points there)
               "reserved_GiB": max(reserved) / 2 ** 30, "alloc_retries": _alloc_retries() - retries,
               "step_times_s": times, "choices": _choices(engine),
               "tflops": flops_per_step(shape, params, seq) / last / 1e12}
        if args.profile and seq == args.start:
            row["profile"] = profile_step(step)
            print(f"{TAG} {name} S={seq}, one step under torch.profiler:\n{row['profile']}", flush=True)
        row["mfu"] = row["tflops"] / peak_tflops(args)
        row["tokens_per_s"] = seq / last
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"{TAG} {name} S={seq}: {last:.2f} s/step, {row['tokens_per_s']:.0f} tokens/s, "
              f"{row['tflops']:.0f} TFLOP/s (MFU {row['mfu']:.1%}), peak {row['peak_GiB']:.1f} GiB", flush=True)
        seq *= 2
    out.close()


def profile_step(step: Step) -> str:
    """One step under torch.profiler: the table of operators by device time (CPU time without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        step()
        if CUDA:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)


def _alloc_retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if CUDA else 0


def _choices(engine: Any) -> Optional[str]:
    """What ds-usp's "auto" memory features chose for the last step (None for a system without them)."""
    usp = getattr(engine, "usp", None)
    memory = getattr(usp, "memory", None)
    choices = getattr(memory, "choices", None)
    return None if choices is None else str(choices)


# ---------------------------------------------------------------------------------------- driver


def compare(rows: list[dict]) -> str:
    """ds-usp against ALST full at equal S (tokens/s and peak) and each system's longest S."""
    by = {(r["system"], r["S"]): r for r in rows if r.get("step_s")}
    lines = []
    for seq in sorted({s for _, s in by}):
        usp, alst = by.get(("ds-usp", seq)), by.get(("ALST full", seq))
        if usp and alst:
            lines.append(f"S={seq}: ds-usp {usp['tokens_per_s'] / alst['tokens_per_s']:.2f} x ALST full's tokens/s "
                         f"(target >= 1.0), peak {usp['peak_GiB']:.1f} / {alst['peak_GiB']:.1f} GiB, first losses "
                         f"{usp['loss']:.4f} / {alst['loss']:.4f}")
    for name in dict.fromkeys(r["system"] for r in rows):
        ran = [r for r in rows if r["system"] == name and r.get("step_s")]
        stop = next((r["note"] for r in rows if r["system"] == name and r.get("note")), "--max-seq reached")
        if ran:
            top = ran[-1]
            lines.append(f"{name}: longest S {top['S']} ({top['tokens_per_s']:.0f} tokens/s, MFU {top['mfu']:.1%}, "
                         f"peak {top['peak_GiB']:.1f} GiB); next: {stop}")
    return "\n".join(f"{TAG} {line}" for line in lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["system"] for r in rows):
        ran = [r for r in rows if r["system"] == name and r.get("step_s")]
        a.plot([r["S"] for r in ran], [r["tokens_per_s"] for r in ran], marker="o", label=name)
        b.plot([r["S"] for r in ran], [r["peak_GiB"] for r in ran], marker="o", label=name)
    for ax, label in ((a, "tokens/s"), (b, "peak GiB (max_memory_allocated)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"one {torch.cuda.get_device_name() if CUDA else 'CPU'}, bf16, ZeRO-3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"{TAG} plot written to {path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    if not CUDA and args.shape != "tiny":
        raise SystemExit(f"{TAG} needs a CUDA GPU (--shape tiny runs on CPU, to check the script)")
    rows = []
    for name in args.systems:
        if name not in SYSTEMS:
            raise SystemExit(f"{TAG} unknown system {name!r}: {', '.join(SYSTEMS)}")
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_train_{os.getpid()}_{name.replace(' ', '_')}.jsonl"
        path.unlink(missing_ok=True)
        print(f"{TAG} {name}: running", flush=True)
        try:
            proc = subprocess.run([sys.executable, __file__, *argv, "--worker", f"{name}|{path}"],
                                  timeout=args.budget + 300, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
            failed = proc.returncode != 0 and [ln for ln in proc.stderr.splitlines() if "Error" in ln][-1:]
        except subprocess.TimeoutExpired:
            failed = [f"timed out after {args.budget + 300:.0f} s"]
        got = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if failed and not any(r.get("note") for r in got):
            got.append({"system": name, "S": None, "note": failed[0][:300]})
        rows += got
    print(table(rows, ["system", "S", "step_s", "tokens_per_s", "tflops", "mfu", "peak_GiB", "loss", "note"],
                {"step_s": ".2f", "tokens_per_s": ".0f", "tflops": ".0f", "mfu": ".3f", "peak_GiB": ".1f",
                 "loss": ".4f"}))
    print(compare(rows))
    print(f"{TAG} results written to {save_results(args.json, vars(args), rows)}")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
