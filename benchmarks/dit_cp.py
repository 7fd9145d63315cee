"""Diffusion transformers under sequence parallelism: ds-usp against diffusers' own context parallelism (issue 50).

Run:

    python benchmarks/dit_cp.py --json dit_cp.json

The same small Wan (``WanTransformer3DModel``: 8 heads of 32, 2 blocks, a 16 x 32 x 32 latent: 4096 video tokens)
and Flux (``FluxTransformer2DModel``: 8 heads of 32, 1 dual- and 2 single-stream blocks, 4096 image + 64 text
tokens), random weights, fp32, on 4 CPU ranks at Ulysses 4 (4x1), ring 4 (1x4) and 2x2, each a fresh job per system:

* ``ds-usp``: the model through ``ds_usp.initialize`` (ZeRO-2, SGD at lr 0 so every step sees the same weights),
  called with the whole inputs on every rank (the single-process loop);
* ``diffusers``: ``model.enable_parallelism(config=ContextParallelConfig(ring_degree=R, ulysses_degree=U))`` with the
  model's own ``_cp_plan``, the gradients then summed over the ranks (its gather's backward leaves each rank a part,
  as DDP or FSDP would sum them). diffusers' ``_resolve_parallel_config`` computes
  ``rank % torch.accelerator.device_count()``, which divides by zero on a CPU machine (0 accelerators): this
  benchmark, and only it, makes ``torch.accelerator.device_count`` answer 1 while ``enable_parallelism`` runs.

Per (family, split, system): the step's loss (``F.mse_loss`` of the whole output against a fixed target), the
gradient error against one process (the same model, inputs and target in a single process, run first): the largest
over the parameters of ``|g - g_ref| / max(|g_ref|, 1e-4 |G_ref|)`` and the whole model's ``|G - G_ref| / |G_ref|``;
the per-rank peak memory of a forward and backward (the growth of the resident set: ``malloc_trim`` and
``5 > /proc/self/clear_refs`` first, ``VmHWM`` minus the resident size then; the largest rank); and the step time
(forward, backward and, for diffusers, the gradient sum; the slowest rank, median of ``--iters`` after one warm-up).
4 ranks share this machine's cores: the times measure the group's total work, not a GPU cluster's; so one more
forward and backward is counted per rank by ``ds_usp/instruments/work_meter.py`` (GFLOP by torch's formulas, aten ops
a GPU would launch as kernels, host syncs: the same count whatever the machine's load), the largest rank reported.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_job_flags, base_parser, job_port, run_as_job, start_ranks, write_result  # noqa: E402
from long_seq import read_peak, reset_peak  # noqa: E402

TAG = "[dit_cp]"
SPLITS = {"4x1": (4, 1), "1x4": (1, 4), "2x2": (2, 2)}
_PORTS = itertools.count()


def build(family: str, args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    """The model (seed 0) and its whole inputs (seed 1)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if family == "wan":
        from diffusers import WanTransformer3DModel

        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=32,
                                      in_channels=4, out_channels=4, text_dim=64, freq_dim=64,
                                      ffn_dim=4 * 32 * args.heads, num_layers=2, rope_max_seq_len=256)
        f, h, w = args.latent
        inputs = dict(hidden_states=torch.randn(1, 4, f, h, w, generator=g), timestep=torch.tensor([500.0]),
                      encoder_hidden_states=torch.randn(1, 64, 64, generator=g), return_dict=False)
        return model, inputs
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                   attention_head_dim=32, num_attention_heads=args.heads, joint_attention_dim=64,
                                   pooled_projection_dim=64, guidance_embeds=False, axes_dims_rope=(8, 12, 12))
    side = args.image
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side * 1.0), torch.arange(side * 1.0),
                                     indexing="ij"), -1).reshape(-1, 3)
    inputs = dict(hidden_states=torch.randn(1, side * side, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, 64, 64, generator=g),
                  pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([0.5]), img_ids=ids,
                  txt_ids=torch.zeros(64, 3), return_dict=False)
    return model, inputs


def _target(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(2))


