"""Long sequences (issue 12): per-rank peak memory and step time of a whole training step, ds-usp vs ALST.

Run (4 CPU ranks; each system and length is its own fresh 4-rank job, one after the other):

    python benchmarks/long_seq.py --seqs 8192,16384,32768,65536 --longest 131072 --out benchmarks/results/long_seq.json

The model is the issue's: a HuggingFace Llama with vocab 32000, hidden 256, intermediate 896, 4
layers, 8 heads (8 kv heads), fp32, random weights; ZeRO-3 with AdamW; sequence parallel 4 over the
4 ranks; one sequence of S random tokens per step. Systems:

* ``ds-usp off``: ``ds_usp.initialize`` with ``usp.chunked_loss``, ``tiled_mlp``,
  ``activation_checkpointing`` and ``offload_activations`` false (Ulysses 4 x ring 1, zigzag);
* ``ds-usp``: a config with only ``"sequence_parallel": "usp"`` (the degrees are then chosen: Ulysses
  4; the memory features are "auto");
* ``ds-usp 2x2``: the same with ``usp.ulysses_degree`` 2 x ``ring_degree`` 2;
* ``ALST plain``: DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` (core attention
  ``sdpa``) and its ``mpu``, contiguous shards, HF's loss on the whole logits of each shard and the
  differentiable weighted all-gather of the per-rank losses, as DeepSpeed's ALST tutorial wires it;
* ``ALST full``: the same plus DeepSpeed's ``TiledMLP`` (its tutorial's monkey patch:
  ``ceil(seqlen / hidden)`` shards agreed with an all-reduce), ``TiledFusedLogitsLoss`` with 1/8 GiB
  fp32 logits tiles (ArcticTraining's loss function), and HF gradient checkpointing
  (``use_reentrant=False``).

Memory: on every rank, before each step, freed heap memory is returned to the kernel
(``malloc_trim``) and the kernel's high-water mark is reset (``5 > /proc/self/clear_refs``); after
the step (forward, loss, backward, optimizer step) ``VmHWM`` minus the resident size at the reset is
the step's peak growth. The table shows the largest over the ranks, of the last step (the first
allocates the optimizer state). Time: the wall time of a step, the largest over the ranks, median
over the steps after the first; 4 ranks share 2 cores, so it measures the total work of the step,
not a critical path. The loss of the first step (before any update, the same weights) is compared
between the systems: later steps differ by design, because ALST's tiled loss never scales the
``lm_head`` gradient by the incoming gradient.

``--cap-gib`` (default 4.5): a length "fits" when the step's peak growth stays under it on every rank.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import close_distributed, free_port, save_results, table  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS = 32000, 256, 896, 4, 8
SYSTEMS = ("ds-usp off", "ds-usp", "ds-usp 2x2", "ALST plain", "ALST full")
TAG = "[long-seq]"
MIB = 2 ** 20


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (driver and worker share it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="8192,16384,32768,65536", help="comma-separated global sequence lengths")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from: {', '.join(SYSTEMS)}")
    p.add_argument("--longest", type=int, default=0, help="also run 'ds-usp' and 'ALST full' at this length")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (the first is not timed)")
    p.add_argument("--cap-gib", type=float, default=4.5, help="per-rank budget for the peak growth of a step")
    p.add_argument("--out", default="", help="write the rows as JSON here (benchmarks/results/...)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--from-json", default="", help="comma-separated result files of earlier runs: merge them (a later "
                   "file's row replaces an earlier one of the same system and S), print the table and the targets "
                   "(and --plot), run nothing")
    p.add_argument("--plot", default="", help="write a plot of peak memory against S here (needs matplotlib)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "system|seq|steps|result path"
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ worker


def _read_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _reset_peak() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _read_kib("VmRSS:") * 1024


def _model(attn: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=1 << 20,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def _ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 3}, "sequence_parallel_size": 4}


def _tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))


def _usp_step_fn(system: str, seq: int) -> Any:
    import ds_usp

    ds_usp.hf.register_usp_attention()
    cfg = dict(_ds_config(), sequence_parallel="usp")
    if system == "ds-usp off":
        cfg["usp"] = {"ulysses_degree": 4, "ring_degree": 1, "chunked_loss": False, "tiled_mlp": False,
                      "activation_checkpointing": False, "offload_activations": False}
    elif system == "ds-usp 2x2":
        cfg["usp"] = {"ulysses_degree": 2, "ring_degree": 2}
    model = _model("usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    shard = ds_usp.shard_batch({"input_ids": _tokens(seq)}, engine.usp.topo, layout=engine.usp.layout)

    def step() -> float:
        loss = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                      shift_labels=shard["shift_labels"]).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step, lambda: str(engine.usp.memory.plan if engine.usp.memory else "no memory features")


def _alst_tiled_mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's ALST tutorial's TiledMLP patch: ceil(seqlen / hidden) shards, the most over the ranks."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]))
    dist.all_reduce(shards, op=dist.ReduceOp.MAX)

    def mlp_forward(self: Any, t: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(t)) * self.up_proj(t))

    return TiledMLP.apply(mlp_forward, mlp, x, int(shards), [mlp.down_proj.weight, mlp.gate_proj.weight,
                                                             mlp.up_proj.weight])


def _alst_step_fn(system: str, seq: int) -> Any:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, UlyssesSPAttentionHF
    from deepspeed.utils import groups

    full = system == "ALST full"
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model("sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=4, micro_batch_size=1,
                                                          seq_length=seq, seq_length_is_variable=False)
    if full:
        from transformers.models.llama import modeling_llama

        modeling_llama.LlamaMLP.forward = _alst_tiled_mlp
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(), mpu=mpu)
    sp_group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
    ids = _tokens(seq)
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    local = seq // 4
    part = slice(sp_rank * local, (sp_rank + 1) * local)  # ALST's contiguous shards
    batch = {"input_ids": ids[:, part], "position_ids": torch.arange(seq)[part].unsqueeze(0)}
    shift_labels = shift[:, part]
    module = engine.module

    def fused_logits_loss_fn(model_with_head: Any = None, hidden_states: Any = None, shift_labels: Any = None):
        logits = model_with_head.lm_head(hidden_states)  # ArcticTraining's loss function
        good = (shift_labels != -100).sum()
        return model_with_head.loss_function(logits=logits, labels=None, vocab_size=VOCAB,
                                             shift_labels=shift_labels) * good

    def step() -> float:
        if full:
            hidden = module.model(**batch, use_cache=False).last_hidden_state
            shards = math.ceil(local * VOCAB * 4 / (2 ** 30 / 8))  # 1/8 GiB fp32 logits tiles
            loss_sum = TiledFusedLogitsLoss.apply(fused_logits_loss_fn, module, hidden, shift_labels, None, shards,
                                                  [module.lm_head.weight], "sum")
            loss = loss_sum / max(int((shift_labels != -100).sum()), 1)
        else:
            logits = engine(**batch, use_cache=False).logits
            loss = module.loss_function(logits=logits, labels=None, vocab_size=VOCAB, shift_labels=shift_labels)
        # the tutorial's differentiable weighted average of the per-rank losses
        losses = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        good = (shift_labels != -100).sum()
        goods = torch.distributed.nn.functional.all_gather(good, group=sp_group)
        total = sum(l * g for l, g in zip(losses, goods)) / sum(goods)
        engine.backward(total)
        engine.step()
        return float(total)

    dist.barrier()
    return step, lambda: "TiledMLP + TiledFusedLogitsLoss + checkpointing" if full else "Ulysses attention only"


def run_worker(args: argparse.Namespace) -> None:
    """One rank of one (system, seq) run: ``args.steps`` steps, every step's peak growth and time, to JSON."""
    import torch.distributed as dist

    system, seq, steps, path = args.worker.split("|")
    seq, steps = int(seq), int(steps)
    torch.set_num_threads(1)
    step, describe = (_alst_step_fn if system.startswith("ALST") else _usp_step_fn)(system, seq)
    rows = []
    for i in range(steps):
        dist.barrier()
        base = _reset_peak()
        t0 = time.perf_counter()
        try:
            loss = step()
        except RuntimeError as e:  # e.g. out of memory: reported, not hidden
            rows.append({"step": i, "error": str(e).splitlines()[0][:300]})
            break
        seconds = time.perf_counter() - t0
        rows.append({"step": i, "loss": loss, "seconds": seconds, "peak_growth": _read_kib("VmHWM:") * 1024 - base,
                     "peak": _read_kib("VmHWM:") * 1024})
    out = {"system": system, "seq": seq, "rank": dist.get_rank(), "plan": describe(), "steps": rows}
    Path(f"{path}.rank{dist.get_rank()}").write_text(json.dumps(out))
    close_distributed()


