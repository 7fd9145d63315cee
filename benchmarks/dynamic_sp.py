"""Dynamic SP on long-tailed data (issue 38): tokens/s, peak memory and losses of static and dynamic SP, 4 CPU ranks.

Run:

    python benchmarks/dynamic_sp.py --lengths longalpaca-chinese --json dynamic_sp_longalpaca.json
    python benchmarks/dynamic_sp.py --lengths lognormal --json dynamic_sp.json

The same documents and global batch for every system: each optimizer step is ``--step-tokens`` tokens of documents
drawn (fixed seed) from a real long-context SFT set's published length histogram (``longalpaca-chinese``:
``benchmarks/data/longalpaca_chinese_lengths.json``, its 32K context scaled onto ``--max-len`` 16384) or from a
synthetic long tail (``lognormal``: median ~512 tokens, p99 ~8K, cut at ``--max-len``). A Llama (hidden 256,
intermediate 896, 4 layers, 8 heads, vocab 8192, random weights), ZeRO-2, fp32, ``tokens_per_rank`` ``--cap``
(4096: the longest document fills the 4 ranks). Systems, each a fresh 4-rank job:

* ``static 2x2`` / ``static 1x4``: every row packed to 4 x cap tokens and run on all 4 ranks (``degrees=[4]``), through
  ``ds_usp.dynamic_sp_step``;
* ``dynamic 2x2``: each row on the smallest degree its longest document needs (2x2 base: degree 2 is Ulysses 2,
  degree 1 one rank), short documents filling the rows' free room;
* ``ALST full``: DeepSpeed's Ulysses (4) with TiledMLP, the tiled loss and checkpointing (:func:`alst_step`), one
  document per micro batch;
* ``degree 1 only``: this host's ceiling for any sequence parallelism on these kernels: the same engine and step
  with every row on one rank (``degrees=[1]``, rows of up to ``--max-len`` tokens, so the longest document fits one
  rank), no sequence-parallel communication at all; on 4 ranks sharing 2 cores the wall time is the total work, which
  no SP scheme does less of.

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
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_job_flags, base_parser, run_as_job, start_ranks, write_result  # noqa: E402
from long_seq import alst_full, alst_tiled_loss, read_peak, reset_peak  # noqa: E402

TAG = "[dynamic_sp]"
VOCAB = 8192
SYSTEMS = {"static 2x2": (2, 2, "static"), "static 1x4": (1, 4, "static"), "dynamic 2x2": (2, 2, "dynamic"),
           "ALST full": (4, 1, "alst"), "degree 1 only": (2, 2, "ceiling")}


HISTOGRAM = Path(__file__).resolve().parent / "data" / "longalpaca_chinese_lengths.json"


def lengths_of_step(step: int, args: argparse.Namespace) -> list[int]:
    """Document lengths of one step, ``args.step_tokens`` in all (the last one cut to fit), at most ``args.max_len``.

    ``lognormal``: median e^6.24 ~ 512, sigma 1.2 (p99 ~ 8.4K). ``longalpaca-chinese``: a bucket drawn by the
    dataset card's counts (:data:`HISTOGRAM`), a length uniform inside it (the card gives no finer shape; its last
    bucket, "> 32768", at 32768), scaled by ``max_len / 32768`` (the set's 32K context onto this machine's
    longest document)."""
    rng, out, total = random.Random(args.seed * 1000 + step), [], 0
    if args.lengths == "longalpaca-chinese":
        hist = json.loads(HISTOGRAM.read_text())
        edges, counts = hist["bucket_edges"], hist["counts"]
    while total < args.step_tokens:
        if args.lengths == "lognormal":
            n = int(rng.lognormvariate(6.24, 1.2))
        else:
            k = rng.choices(range(len(counts)), weights=counts)[0]
            lo, hi = edges[k], edges[k + 1] or edges[k]
            n = int(rng.uniform(lo, hi) * args.max_len / 32768)
        n = min(max(2, n), args.max_len, args.step_tokens - total)
        out.append(n)
        total += n
    return out


def _documents(step: int, args: argparse.Namespace) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g)}
            for n in lengths_of_step(step, args)]


def run(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ds_usp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    u, r, mode = SYSTEMS[args.role]
    ds_usp.hf.register_usp_attention()
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1 << 15)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa" if mode == "alst" else "usp",
                                             dtype=torch.float32)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "sequence_parallel_size": 4, "steps_per_print": 10**9}
    if mode == "alst":
        step_of = alst_step(model, config, args)
    else:
        config.update(sequence_parallel="usp", usp={"ulysses_degree": u, "ring_degree": r,
                                                    "dynamic_sp": mode != "static"})
        engine = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        cap, degrees = {"static": (args.cap, [4]), "dynamic": (args.cap, None), "ceiling": (args.max_len, [1])}[mode]

        def step_of(docs: list[dict]) -> float:
            return ds_usp.dynamic_sp_step(engine, docs, cap, degrees=degrees)
    rows = []
    for step in range(args.steps):
        docs = _documents(step, args)
        base = reset_peak()  # before the barrier: it can take a rank tenths of a second
        dist.barrier()
        start = time.perf_counter()
        loss = step_of(docs)
        seconds = time.perf_counter() - start
        lengths = [len(d["input_ids"]) for d in docs]
        plan = [4] * len(docs) if mode == "alst" else [m.degree for m in ds_usp.plan_step(lengths, 4, cap, degrees)]
        rows.append({"loss": loss, "seconds": seconds, "peak_mib": (read_peak() - base) / 2**20,
                     "documents": len(docs), "micro_batches": plan})
        if dist.get_rank() == 0:
            print(f"{TAG} {args.role}: step {step + 1} loss {loss:.6f} {seconds:.1f} s, {len(docs)} documents, "
                  f"micro batches at degrees {rows[-1]['micro_batches']}", flush=True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    for i, row in enumerate(rows):  # the slowest rank and the largest peak
        row["seconds"] = max(r[i]["seconds"] for r in everyone)
        row["peak_mib"] = max(r[i]["peak_mib"] for r in everyone)
    dist.barrier()
    return {"steps": rows} if dist.get_rank() == 0 else {}


def alst_step(model: Any, config: dict, args: argparse.Namespace) -> Callable[[list[dict]], float]:
    """DeepSpeed's ALST full recipe (Ulysses 4 through ``UlyssesSPAttentionHF`` with core attention sdpa,
    ``TiledMLP``, ``TiledFusedLogitsLoss``, HF checkpointing; :func:`long_seq.alst_full`) on the same documents:
    one document per micro batch (its packed rows need flash-attn's varlen kernel, which CPUs lack; sdpa over a
    packed row would attend across documents), padded to a multiple of 4 at its end (pads hold no target), cut into
    ALST's contiguous shards; each micro batch's summed token losses over the SP group divided by the step's targets,
    DeepSpeed's accumulation boundary on the last document, one optimizer step."""
    import deepspeed
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import groups

    from ds_usp.integration.data.dynamic import step_targets
    from ds_usp.integration.step.dynamic import engine_backward, run_micro_batches

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=4,
                                                          micro_batch_size=1, seq_length_is_variable=True)
    alst_full(model)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)[0]
    group, rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
    module = engine.module

    def step(docs: list[dict]) -> float:
        targets = max(step_targets(docs), 1)

        def loss_of(doc: dict) -> torch.Tensor:
            ids = doc["input_ids"].reshape(1, -1)
            n = ids.shape[1]
            pad = -n % 4
            ids = torch.cat([ids, torch.zeros(1, pad, dtype=ids.dtype)], dim=1)
            shift = torch.cat([ids[:, 1:n], torch.full((1, 1 + pad), -100)], dim=1)
            local = ids.shape[1] // 4
            part = slice(rank * local, (rank + 1) * local)
            hidden = module.model(input_ids=ids[:, part], position_ids=torch.arange(ids.shape[1])[None, part],
                                  use_cache=False).last_hidden_state
            mine = alst_tiled_loss(module, hidden, shift[:, part].contiguous(), VOCAB)
            return sum(dist_fn.all_gather(mine, group=group)) / targets

        losses = run_micro_batches(docs, loss_of, engine_backward(engine))  # one document per micro batch
        engine.step()
        return sum(float(loss) for loss in losses)

    return step