def reference(args: argparse.Namespace) -> dict:
    """One process: the loss and every parameter's gradient, saved for the jobs to compare against."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model, inputs = build(args.family, args)
    out = model(**inputs)[0]
    loss = F.mse_loss(out, _target(out))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"loss": float(loss.detach()), "grads": grads}, args.out)
    return {}


def _errors(grads: dict, ref: dict) -> dict:
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values()))
    worst, diff = 0.0, 0.0
    for name, want in ref.items():
        got = grads.get(name, torch.zeros_like(want))
        d = (got.double() - want.double()).norm()
        diff += float(d) ** 2
        worst = max(worst, float(d / max(float(want.norm()), 1e-4 * float(total))))
    return {"grad_max_rel": worst, "grad_rel": diff ** 0.5 / float(total)}


def run(args: argparse.Namespace) -> dict:
    """One rank of one (family, split, system) job."""
    import torch.distributed as dist

    import ds_usp

    if args.role == "reference":
        return reference(args)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    u, r = SPLITS[args.split]
    model, inputs = build(args.family, args)
    ref = torch.load(args.reference)
    if args.role == "ds-usp":
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
                  "sequence_parallel": "usp", "sequence_parallel_size": 4,
                  "usp": {"ulysses_degree": u, "ring_degree": r, "native_op": False}}
        engine = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

        def step() -> torch.Tensor:
            out = engine(**inputs)[0]
            loss = F.mse_loss(out, _target(out))
            engine.backward(loss)
            return loss

        def grads() -> dict:
            import deepspeed

            return {n: deepspeed.utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}

        def finish() -> None:
            engine.step()
    else:
        from diffusers import ContextParallelConfig

        # diffusers' default backend ("native", torch's SDPA) as a user gets it. Its ring needs the LSE, which
        # "native" refuses to return ("Native attention does not support return_lse=True") and "_native_flash"
        # computes with aten's flash op, which has no CPU kernel: on a CPU machine diffusers' ring rows fail
        count = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: 1  # diffusers divides the rank by it: 0 on a CPU machine
        try:
            model.enable_parallelism(config=ContextParallelConfig(ring_degree=r, ulysses_degree=u))
        finally:
            torch.accelerator.device_count = count

        def step() -> torch.Tensor:
            out = model(**inputs)[0]
            loss = F.mse_loss(out, _target(out))
            loss.backward()
            for p in model.parameters():  # each rank holds a part of the gradient: summed, as DDP / FSDP would
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            return loss

        def grads() -> dict:
            return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

        def finish() -> None:
            model.zero_grad(set_to_none=True)
    rows, features = [], None
    for i in range(1 + args.iters):
        dist.barrier()
        base = reset_peak()
        start = time.perf_counter()
        loss = step()
        seconds = time.perf_counter() - start
        peak = (read_peak() - base) / 2 ** 20
        if i == 1:
            errors = _errors({n: g for n, g in grads().items() if g is not None}, ref["grads"])
        finish()
        if i:
            rows.append({"seconds": seconds, "peak_mib": peak, "loss": float(loss.detach())})
    if args.role == "ds-usp" and engine.usp.memory is not None and engine.usp.memory.choices is not None:
        features = engine.usp.memory.choices.describe(engine.usp.memory.layers)
    work = count_work(step, finish)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rows, work))
    dist.barrier()
    if dist.get_rank():
        return {}
    works = [w for _, w in gathered]
    gathered = [r for r, _ in gathered]
    per_iter = [max(ranks[i]["seconds"] for ranks in gathered) for i in range(args.iters)]
    return {"family": args.family, "split": args.split, "system": args.role,
            "loss_rel": abs(rows[0]["loss"] - ref["loss"]) / abs(ref["loss"]), **errors,
            "peak_mib": max(max(x["peak_mib"] for x in ranks) for ranks in gathered),
            "peak_mib_per_rank": [max(x["peak_mib"] for x in ranks) for ranks in gathered],
            "seconds": statistics.median(per_iter), "seconds_per_iter": per_iter, "memory_features": features,
            "work_per_rank": works,
            **({"gflop_max_rank": max(w["gflop"] for w in works), "kernels_max_rank": max(w["kernels"] for w in works),
                "syncs_max_rank": max(w["syncs"] for w in works)} if all(works) else {})}


def count_work(step: Callable[[], torch.Tensor], finish: Callable[[], None]) -> Optional[dict]:
    """One more forward and backward counted by ``ds_usp/instruments/work_meter.py``'s ``StepMeter`` (aten ops a GPU
    would launch as kernels, FLOPs by torch's formulas, host syncs): the same count whatever the machine's load; None
    where the meter is missing."""
    try:
        from ds_usp.instruments.work_meter import StepMeter
    except ImportError:
        return None
    with StepMeter() as meter:
        step()
    finish()
    total = meter.total
    return {"gflop": total.flops / 1e9, "kernels": total.kernels, "matmuls": total.matmuls, "syncs": total.syncs}


def _job(role: str, family: str, split: str, args: argparse.Namespace, reference: Path) -> dict:
    out = Path(f"/tmp/dit_cp_{os.getpid()}_{role}_{family}_{split}.json")
    flags = ["--role", role, "--family", family, "--split", split, "--out", out if role != "reference" else reference,
             "--reference", reference, "--iters", args.iters, "--heads", args.heads,
             "--latent", ",".join(map(str, args.latent)), "--image", args.image]
    if role == "reference":  # one process
        done = start_ranks(__file__, flags, capture=True)
    else:
        done = start_ranks(__file__, flags, 4, port=job_port(args, next(_PORTS)), capture=True)
    if done.returncode:
        lines = (done.stdout + done.stderr).strip().splitlines()
        errors = [line for line in lines if "Error:" in line and "ChildFailedError" not in line]  # a rank's
        why = errors[-1] if errors else (lines[-1] if lines else "?")
        print(f"{TAG} {role} {family} {split} failed: {why}", flush=True)
        return {"family": family, "split": split, "system": role, "failed": why}
    return json.loads(out.read_text()) if role != "reference" else {}


def main() -> None:
    p = base_parser(__doc__, master_port=0)
    p.add_argument("--families", default="wan,flux", help="comma-separated: wan, flux")
    p.add_argument("--splits", default="4x1,1x4,2x2", help=f"comma-separated UxR from {', '.join(SPLITS)}")
    p.add_argument("--systems", default="ds-usp,diffusers")
    p.add_argument("--iters", type=int, default=3, help="measured steps after one warm-up")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--latent", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16, 32, 32),
                   help="Wan's latent frames,height,width (tokens: f * h/2 * w/2)")
    p.add_argument("--image", type=int, default=64, help="Flux's image side in tokens (side x side)")
    add_job_flags(p)
    p.add_argument("--family", default="wan", help=argparse.SUPPRESS)
    p.add_argument("--split", default="2x2", help=argparse.SUPPRESS)
    p.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if run_as_job(args, run):
        return
    results = []
    for family in args.families.split(","):
        reference = Path(f"/tmp/dit_cp_{os.getpid()}_{family}_reference.pt")
        _job("reference", family, "1x1", args, reference)
        for split in args.splits.split(","):
            for system in args.systems.split(","):
                row = _job(system, family, split, args, reference)
                results.append(row)
                if "failed" not in row:
                    print(f"{TAG} {family} {split} {system:>9}: peak {row['peak_mib']:8.1f} MiB, "
                          f"{row['seconds']:6.2f} s, loss rel {row['loss_rel']:.1e}, gradient rel "
                          f"{row['grad_rel']:.1e} (worst parameter {row['grad_max_rel']:.1e})"
                          + (f", per rank {row['gflop_max_rank']:.2f} GFLOP, {row['kernels_max_rank']} kernels, "
                             f"{row['syncs_max_rank']} syncs" if "gflop_max_rank" in row else ""), flush=True)
        reference.unlink(missing_ok=True)
    if args.json:
        path = write_result(args.json, {"benchmark": "dit_cp", "args": {k: v for k, v in vars(args).items() if k
                                                                         not in ("role", "out", "family", "split",
                                                                                 "reference")},
                                        "runs": results})
        print(f"{TAG} wrote {path}")


if __name__ == "__main__":
    main()
