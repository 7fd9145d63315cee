"""4 ranks sharing one GPU over gloo (issue 63): ds-usp's multi-rank GPU path trained against one process.

Run (one CUDA GPU; about 3 minutes on an H200 by its sizing, not measured yet):

    python benchmarks/gpu_shared.py --json gpu_shared.json
    python benchmarks/gpu_shared.py --dry-run --json /tmp/dry_shared.json   # on CPU: tiny shapes, the whole script

What runs: two jobs, one after the other.

* ``reference``: one process (a world of one, DeepSpeed, HF's ``sdpa`` attention) trains a small Llama (``--shape
  small``: hidden 512, 2 layers, 8 heads, 4 kv heads of 64, vocab 8192; random weights drawn once from one seed) for
  ``--steps`` steps on each case, once in bf16 (DeepSpeed's bf16: fp32 master weights) and once in fp32 from the same
  bf16-rounded weights. Cases: a packed row at ``--packed-seq`` (``--docs`` documents, positions restarting at 0,
  labels -100 at each document's start, as ``DataCollatorWithFlattening`` packs them; HF's ``sdpa`` masks per
  document), then one plain row per S from ``--min-seq`` doubling to ``--max-seq``, until out of memory or past
  ``--ref-budget`` seconds (the next S is expected to take :data:`GROWTH_COST` times the last).
* ``ranks``: 4 processes (torchrun), every one ``torch.cuda.set_device(0)`` and one gloo process group: gloo's
  collectives take CUDA tensors (copies through pinned host memory of their own), and ``ds_usp.comm`` stages each
  ring exchange through pinned host buffers of a pool (gloo's send and recv take host memory only). For each case
  the reference finished, and each split of :data:`SPLITS` (2x2 and 1x4, ``"sequence_parallel": "usp"``), the same
  model trains the same steps with ``ds_usp.initialize`` (bf16, ZeRO ``--zero``, the same SGD); then one more step
  runs under ``torch.profiler`` and :class:`~ds_usp.instruments.work_meter.LayerHostReads`. ds-usp takes cuDNN's
  attention op for kernel calls of >= 16K x 16K query x key pairs (``DS_USP_CUDNN_ATTENTION`` left on): by the
  zigzag blocks' sizes, at 2x2 from S = 64K (1x4's blocks stay smaller); the profiled step counts cuDNN's kernels.

The check, per (case, split), against the bf16 reference run (``ref16``) and the fp32 one (``ref32``):
bf16 rounds to 8 significant bits (unit roundoff u = 2^-8 = 3.9e-3 per operation), and ds-usp's run differs from the
single process only in how its bf16 sums are split and ordered (attention blocks merged by log-sum-exp in fp32,
partial gradients of 4 ranks summed). Each bf16 run is then about as far from the exact result as the other, and
ref32 stands for the exact one (fp32's roundoff is 2^16 times smaller): |usp - ref16| <= |usp - ref32| +
|ref32 - ref16| ~ 2 |ref16 - ref32|, and one more |ref16 - ref32| for the roundings the 4-rank split adds (bf16
gradients summed over ranks). Hence the tolerance :data:`K` = 3 times ref16's own distance from ref32, measured on
the same case rather than a fixed number:

* losses: max over the steps of |usp - ref16| <= K max |ref16 - ref32| + u |loss| / sqrt(tokens) (the floor: the
  standard error of a mean of ``tokens`` terms each rounded once, for a case where ref16 happens to land on ref32);
* parameters: what the steps changed, ``delta = w_after - w_before`` of the fp32 master weights (the bf16 weights
  round away updates smaller than their last bit): ||delta_usp - delta16|| / ||delta16|| <= K ||delta32 - delta16|| /
  ||delta16||, over all parameters (the worst tensor's ratio is reported too). SGD with momentum, not Adam: an update
  proportional to the gradient, so the check measures the gradients (Adam's first steps are +-lr whatever the
  gradient's size, and a sign flip of a near-zero gradient would weigh as much as a wrong one).

The profiled step (rank 0's, after the compared ones) reports: host reads of tensor values and tensors made from host
data inside the decoder layers (``LayerHostReads``: 0 expected, per forward and recomputation), the CUDA calls that
block the host (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy``) in
total, by thread and inside the decoder layers' forwards (profiler ranges put around each layer), the staged
exchanges and host waits ``ds_usp.comm.staging_stats`` counted (one per staged exchange, by design: gloo reads the
host buffer when the send is issued; gloo's own collectives also wait on the host, in its worker threads), whether
the pool of host buffers grew, and the kernels whose name says cuDNN. Rows go to ``--json`` (with provenance) after
the run; a job stopped by its time limit or out of memory keeps the rows written before.

On CPU (``--dry-run``) every path runs with CPU tensors over gloo, and the ring groups are marked with
``ds_usp.comm.stage_point_to_point`` so that the ring exchanges take the staged path (unpinned buffers, no device
waits) as CUDA tensors do on the GPU. What only a GPU shows: gloo's CUDA collectives, pinned copies and their
ordering, cuDNN's op, the CUDA host syncs, memory and time.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from _common import add_job_flags, base_parser, close_distributed, save_results, start_ranks, table, world_of_one

TAG = "[gpu_shared]"
CUDA = torch.cuda.is_available()
SHAPES = {
    "small": dict(hidden=512, layers=2, heads=8, kv_heads=4, intermediate=1408, vocab=8192),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256),  # the CPU dry run
}
SPLITS = ((2, 2), (1, 4))  # (ulysses, ring) over the 4 ranks
RANKS = 4
UNIT_ROUNDOFF = 2.0 ** -8  # bf16: 8 significant bits, rounding to nearest
K = 3.0  # the tolerance in units of the bf16 reference's own distance from fp32 (module docstring)
LR, MOMENTUM, CLIP = 0.1, 0.9, 1.0
GROWTH_COST = 3.0  # a case at twice the S is expected to take this many times as long (transfers x2, attention x4)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
LAYER_RANGE = "gpu_shared.decoder_layer"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = base_parser(__doc__, seed=0, timeout=600.0)
    p.add_argument("--shape", choices=list(SHAPES), default="small")
    p.add_argument("--min-seq", type=int, default=8192, help="first S of the plain rows")
    p.add_argument("--max-seq", type=int, default=65536, help="last S tried (S doubles)")
    p.add_argument("--packed-seq", type=int, default=0, help="S of the packed row (0: --min-seq)")
    p.add_argument("--docs", type=int, default=6, help="documents in the packed row")
    p.add_argument("--steps", type=int, default=3, help="training steps compared per case")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=1, help="ZeRO stage of every run")
    p.add_argument("--budget", type=float, default=100.0,
                   help="seconds the 4-rank job may spend on its cases (a next S expected past it is not run)")
    p.add_argument("--ref-budget", type=float, default=40.0, help="the same for the reference job")
    p.add_argument("--native-op", choices=("off", "auto", "on"), default="off",
                   help="usp.native_op (off: the PyTorch twins, no JIT build inside the timed job)")
    p.add_argument("--dry-run", action="store_true", help="on CPU: --shape tiny, one plain and one packed row of 64")
    add_job_flags(p)
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.min_seq, args.max_seq, args.packed_seq = "tiny", 64, 64, 64
    args.packed_seq = args.packed_seq or args.min_seq
    if not CUDA and args.shape != "tiny":
        p.error("needs a CUDA GPU (--dry-run or --shape tiny runs on CPU, to check the script)")
    if args.steps < 1 or args.docs < 2 or args.packed_seq < 2 * args.docs:
        p.error("--steps >= 1, --docs >= 2 and --packed-seq >= 2 x --docs")
    return args


def job_argv(args: argparse.Namespace) -> list[str]:
    """The flags a job is started with (the parent's, without its result file). None may abbreviate one of torchrun's
    own options (``--start`` would: ``--start-method``), which torchrun parses after the script's name too."""
    flags = ["--shape", args.shape, "--min-seq", args.min_seq, "--max-seq", args.max_seq, "--packed-seq", args.packed_seq,
             "--docs", args.docs, "--steps", args.steps, "--zero", args.zero, "--budget", args.budget,
             "--ref-budget", args.ref_budget, "--native-op", args.native_op, "--seed", args.seed,
             "--timeout", args.timeout]
    return [str(x) for x in flags]


# ------------------------------------------------------------------------------------------------- the cases


def cases(args: argparse.Namespace) -> list[tuple[str, int]]:
    """``(kind, S)``: the packed row first (it runs whatever the budget), then the plain rows, S doubling."""
    out, seq = [("packed", args.packed_seq)], args.min_seq
    while seq <= args.max_seq:
        out.append(("plain", seq))
        seq *= 2
    return out


def doc_lengths(seq: int, docs: int) -> list[int]:
    """``docs`` document lengths summing to ``seq``: one of a single token, the others uneven (across shards)."""
    weights = [1 + (3 * i) % 5 for i in range(docs - 1)]
    room = seq - 1
    lengths = [max(1, room * w // sum(weights)) for w in weights]
    lengths[-1] += room - sum(lengths)
    return lengths[:1] + [1] + lengths[1:]


def batch(kind: str, seq: int, shape: dict, args: argparse.Namespace) -> dict:
    """The case's row on the CPU: ``input_ids``, ``labels`` (-100 at each document's start) and, packed,
    ``position_ids`` restarting at 0 per document."""
    g = torch.Generator().manual_seed(args.seed + seq + (7 if kind == "packed" else 0))
    ids = torch.randint(0, shape["vocab"], (1, seq), generator=g)
    labels = ids.clone()
    out = {"input_ids": ids, "labels": labels}
    if kind == "packed":
        positions = torch.cat([torch.arange(n) for n in doc_lengths(seq, args.docs)]).unsqueeze(0)
        labels[positions == 0] = -100
        out["position_ids"] = positions
    return out


def build_model(shape: dict, attn: str, dtype: torch.dtype, seed: int) -> Any:
    """The small Llama: weights drawn in fp32 on the CPU from ``seed``, rounded to bf16, then cast to ``dtype`` (fp32
    runs start from the same bf16-rounded weights) on this process's device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         max_position_embeddings=1 << 20, rope_theta=500000.0, tie_word_embeddings=False,
                         use_cache=False, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.to(torch.bfloat16).to(device=_device(), dtype=dtype)


def ds_config(args: argparse.Namespace, bf16: bool) -> dict:
    """Every run's DeepSpeed config: one row a step, SGD with momentum, clipping, ZeRO ``--zero``, bf16 or fp32."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "bf16": {"enabled": bf16}, "zero_optimization": {"stage": args.zero}, "steps_per_print": 10 ** 9,
            "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}}


def _device() -> torch.device:
    return torch.device("cuda", 0) if CUDA else torch.device("cpu")


def master_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master weight, whole, on the CPU (a collective over the engine's ranks under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        if full is None and p.dtype != torch.float32:  # no master weight found: the bf16 one would hide the updates
            raise RuntimeError(f"no fp32 master weight for {name} (ZeRO stage {engine.zero_optimization_stage()})")
        out[name] = (full if full is not None else p.detach()).float().cpu()
    return out


def train(engine: Any, inputs: dict, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` steps of ``engine(**inputs)``: the losses and each step's seconds."""
    losses, times = [], []
    for _ in range(steps):
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    return losses, times


def _release() -> None:
    """The last case's memory back before the next one is built."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- the reference job


def reference_case(kind: str, seq: int, dtype: str, args: argparse.Namespace) -> dict:
    """One process, HF ``sdpa``: the case's losses and parameter updates in ``dtype``."""
    import deepspeed

    _release()
    shape = SHAPES[args.shape]
    model = build_model(shape, "sdpa", torch.bfloat16 if dtype == "bf16" else torch.float32, args.seed)
    before = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(args, dtype == "bf16"))
    inputs = {k: v.to(engine.device) for k, v in batch(kind, seq, shape, args).items()}
    losses, times = train(engine, dict(inputs, use_cache=False), args.steps)
    after = master_weights(engine)
    engine.destroy()
    return {"losses": losses, "step_s": times, "delta": {n: after[n] - before[n] for n in before}}


def run_reference(args: argparse.Namespace) -> None:
    """The reference job: each case in bf16 and fp32, saved to ``--out``/ref_<kind>_<S>.pt as it ends; the cases done
    (and why it stopped) in ``--out``/reference.json."""
    import deepspeed

    world_of_one()
    if CUDA:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo", verbose=False)
    out, done, t0, last = Path(args.out), [], time.perf_counter(), 0.0
    note = None
    for kind, seq in cases(args):
        if kind == "plain" and last and time.perf_counter() - t0 + GROWTH_COST * last > args.ref_budget:
            note = (f"reference stopped before S={seq}: ~{GROWTH_COST * last:.0f} s would pass --ref-budget "
                    f"{args.ref_budget:.0f}")
            break
        c0 = time.perf_counter()
        try:
            runs = {dtype: reference_case(kind, seq, dtype, args) for dtype in ("bf16", "fp32")}
        except torch.OutOfMemoryError as e:
            note = f"reference out of memory at {kind} S={seq}: {str(e).splitlines()[0][:160]}"
            break
        torch.save(runs, out / f"ref_{kind}_{seq}.pt")
        done.append({"kind": kind, "S": seq, **{f"{d}_losses": runs[d]["losses"] for d in runs},
                     **{f"{d}_step_s": runs[d]["step_s"] for d in runs}, "seconds": time.perf_counter() - c0})
        last = done[-1]["seconds"] if kind == "plain" else last
        (out / "reference.json").write_text(json.dumps({"cases": done, "note": None}))
        print(f"{TAG} reference {kind} S={seq}: bf16 losses {runs['bf16']['losses']}, fp32 {runs['fp32']['losses']}",
              flush=True)
    (out / "reference.json").write_text(json.dumps({"cases": done, "note": note}))
    close_distributed()


# --------------------------------------------------------------------------------------------- the 4-rank job


def usp_case(kind: str, seq: int, u: int, r: int, args: argparse.Namespace) -> dict:
    """Every rank: ``ds_usp.initialize`` at ``u x r`` and the case's steps; rank 0 gets the updates; then one step
    profiled (:func:`profiled_step`)."""
    import ds_usp
    from ds_usp import comm

    _release()
    shape = SHAPES[args.shape]
    model = build_model(shape, "usp", torch.bfloat16, args.seed)
    before = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    usp = {"ulysses_degree": u, "ring_degree": r, "native_op": {"off": False, "on": True}.get(args.native_op, "auto")}
    config = dict(ds_config(args, True), sequence_parallel="usp", sequence_parallel_size=u * r, usp=usp)
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
    if not CUDA:  # the CPU dry run takes the path CUDA tensors take on gloo: ring exchanges through host buffers
        comm.stage_point_to_point(engine.usp.topo.ring_group)
    shard = ds_usp.shard_batch(batch(kind, seq, shape, args), engine.usp.topo, layout=engine.usp.layout)
    inputs = {k: v.to(engine.device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    losses, times = train(engine, inputs, args.steps)
    after = master_weights(engine)
    row = {"losses": losses, "step_s": times, "delta": {n: after[n] - before[n] for n in before},
           "peak_GiB": torch.cuda.max_memory_allocated() / 2 ** 30 if CUDA else None}
    row["profile"] = profiled_step(engine, inputs)
    engine.destroy()
    return row


def run_ranks(args: argparse.Namespace) -> None:
    """The 4-rank job: each case the reference finished, at each split; rank 0 compares and appends a row to
    ``--out``/rows.jsonl as each ends. A rank out of memory ends the job (torchrun stops the others)."""
    import datetime

    import torch.distributed as dist

    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    out, rank = Path(args.out), dist.get_rank()
    reference = json.loads((out / "reference.json").read_text())
    t0, last = time.perf_counter(), 0.0
    for case in reference["cases"]:
        kind, seq = case["kind"], case["S"]
        late = kind == "plain" and last > 0 and time.perf_counter() - t0 + GROWTH_COST * last > args.budget
        stop = torch.tensor([late])
        dist.broadcast(stop, 0)  # rank 0's clock decides for every rank
        if stop.item():
            _append(out, rank, {"kind": kind, "S": seq,
                                "note": f"not run: ~{GROWTH_COST * last:.0f} s would pass --budget {args.budget:.0f}"})
            break
        c0 = time.perf_counter()
        for u, r in SPLITS:
            try:
                got = usp_case(kind, seq, u, r, args)
            except torch.OutOfMemoryError as e:
                _append(out, rank, {"kind": kind, "S": seq, "split": f"{u}x{r}", "rank": rank,
                                    "note": f"out of memory: {str(e).splitlines()[0][:160]}"}, every_rank=True)
                os._exit(3)
            if rank == 0:
                tokens = int((batch(kind, seq, SHAPES[args.shape], args)["labels"][:, 1:] != -100).sum())
                _append(out, rank, compare_case(kind, seq, u, r, got, torch.load(out / f"ref_{kind}_{seq}.pt"), tokens))
        last = time.perf_counter() - c0 if kind == "plain" else last
    close_distributed()


def _append(out: Path, rank: int, row: dict, every_rank: bool = False) -> None:
    if rank == 0 or every_rank:
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------- the comparison


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def compare_case(kind: str, seq: int, u: int, r: int, got: dict, ref: dict, tokens: int) -> dict:
    """One (case, split) row: ds-usp's losses and updates against the bf16 reference, the tolerances from the bf16
    reference's own distance from the fp32 one (module docstring; ``tokens``: the tokens the loss averages), and the
    profiled step."""
    r16, r32 = ref["bf16"], ref["fp32"]
    loss_gap = max(abs(a - b) for a, b in zip(got["losses"], r16["losses"]))
    loss_ref_gap = max(abs(a - b) for a, b in zip(r16["losses"], r32["losses"]))
    loss_tol = K * loss_ref_gap + UNIT_ROUNDOFF * abs(r16["losses"][0]) / math.sqrt(tokens)
    names = sorted(r16["delta"])
    scale = _norm([r16["delta"][n] for n in names])
    update_gap = _norm([got["delta"][n] - r16["delta"][n] for n in names]) / scale
    update_ref_gap = _norm([r32["delta"][n] - r16["delta"][n] for n in names]) / scale
    worst = max(names, key=lambda n: _norm([got["delta"][n] - r16["delta"][n]]) /
                max(_norm([r32["delta"][n] - r16["delta"][n]]), 1e-30))
    worst_ratio = _norm([got["delta"][worst] - r16["delta"][worst]]) / max(
        _norm([r32["delta"][worst] - r16["delta"][worst]]), 1e-30)
    ok = loss_gap <= loss_tol and update_gap <= K * update_ref_gap
    return {"kind": kind, "S": seq, "split": f"{u}x{r}", "ok": ok, "losses": got["losses"],
            "ref_bf16_losses": r16["losses"], "ref_fp32_losses": r32["losses"], "loss_gap": loss_gap,
            "loss_ref_gap": loss_ref_gap, "loss_tol": loss_tol, "update_gap": update_gap,
            "update_ref_gap": update_ref_gap, "update_tol": K * update_ref_gap, "worst_param": worst,
            "worst_param_ratio": worst_ratio, "step_s": got["step_s"], "ref_bf16_step_s": r16["step_s"],
            "peak_GiB": got["peak_GiB"], "profile": got["profile"]}


# -------------------------------------------------------------------------------------------- the profiled step


def profiled_step(engine: Any, inputs: dict) -> dict:
    """One more step under ``torch.profiler`` and ``LayerHostReads`` (every rank runs it; rank 0's is reported)."""
    from torch.profiler import ProfilerActivity, profile

    from ds_usp import comm
    from ds_usp.instruments.work_meter import LayerHostReads

    layers = engine.module.model.layers
    before = comm.staging_stats()
    ranges = _layer_ranges(layers)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    try:
        with LayerHostReads(layers) as reads, profile(activities=activities) as prof:
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            if CUDA:
                torch.cuda.synchronize()
    finally:
        for handle in ranges:
            handle.remove()
    after = comm.staging_stats()
    events = prof.events()
    return {"layer_host_reads": reads.counts(), "layer_host_read_sites": reads.sites()[:10],
            "syncs": count_syncs(events), "staged_exchanges": after["exchanges"] - before["exchanges"],
            "staged_host_syncs": after["host_syncs"] - before["host_syncs"],
            "pool_allocations": after["allocations"] - before["allocations"], "pool_bytes": after["bytes"],
            "cudnn_kernels": sum(1 for e in events if "cudnn" in e.name.lower() and e.device_type.name == "CUDA")}


def _layer_ranges(layers: Any) -> list:
    """Forward hooks that put a profiler range (:data:`LAYER_RANGE`) around each decoder layer's forward (the
    recomputation's too); their handles."""
    from torch.autograd.profiler import record_function

    open_ranges: dict[int, list] = {}

    def enter(module: Any, args: Any) -> None:
        ctx = record_function(LAYER_RANGE)
        ctx.__enter__()
        open_ranges.setdefault(id(module), []).append(ctx)

    def leave(module: Any, args: Any, output: Any) -> None:
        stack = open_ranges.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = []
    for layer in layers:
        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave, always_call=True)]
    return handles


def count_syncs(events: Any) -> dict:
    """The CUDA calls that block the host (:data:`SYNC_CALLS`): in all, by thread, and inside a decoder layer's
    forward (a layer range on the same thread around the call's start)."""
    spans: dict[int, list] = {}
    for e in events:
        if e.name == LAYER_RANGE:
            spans.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end))
    total, inside, by_thread = 0, 0, {}
    for e in events:
        if e.name not in SYNC_CALLS:
            continue
        total += 1
        by_thread[str(e.thread)] = by_thread.get(str(e.thread), 0) + 1
        start = e.time_range.start
        inside += any(a <= start < b for a, b in spans.get(e.thread, ()))
    return {"total": total, "inside_layers": inside, "by_thread": by_thread,
            "layer_ranges": sum(len(v) for v in spans.values())}


# ------------------------------------------------------------------------------------------------- the parent


def run_job(role: str, ranks: Optional[int], budget: float, flags: list[str], work: Path) -> tuple[Optional[str], bool]:
    """One job (``ranks`` None: one plain process): why it failed (None: it did not, its error's tail shown) and
    whether this process is being stopped (SIGTERM, Ctrl-C: the job was killed, no next job starts)."""
    t0 = time.perf_counter()
    try:
        done = start_ranks(__file__, [*flags, "--role", role, "--out", str(work)], ranks, timeout=budget + 60,
                           capture="stderr")
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - its time limit, the launcher, a stop
        print(f"{TAG} {role} job: stopped after {time.perf_counter() - t0:.0f} s: {e!r}", flush=True)
        return f"stopped after {time.perf_counter() - t0:.0f} s: {e!r}", not isinstance(e, Exception)
    print(f"{TAG} {role} job: {time.perf_counter() - t0:.0f} s, exit {done.returncode}", flush=True)
    if done.returncode == 0:
        return None, False
    print("\n".join(done.stderr.splitlines()[-30:]), flush=True)
    errors = [line for line in done.stderr.splitlines() if "Error" in line]
    return (errors[-1:] or [f"exit {done.returncode}"])[0][:300], False


def run_jobs(args: argparse.Namespace, work: Path) -> list[dict]:
    """The reference job, then the 4-rank job on the cases it finished; every row either wrote (and a note for a job
    that failed or was stopped)."""
    flags = job_argv(args)
    failed, stopped = run_job("reference", None, args.ref_budget, flags, work)
    rows = [{"kind": "reference", "note": f"reference job: {failed}"}] if failed else []
    path = work / "reference.json"
    ref = json.loads(path.read_text()) if path.exists() else {}
    rows += [{"kind": c["kind"], "S": c["S"], "split": "reference", **{k: v for k, v in c.items()
                                                                      if k not in ("kind", "S")}}
             for c in ref.get("cases", [])]
    rows += [{"kind": "reference", "note": ref["note"]}] if ref.get("note") else []
    if not ref.get("cases") or stopped:
        return rows
    failed, _ = run_job("ranks", RANKS, args.budget, flags, work)
    rows += [{"kind": "ranks", "note": f"4-rank job: {failed}"}] if failed else []
    path = work / "rows.jsonl"
    return rows + ([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])


def verdict(rows: list[dict]) -> list[str]:
    """What the run shows, line by line."""
    compared = [r for r in rows if "ok" in r]
    lines = [f"{TAG} {len([r for r in compared if r['ok']])} of {len(compared)} (case, split) runs within "
             f"bf16's tolerance (K = {K:g} x the bf16 reference's distance from fp32)"]
    for r in compared:
        prof = r["profile"]
        reads = {phase: (c["reads"], c["made"]) for phase, c in prof["layer_host_reads"].items()}
        lines.append(f"{TAG} {r['kind']} S={r['S']} {r['split']}: {'ok' if r['ok'] else 'FAILED'}; loss gap "
                     f"{r['loss_gap']:.2e} (tol {r['loss_tol']:.2e}), update gap {r['update_gap']:.2e} (tol "
                     f"{r['update_tol']:.2e}); profiled step: (host reads, host-made) in layers {reads}, CUDA host "
                     f"syncs {prof['syncs']['total']} ({prof['syncs']['inside_layers']} inside layer forwards), "
                     f"staged exchanges {prof['staged_exchanges']} with {prof['staged_host_syncs']} host waits, pool "
                     f"+{prof['pool_allocations']} buffers, cuDNN kernels {prof['cudnn_kernels']}")
    lines += [f"{TAG} note: {r['note']}" for r in rows if r.get("note")]
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.role == "reference":
        run_reference(args)
        return 0
    if args.role == "ranks":
        run_ranks(args)
        return 0
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="gpu_shared_"))
    # a session's time limit (SIGTERM) stops the running job (start_ranks kills it) and the rows so far are saved
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{TAG} stopped (SIGTERM)"))
    rows = run_jobs(args, work)
    print(table([r for r in rows if "ok" in r], ["kind", "S", "split", "ok", "loss_gap", "loss_tol", "update_gap",
                                                 "update_tol", "peak_GiB"],
                {"loss_gap": ".2e", "loss_tol": ".2e", "update_gap": ".2e", "update_tol": ".2e", "peak_GiB": ".2f"},
                markdown=True))
    print("\n".join(verdict(rows)))
    args.json = args.json or time.strftime("gpu_shared-%Y%m%d-%H%M%S.json", time.gmtime())
    print(f"{TAG} {time.perf_counter() - t0:.0f} s; results written to {save_results(args.json, vars(args), rows)}")
    return 0 if rows and all(r.get("ok", True) for r in rows) and any("ok" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