# ------------------------------------------------------------------------------------------ driver


def run_one(system: str, seq: int, steps: int, timeout: float, scratch: Path) -> dict:
    """Launch one 4-rank job; returns the merged per-rank results (or the failure)."""
    path = scratch / f"{system.replace(' ', '_')}_{seq}"
    cmd = ["deepspeed", "--num_gpus", "4", "--master_port", str(free_port()), __file__,
           "--worker", f"{system}|{seq}|{steps}|{path}"]
    print(f"{TAG} {system} S={seq}: running ({steps} steps)", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        ok, tail = False, f"timed out after {timeout:.0f} s"
    ranks = []
    for r in range(4):
        f = Path(f"{path}.rank{r}")
        if f.exists():
            ranks.append(json.loads(f.read_text()))
            f.unlink()
    result = {"system": system, "seq": seq, "ok": ok and len(ranks) == 4, "ranks": ranks,
              "wall": time.perf_counter() - t0}
    if not result["ok"]:
        result["tail"] = tail
    return result


def summarize(result: dict, cap: float) -> dict:
    """One table row: peak growth and step time (largest over the ranks), first loss, whether it fits."""
    row = {"system": result["system"], "S": result["seq"]}
    errors = [s["error"] for r in result["ranks"] for s in r["steps"] if "error" in s]
    if not result["ok"] or errors:
        row.update(peak_MiB="-", step_s="-", first_loss="-", fits="no",
                   note=(errors[0] if errors else result.get("tail", "")[-300:]).replace("\n", " "))
        return row
    last = [r["steps"][-1] for r in result["ranks"]]
    peak = max(s["peak_growth"] for s in last)
    times = [max(r["steps"][i]["seconds"] for r in result["ranks"]) for i in range(1, len(last and
                                                                                          result["ranks"][0]["steps"]))]
    row.update(peak_MiB=round(peak / MIB), step_s=round(statistics.median(times), 1) if times else "-",
               first_loss=result["ranks"][0]["steps"][0]["loss"], fits="yes" if peak <= cap * 2 ** 30 else "no",
               note=result["ranks"][0]["plan"])
    return row


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run every system at every length (and the longest), print the table and the comparison."""
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    if args.from_json:
        merged = {(row["system"], row["S"]): row for path in args.from_json.split(",")
                  for row in json.loads(Path(path).read_text())["rows"]}
        report(sorted(merged.values(), key=lambda r: (r["S"], list(SYSTEMS).index(r["system"]))), args)
        return
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"long_seq_{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    plan = [(s, int(n)) for n in args.seqs.split(",") for s in systems]
    if args.longest:
        plan += [(s, args.longest) for s in ("ds-usp", "ALST full") if s in systems]
    rows = []
    for system, seq in plan:
        rows.append(summarize(run_one(system, seq, 2 if seq == args.longest else args.steps, args.timeout, scratch),
                              args.cap_gib))
        print(f"{TAG} {rows[-1]}", flush=True)
    report(rows, args)


def report(rows: list[dict], args: argparse.Namespace) -> None:
    """The table, the targets, and the JSON (``--out``) and plot (``--plot``) when asked for."""
    print(table(rows, ["system", "S", "peak_MiB", "step_s", "first_loss", "fits", "note"]))
    print(compare(rows))
    if args.out:
        save_results(args.out, vars(args), rows)
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    """Peak memory growth of a step against S, one line per system (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in dict.fromkeys(r["system"] for r in rows):
        points = sorted((r["S"], r["peak_MiB"]) for r in rows if r["system"] == system and r["peak_MiB"] != "-")
        if points:
            ax.plot(*zip(*points), marker="o", label=system)
    ax.set(xscale="log", yscale="log", xlabel="sequence length S (tokens, over 4 ranks)",
           ylabel="per-rank peak growth of a step (MiB)", title="Llama 4x256, vocab 32000, fp32, ZeRO-3, SP 4")
    ax.set_xticks(sorted({r["S"] for r in rows}), [f"{r // 1024}K" for r in sorted({r["S"] for r in rows})])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"{TAG} plot written to {path}")


def compare(rows: list[dict]) -> str:
    """The issue's targets, checked on the rows: ds-usp (auto) against ALST full and ALST plain at each S."""
    by = {(r["system"], r["S"]): r for r in rows}
    lines = [f"{TAG} targets: peak <= 0.6 x ALST full, step time <= 1.05 x ALST plain, first loss within 1e-4"]
    for seq in sorted({r["S"] for r in rows}):
        usp, full, plain = by.get(("ds-usp", seq)), by.get(("ALST full", seq)), by.get(("ALST plain", seq))
        if not usp or usp["peak_MiB"] == "-":
            continue
        parts = [f"S={seq}:"]
        if full and full["peak_MiB"] != "-":
            parts.append(f"peak {usp['peak_MiB']} / {full['peak_MiB']} MiB = {usp['peak_MiB'] / full['peak_MiB']:.2f}"
                         f" x ALST full")
        if plain and plain["step_s"] != "-" and usp["step_s"] != "-":
            parts.append(f"time {usp['step_s']} / {plain['step_s']} s = {usp['step_s'] / plain['step_s']:.2f} x ALST plain")
        ref = plain or full
        if ref and ref["first_loss"] != "-":
            parts.append(f"first loss rel. diff {abs(usp['first_loss'] - ref['first_loss']) / ref['first_loss']:.1e}")
        lines.append(" ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
