"""Dynamic SP on long-tailed data (issue 38): tokens/s, peak memory and losses of static and dynamic SP, 4 CPU ranks.

Run:

    python benchmarks/dynamic_sp.py --json dynamic_sp.json

The same documents and global batch for every system: each optimizer step is ``--step-tokens`` tokens of documents
drawn from a lognormal length distribution (median ~512 tokens, p99 ~8K, cut at ``--max-len`` 16384; fixed seed;
synthetic: no real dataset is downloaded on this machine, see docs/benchmarks.md). A Llama (hidden 256, intermediate
896, 4 layers, 8 heads, vocab 8192, random weights), ZeRO-2, fp32, ``tokens_per_rank`` ``--cap`` (4096: the longest
document fills the 4 ranks). Systems, each a fresh 4-rank job through ``ds_usp.dynamic_sp_step``:

* ``static 2x2`` / ``static 1x4``: every row packed to 4 x cap tokens and run on all 4 ranks (``degrees=[4]``);
* ``dynamic``: each row on the smallest degree its longest document needs (2x2 base: degree 2 is Ulysses 2, degree 1
  one rank), short documents filling the rows' free room.

Reported: per step, the wall time (slowest rank; 4 ranks time-share 2 cores, so it is the group's total work), the
tokens per second over the measured steps (the first step is a warm-up), the growth of the resident set over a step
(``VmHWM`` after ``5 > /proc/self/clear_refs``, largest rank) and each step's loss, which must agree between the
systems (1e-5 relative: checked).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_job_flags, free_port, run_as_job, write_result  # noqa: E402
from long_seq import read_peak, reset_peak  # noqa: E402

TAG = "[dynamic_sp]"
SYSTEMS = {"static 2x2": (2, 2, "static"), "static 1x4": (1, 4, "static"), "dynamic 2x2": (2, 2, "dynamic")}


def lengths_of_step(step: int, tokens: int, max_len: int, seed: int) -> list[int]:
    """Document lengths of one step: lognormal (median e^6.24 ~ 512, sigma 1.2: p99 ~ 8.4K), at most ``max_len``,
    the last one cut so the step holds ``tokens`` tokens."""
    rng, out, total = random.Random(seed * 1000 + step), [], 0
    while total < tokens:
        n = min(max(2, int(rng.lognormvariate(6.24, 1.2))), max_len, tokens - total)
        out.append(n)
        total += n
    return out


def _documents(step: int, args: argparse.Namespace) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    return [{"input_ids": torch.randint(3, 8192, (n,), generator=g)}
            for n in lengths_of_step(step, args.step_tokens, args.max_len, args.seed)]


def run(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ds_usp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    u, r, mode = SYSTEMS[args.role]
    ds_usp.hf.register_usp_attention()
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1 << 15)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="usp", dtype=torch.float32)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "sequence_parallel": "usp", "sequence_parallel_size": 4,
              "usp": {"ulysses_degree": u, "ring_degree": r, "dynamic_sp": mode == "dynamic"}}
    engine = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    rows = []
    for step in range(args.steps):
        docs = _documents(step, args)
        base = reset_peak()
        start = time.perf_counter()
        loss = ds_usp.dynamic_sp_step(engine, docs, args.cap, degrees=[4] if mode == "static" else None)
        seconds = time.perf_counter() - start
        plan = ds_usp.plan_step([len(d["input_ids"]) for d in docs], 4, args.cap,
                                [4] if mode == "static" else None)
        rows.append({"loss": loss, "seconds": seconds, "peak_mib": (read_peak() - base) / 2**20,
                     "documents": len(docs), "micro_batches": [m.degree for m in plan]})
        if engine.usp.topo.rank == 0:
            print(f"{TAG} {args.role}: step {step + 1} loss {loss:.6f} {seconds:.1f} s, {len(docs)} documents, "
                  f"micro batches at degrees {rows[-1]['micro_batches']}", flush=True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    for i, row in enumerate(rows):  # the slowest rank and the largest peak
        row["seconds"] = max(r[i]["seconds"] for r in everyone)
        row["peak_mib"] = max(r[i]["peak_mib"] for r in everyone)
    dist.barrier()
    return {"steps": rows} if dist.get_rank() == 0 else {}


def _job(system: str, args: argparse.Namespace) -> dict:
    out = Path(f"/tmp/dynamic_sp_{os.getpid()}_{system.replace(' ', '_')}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           __file__, "--role", system, "--out", str(out), "--steps", str(args.steps), "--step-tokens",
           str(args.step_tokens), "--max-len", str(args.max_len), "--cap", str(args.cap), "--seed", str(args.seed)]
    print(f"{TAG} {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is a warm-up)")
    p.add_argument("--step-tokens", type=int, default=32768, help="tokens of documents per optimizer step")
    p.add_argument("--max-len", type=int, default=16384, help="the longest document")
    p.add_argument("--cap", type=int, default=4096, help="tokens_per_rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run")
    p.add_argument("--json", default=None, help="result file (a bare name goes into benchmarks/results/)")
    add_job_flags(p)
    args = p.parse_args()
    if run_as_job(args, run):
        return
    results = {name: _job(name, args) for name in args.systems.split(",")}
    first = next(iter(results.values()))["steps"]
    for name, res in results.items():
        measured = res["steps"][1:] or res["steps"]
        res["tokens_per_s"] = args.step_tokens * len(measured) / sum(s["seconds"] for s in measured)
        res["peak_mib"] = max(s["peak_mib"] for s in res["steps"])
        drift = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(res["steps"], first))
        res["loss_rel_diff_vs_first_system"] = drift
        print(f"{TAG} {name:>12}: {res['tokens_per_s']:8.1f} tokens/s, peak {res['peak_mib']:7.1f} MiB, losses "
              f"{[round(s['loss'], 6) for s in res['steps']]} (max rel diff {drift:.1e})", flush=True)
        if drift > 1e-5:
            raise SystemExit(f"{TAG} {name}'s losses differ from the first system's by {drift:.1e}")
    base = results.get("static 2x2")
    if base and "dynamic 2x2" in results:
        print(f"{TAG} dynamic / static 2x2 tokens/s: {results['dynamic 2x2']['tokens_per_s'] / base['tokens_per_s']:.3f}"
              f"; peak {results['dynamic 2x2']['peak_mib'] / base['peak_mib']:.3f}", flush=True)
    if args.json:
        path = write_result(args.json, {"benchmark": "dynamic_sp", "args": {k: v for k, v in vars(args).items()
                                                                           if k not in ("role", "out")},
                                        "systems": results})
        print(f"{TAG} wrote {path}")


if __name__ == "__main__":
    main()