def _job(system: str, args: argparse.Namespace) -> dict:
    out = Path(f"/tmp/dynamic_sp_{os.getpid()}_{system.replace(' ', '_')}.json")
    flags = ["--role", system, "--out", out, "--steps", args.steps, "--step-tokens", args.step_tokens, "--max-len",
             args.max_len, "--cap", args.cap, "--seed", args.seed, "--lengths", args.lengths]
    start_ranks(__file__, flags, 4, check=True)
    return json.loads(out.read_text())


def main() -> None:
    p = base_parser(__doc__, seed=0)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is a warm-up)")
    p.add_argument("--step-tokens", type=int, default=32768, help="tokens of documents per optimizer step")
    p.add_argument("--max-len", type=int, default=16384, help="the longest document")
    p.add_argument("--cap", type=int, default=4096, help="tokens_per_rank")
    p.add_argument("--lengths", choices=["lognormal", "longalpaca-chinese"], default="lognormal",
                   help="the document length distribution (see lengths_of_step)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run")
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
        drifts = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(res["steps"], first)]
        res["loss_rel_diff_vs_first_system"] = max(drifts)
        print(f"{TAG} {name:>12}: {res['tokens_per_s']:8.1f} tokens/s, peak {res['peak_mib']:7.1f} MiB, losses "
              f"{[round(s['loss'], 6) for s in res['steps']]} (max rel diff {max(drifts):.1e})", flush=True)
        if max(drifts) > 1e-5:
            raise SystemExit(f"{TAG} {name}'s losses differ from the first system's by {max(drifts):.1e}")
    dynamic = results.get("dynamic 2x2")
    for peer in ("static 2x2", "static 1x4", "ALST full"):
        if dynamic and peer in results:
            print(f"{TAG} dynamic / {peer}: tokens/s {dynamic['tokens_per_s'] / results[peer]['tokens_per_s']:.3f}, "
                  f"peak {dynamic['peak_mib'] / results[peer]['peak_mib']:.3f}", flush=True)
    ceiling = results.get("degree 1 only")
    if ceiling:
        for name, res in results.items():
            res["share_of_ceiling"] = res["tokens_per_s"] / ceiling["tokens_per_s"]
        print(f"{TAG} share of this host's ceiling (every row on one rank): " + ", ".join(
            f"{name} {res['share_of_ceiling']:.3f}" for name, res in results.items()), flush=True)
    if args.json:
        path = write_result(args.json, {"benchmark": "dynamic_sp", "args": {k: v for k, v in vars(args).items()
                                                                           if k not in ("role", "out")},
                                        "systems": results})
        print(f"{TAG} wrote {path}")


if __name__ == "__main__":
    main()
