"""Long sequences (issue 12): step time and per-rank peak memory of a whole training step, ds-usp vs DeepSpeed ALST.

Run (each system at each length is its own fresh job of ``--ranks`` ranks, one after the other):

    python benchmarks/long_seq.py --seqs 8192,16384 --json long_seq_8k.json
    python benchmarks/long_seq.py --from-json a.json,b.json --json long_seq.json --plot docs/img/long_seq_memory.png

The model: a HuggingFace Llama (default the issue's: vocab 32000, hidden 256, intermediate 896, 4
layers, 8 heads), random weights, ZeRO (``--zero``, default 3) with AdamW, sequence parallel over all
``--ranks``, one sequence of S random tokens per step. Systems (:data:`SYSTEMS`; add one there):

* ``ds-usp``: ``"sequence_parallel": "usp"`` and nothing else (degrees chosen, memory features "auto");
* ``ds-usp off``: the same with ``chunked_loss``, ``tiled_mlp``, ``activation_checkpointing`` and
  ``offload_activations`` false (only the USP attention);
* ``ds-usp UxR`` (any split of the ranks, e.g. ``ds-usp 2x2``): the degrees given;
* ``ds-usp fp8``: the user default with ``"comm_dtype": "fp8"`` (activations on the wire as float8 e4m3);
* ``ds-usp ALST features``: ALST full's features through ds-usp (chunked loss, tiled MLP, full checkpointing of
  every layer, forced on): what ds-usp's own pieces cost and save doing what ALST full does;
* ``ds-usp budget``: "auto" with ``usp.memory_gib`` equal to ALST full's absolute peak at the same S (the largest
  over its ranks); it must stay under it. Needs ``ALST full`` earlier in ``--systems``;
* ``ds-usp tight``: "auto" with ``usp.memory_gib`` equal to ds-usp's own resident size before its step plus half of
  ALST full's peak growth: the smallest plan must take it (growth <= 0.5x ALST full's). Needs ``ds-usp`` and
  ``ALST full`` earlier in ``--systems``; ``ds-usp tight UxR`` / ``ds-usp budget UxR``: the same at that split;
* ``ALST plain``: DeepSpeed's ``UlyssesSPAttentionHF`` (core attention sdpa) and its ``mpu``,
  contiguous shards, HF's loss on each shard's logits, the differentiable weighted average of the
  per-rank losses, as DeepSpeed's ALST tutorial wires it;
* ``ALST full``: plus DeepSpeed's ``TiledMLP`` (the tutorial's patch: ``ceil(seqlen / hidden)`` shards),
  ``TiledFusedLogitsLoss`` with 1/8 GiB fp32 logits tiles, and HF gradient checkpointing.

Memory, per rank and step: on CPU the growth of the resident set (freed heap returned with
``malloc_trim`` and the kernel's high-water mark reset with ``5 > /proc/self/clear_refs`` before the
step, ``VmHWM`` minus the resident size then after it); on CUDA ``max_memory_allocated`` minus the
allocation before the step. Reported: the largest over the ranks, of the last step (the first
allocates the optimizer state). On CPU the resident peak depends on the C heap's rule: by default glibc's
mmap threshold rises as large blocks are freed and freed blocks below it stay resident, while a ds-usp row given
``usp.memory_gib`` fixes it at 64 KiB (``ds_usp.integration.step.choices.bound_host_heap``) so that freed tensors leave
the resident set. ``--bound-heap`` applies that rule at the start of every worker of every system, so that peers and
ds-usp rows are measured alike; each row's ``heap`` says which rule its ranks ran under. Time: wall and process CPU time of a step, the largest over the
ranks, median over the steps after the first. The first step's loss (same weights, same tokens)
must agree between the systems to 1e-4 relative (later steps differ by design: ALST's tiled loss
does not scale the ``lm_head`` gradient by the incoming gradient); ``ds-usp fp8`` is not exact by design, its
distance is printed instead.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from _common import (MIB, NATIVE_OP, close_distributed, free_port, parse, parser, result_path, save_results,
                     start_ranks, table)

DEFAULT_SYSTEMS = ("ds-usp off", "ds-usp", "ds-usp 2x2", "ALST plain", "ALST full")
LOSS_RTOL = 1e-4
LOSSY = ("ds-usp fp8",)  # systems that are not exact by design: their first loss is reported, not held to LOSS_RTOL
TARGET_PEAK_VS_ALST_FULL = 0.5  # issue 26's targets: peak, steady step and first step against ALST full
TARGET_TIME_VS_ALST_FULL = 0.9
TARGET_FIRST_VS_ALST_FULL = 1.0
BUDGETED = {"ds-usp budget": ("ALST full",), "ds-usp tight": ("ds-usp", "ALST full")}  # -> the rows their budget needs


def budgeted(name: str) -> tuple[Optional[str], dict]:
    """A budgeted system's kind (a key of :data:`BUDGETED`, None: not one) and the split its name may add
    (``"ds-usp tight 4x1"``: the tight budget at 4 x 1), as ``usp`` keys."""
    found = re.fullmatch(r"(ds-usp (?:budget|tight))(?: (\d+)x(\d+))?", name)
    if found is None:
        return None, {}
    return found[1], ({"ulysses_degree": int(found[2]), "ring_degree": int(found[3])} if found[2] else {})
TAG = "[long_seq]"
Step = Callable[[], float]  # one training step; returns the loss
System = Callable[[str, int, argparse.Namespace], tuple[Step, Callable[[], str]]]  # -> (step, what it runs)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The shared flags (``--seqs``, ``--dtype`` of training, ``--heads``, ``--kv-heads``, ...) and the step's own."""
    p = parser(__doc__, seq=[8192, 16384, 32768, 65536], head_dim=None, ranks=4, timeout=3600.0)  # one job's
    p.add_argument("--systems", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=list(DEFAULT_SYSTEMS), help=f"comma-separated (default: {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--steps", type=int, default=3, help="training steps per job (the first is not timed)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=896)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "balanced"), help="ds-usp usp.layout")
    p.add_argument("--cap-gib", type=float, default=4.5, help="a length 'fits' when a step grows a rank by less")
    p.add_argument("--from-json", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="comma-separated result files of earlier runs (bare names: in benchmarks/results/): merge "
                        "them (a later file's row replaces one of the same system and S), report, run nothing")
    p.add_argument("--prior-json", default="", help="a result file (bare name: in benchmarks/results/) whose rows "
                   "come first, but for the systems run again: a budgeted system takes its budget from them, and they "
                   "are reported with this run's")
    p.add_argument("--plot", default="", help="write a plot of peak memory against S here (needs matplotlib)")
    p.add_argument("--bound-heap", action="store_true", help="on CPU, every worker of every system fixes glibc's "
                   "mmap threshold at 64 KiB (bound_host_heap) before it builds its model, as ds-usp does under "
                   "usp.memory_gib: freed tensors leave the resident set (default: glibc's rule, but for rows with a "
                   "budget)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "system|seq|result path"
    p.add_argument("--memory-gib", type=float, default=None, help=argparse.SUPPRESS)  # a budgeted system's
    args = parse(p, argv)
    args.head_dim = args.head_dim or args.hidden // args.heads
    for i, name in enumerate(args.systems):
        why = system_refusal(name, args.ranks)
        missing = [need for need in BUDGETED.get(budgeted(name)[0], ()) if need not in args.systems[:i]]
        if missing and not args.worker and not args.prior_json:
            why = f"{name!r} takes its budget from {' and '.join(missing)}: list them before it"
        if why:
            p.error(f"--systems: {why}")
    return args


# ------------------------------------------------------------------------------------- systems


def usp_keys(name: str, ranks: int) -> Optional[dict]:
    """The ``usp`` config keys of a ds-usp system, or None when ``name`` is not one."""
    if name == "ds-usp":
        return {}
    if name == "ds-usp fp8":
        return {"comm_dtype": "fp8"}
    if name == "ds-usp off":
        return {"chunked_loss": False, "tiled_mlp": False, "activation_checkpointing": False,
                "offload_activations": False}
    if name == "ds-usp ALST features":
        return {"chunked_loss": True, "tiled_mlp": True, "activation_checkpointing": "full",
                "offload_activations": False}
    kind, split = budgeted(name)
    if kind is not None:
        return split  # usp.memory_gib: from the rows its budget needs (run_job)
    split = re.fullmatch(r"ds-usp (\d+)x(\d+)", name)
    return {"ulysses_degree": int(split[1]), "ring_degree": int(split[2])} if split else None


def system_refusal(name: str, ranks: int) -> Optional[str]:
    """Why ``name`` is not a system for ``ranks`` ranks (None: it is)."""
    keys = usp_keys(name, ranks)
    if keys is None and name not in ("ALST plain", "ALST full"):
        return (f"unknown system {name!r}: ds-usp, ds-usp off, ds-usp fp8, ds-usp ALST features, ds-usp budget, "
                f"ds-usp tight, ds-usp UxR, ALST plain, ALST full")
    if keys and "ring_degree" in keys and keys["ulysses_degree"] * keys["ring_degree"] != ranks:
        return f"{name!r}: U x R must equal --ranks ({ranks})"
    return None


def build_model(args: argparse.Namespace, attn: str) -> Any:
    """The Llama, fp32, initialised from ``--seed`` (the same weights for every system)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=1 << 20,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def ds_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed config every system shares."""
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": args.zero}, "sequence_parallel_size": args.ranks, "steps_per_print": 10**9}
    if args.dtype != "fp32":
        cfg[args.dtype] = {"enabled": True}
    return cfg


def tokens(args: argparse.Namespace, seq: int) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.batch, seq), generator=torch.Generator().manual_seed(args.seed + seq))


def usp_engine(args: argparse.Namespace, usp: dict, seq: int) -> tuple[Any, Step]:
    """``ds_usp.initialize`` with these ``usp`` keys, and a step on its shard of ``seq`` tokens (``shard_batch``, the
    engine's own SP loss)."""
    import ds_usp

    ds_usp.hf.register_usp_attention()
    model = build_model(args, "usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(),
                                   config=dict(ds_config(args), sequence_parallel="usp", usp=usp))
    shard = ds_usp.shard_batch({"input_ids": tokens(args, seq)}, engine.usp.topo, layout=engine.usp.layout)
    batch = {k: shard[k].to(engine.device) for k in ("input_ids", "position_ids", "shift_labels")}

    def step() -> float:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return engine, step


def usp_system(name: str, seq: int, args: argparse.Namespace) -> tuple[Step, Callable[[], str]]:
    """A ds-usp system's step (:func:`usp_engine`) and its plan."""
    usp = dict(usp_keys(name, args.ranks), layout=args.layout, native_op=NATIVE_OP[args.native_op])
    if args.memory_gib:
        usp["memory_gib"] = args.memory_gib
    engine, step = usp_engine(args, usp, seq)
    topo = engine.usp.topo

    def describe() -> str:  # the memory plan is made at the first forward
        memory = engine.usp.memory.choices if engine.usp.memory else "no memory features"
        return f"{topo.ulysses_degree}x{topo.ring_degree} {engine.usp.layout}; {memory}"

    return step, describe


def alst_full(model: Any) -> None:
    """ALST's full recipe on an HF Llama as DeepSpeed's tutorial wires it: DeepSpeed's ``TiledMLP`` on every MLP
    (``ceil(S / hidden)`` shards, the same number on every rank) and HF gradient checkpointing."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama import modeling_llama

    def tiled_mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]), device=x.device)
        dist.all_reduce(shards, op=dist.ReduceOp.MAX)

        def forward(self: Any, t: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(t)) * self.up_proj(t))

        return TiledMLP.apply(forward, mlp, x, int(shards), [mlp.down_proj.weight, mlp.gate_proj.weight,
                                                             mlp.up_proj.weight])

    modeling_llama.LlamaMLP.forward = tiled_mlp
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def alst_tiled_loss(module: Any, hidden: torch.Tensor, shift: torch.Tensor, vocab: int) -> torch.Tensor:
    """The summed token losses through DeepSpeed's ``TiledFusedLogitsLoss``, 1/8 GiB fp32 logits tiles, with
    ArcticTraining's loss function."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    def fused_logits_loss(model_with_head: Any = None, hidden_states: Any = None, shift_labels: Any = None) -> Any:
        logits = model_with_head.lm_head(hidden_states)
        return model_with_head.loss_function(logits=logits, labels=None, vocab_size=vocab,
                                             shift_labels=shift_labels) * (shift_labels != -100).sum()

    shards = math.ceil(shift.numel() * vocab * 4 / (2 ** 30 / 8))
    return TiledFusedLogitsLoss.apply(fused_logits_loss, module, hidden, shift, None, shards,
                                      [module.lm_head.weight], "sum")


def alst_system(name: str, seq: int, args: argparse.Namespace) -> tuple[Step, Callable[[], str]]:
    """DeepSpeed's ALST as its tutorial wires it (``ALST full``: with TiledMLP, tiled loss and checkpointing)."""
    import deepspeed
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import groups

    full = name == "ALST full"
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    model = build_model(args, "sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=args.ranks,
                                                          micro_batch_size=args.batch, seq_length=seq,
                                                          seq_length_is_variable=False)
    if full:
        alst_full(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args),
                                      mpu=mpu)
    # at sequence parallel 1 DeepSpeed registers nothing (mpu None): the whole sequence on one rank
    sp_group, sp_rank = ((groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()) if mpu
                         else (None, 0))
    ids = tokens(args, seq)
    local = seq // args.ranks
    part = slice(sp_rank * local, (sp_rank + 1) * local)  # ALST's contiguous shards
    batch = {"input_ids": ids[:, part].to(engine.device),
             "position_ids": torch.arange(seq)[part].expand(args.batch, -1).to(engine.device)}
    shift = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)[:, part].to(engine.device)
    module = engine.module

    def step() -> float:
        good = (shift != -100).sum()
        if full:
            hidden = module.model(**batch, use_cache=False).last_hidden_state
            loss = alst_tiled_loss(module, hidden, shift, args.vocab) / max(int(good), 1)
        else:
            logits = engine(**batch, use_cache=False).logits
            loss = module.loss_function(logits=logits, labels=None, vocab_size=args.vocab, shift_labels=shift)
        if sp_group is None:
            total = loss
        else:
            losses = dist_fn.all_gather(loss, group=sp_group)
            goods = dist_fn.all_gather(good, group=sp_group)
            total = sum(x * g for x, g in zip(losses, goods)) / sum(goods)
        engine.backward(total)
        engine.step()
        return float(total)

    return step, lambda: "TiledMLP + TiledFusedLogitsLoss + checkpointing" if full else "Ulysses attention only"


SYSTEMS: dict[str, System] = {
    "ds-usp": usp_system, "ALST plain": alst_system, "ALST full": alst_system}  # "ds-usp ..." -> usp_system


# ---------------------------------------------------------------------------------------- worker


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def reset_peak() -> int:
    """Start a step's memory count; returns the baseline in bytes."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _kib("VmRSS:") * 1024


def read_peak() -> int:
    """The most held since :func:`reset_peak`, in bytes."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _kib("VmHWM:") * 1024


def heap_rule(args: argparse.Namespace) -> str:
    """The C heap's rule this worker's resident set is measured under; with ``--bound-heap`` (CPU) it is applied here,
    before the system builds anything."""
    if torch.cuda.is_available():
        return "CUDA caching allocator"
    from ds_usp.integration.step.choices import HEAP_THRESHOLD, bound_host_heap

    bounded = f"bounded {HEAP_THRESHOLD // 1024} KiB"
    if args.bound_heap:
        return bounded if bound_host_heap() else "glibc default (mallopt unavailable)"
    return f"{bounded} (usp.memory_gib)" if args.memory_gib else "glibc default"


def run_worker(args: argparse.Namespace) -> None:
    """One rank of one (system, S) job: ``--steps`` steps, each one's loss, times and peak growth, to JSON."""
    import torch.distributed as dist

    name, seq, path = args.worker.split("|")
    seq = int(seq)
    heap = heap_rule(args)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    make = SYSTEMS["ds-usp" if name.startswith("ds-usp") else name]
    step, describe = make(name, seq, args)
    steps = []
    for i in range(args.steps):
        dist.barrier()
        base = reset_peak()
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            loss = step()
        except RuntimeError as e:  # e.g. out of memory: reported, not hidden
            steps.append({"error": str(e).splitlines()[0][:300]})
            break
        peak = read_peak()
        steps.append({"loss": loss, "seconds": time.perf_counter() - w0, "cpu_seconds": time.process_time() - c0,
                      "peak_growth": peak - base, "base": base, "peak": peak})
    Path(f"{path}.rank{dist.get_rank()}").write_text(json.dumps({"plan": describe(), "heap": heap, "steps": steps}))
    close_distributed()


# ---------------------------------------------------------------------------------------- driver


def budget_gib(name: str, seq: int, rows: list[dict]) -> Optional[float]:
    """A budgeted system's ``usp.memory_gib`` at ``seq`` from the rows run before it (None: they did not run)."""
    by = {(r["system"], r["S"]): r for r in rows}
    full, usp = by.get(("ALST full", seq), {}), by.get(("ds-usp", seq), {})
    kind = budgeted(name)[0]
    if kind == "ds-usp budget" and full.get("abs_peak_MiB"):
        return full["abs_peak_MiB"] / 1024
    if kind == "ds-usp tight" and full.get("peak_MiB") and usp.get("base_MiB"):
        return (usp["base_MiB"] + full["peak_MiB"] / 2) / 1024
    return None


def run_job(name: str, seq: int, args: argparse.Namespace, argv: Sequence[str], scratch: Path,
            rows: Sequence[dict] = ()) -> dict:
    """Launch one job of ``--ranks`` ranks and reduce it to a table row (``rows``: those run before it, whose
    figures a budgeted system's ``usp.memory_gib`` comes from)."""
    path, port = scratch / f"{name.replace(' ', '_')}_{seq}", free_port()
    row = {"system": name, "S": seq, "peak_MiB": None, "abs_peak_MiB": None, "base_MiB": None, "budget_MiB": None,
           "step_s": None, "first_s": None, "cpu_s": None, "first_loss": None, "fits": "no", "heap": None,
           "note": None}
    extra = []
    kind = budgeted(name)[0]
    if kind is not None:
        gib = budget_gib(name, seq, list(rows))
        if gib is None:
            return dict(row, note=f"not run: {' and '.join(BUDGETED[kind])} at S={seq} did not run")
        extra, row["budget_MiB"] = ["--memory-gib", f"{gib:.6f}"], round(gib * 1024)
    print(f"{TAG} {name} S={seq}: running ({args.steps} steps)", flush=True)
    try:
        proc = start_ranks(__file__, [*argv, *extra, "--worker", f"{name}|{seq}|{path}"], args.ranks,
                           launcher="deepspeed",
                           port=port, timeout=args.timeout, capture=True, echo=False)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]
        tail = "" if proc.returncode == 0 else (errors[-1] if errors else proc.stderr[-300:])[-300:]
    except subprocess.TimeoutExpired:
        tail = f"timed out after {args.timeout:.0f} s"
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):  # of a rank that failed
        leftover.unlink(missing_ok=True)
    ranks = []
    for r in range(args.ranks):
        f = Path(f"{path}.rank{r}")
        if f.exists():
            ranks.append(json.loads(f.read_text()))
            f.unlink()
    errors = [s["error"] for r in ranks for s in r["steps"] if "error" in s]
    if tail or errors or len(ranks) != args.ranks:
        return dict(row, note=(errors[0] if errors else tail or "a rank wrote no result").replace("\n", " "))
    peak = max(r["steps"][-1]["peak_growth"] for r in ranks)
    timed = range(1, len(ranks[0]["steps"]))
    median = {k: statistics.median(max(r["steps"][i][k] for r in ranks) for i in timed) if timed else None
              for k in ("seconds", "cpu_seconds")}
    return dict(row, peak_MiB=round(peak / MIB), abs_peak_MiB=round(max(r["steps"][-1]["peak"] for r in ranks) / MIB),
                base_MiB=round(max(r["steps"][-1]["base"] for r in ranks) / MIB),
                step_s=median["seconds"], cpu_s=median["cpu_seconds"],
                first_s=max(r["steps"][0]["seconds"] for r in ranks),
                first_loss=ranks[0]["steps"][0]["loss"], fits="yes" if peak <= args.cap_gib * 2 ** 30 else "no",
                heap=ranks[0].get("heap"), note=ranks[0]["plan"])


def compare(rows: list[dict]) -> tuple[str, bool]:
    """The targets per S (ds-usp against ALST full and ALST plain) and the first-loss agreement of every system."""
    by = {(r["system"], r["S"]): r for r in rows}
    lines, agree = [f"{TAG} targets against ALST full: peak <= {TARGET_PEAK_VS_ALST_FULL}x, step time <= "
                    f"{TARGET_TIME_VS_ALST_FULL}x, first step <= {TARGET_FIRST_VS_ALST_FULL}x; first losses within "
                    f"{LOSS_RTOL:g} relative"], True
    for seq in sorted({r["S"] for r in rows}):
        usp, full, plain = (by.get((s, seq), {}) for s in ("ds-usp", "ALST full", "ALST plain"))
        parts = [f"S={seq}:"]
        if usp.get("peak_MiB") and full.get("peak_MiB"):
            ratio = usp["peak_MiB"] / full["peak_MiB"]
            parts.append(f"peak {ratio:.2f} x ALST full ({'met' if ratio <= TARGET_PEAK_VS_ALST_FULL else 'missed'});")
        for key, target, what in (("step_s", TARGET_TIME_VS_ALST_FULL, "step"),
                                  ("first_s", TARGET_FIRST_VS_ALST_FULL, "first step")):
            if usp.get(key) and full.get(key):
                ratio = usp[key] / full[key]
                parts.append(f"{what} {ratio:.2f} x ALST full ({'met' if ratio <= target else 'missed'});")
        if usp.get("step_s") and plain.get("step_s"):
            parts.append(f"step {usp['step_s'] / plain['step_s']:.2f} x ALST plain;")
        parts += budget_lines(by, seq)
        at_seq = [r for r in rows if r["S"] == seq and r["first_loss"] is not None]
        losses = [r["first_loss"] for r in at_seq if r["system"] not in LOSSY]
        if len(losses) > 1:
            spread = (max(losses) - min(losses)) / abs(min(losses))
            agree &= spread <= LOSS_RTOL
            parts.append(f"first losses agree to {spread:.1e} ({'ok' if spread <= LOSS_RTOL else 'FAIL'})")
        for r in (r for r in at_seq if r["system"] in LOSSY and losses):
            parts.append(f"{r['system']} first loss {abs(r['first_loss'] - losses[0]) / abs(losses[0]):.1e} from "
                         f"the exact systems;")
        if len(parts) > 1:
            lines.append(" ".join(parts))
    return "\n".join(lines), agree


def budget_lines(by: dict, seq: int) -> list[str]:
    """ds-usp running ALST's features, and "auto" under the two budgets, against ALST full at ``seq``."""
    full = by.get(("ALST full", seq), {})
    feats, budget, tight = (by.get((s, seq), {}) for s in ("ds-usp ALST features", "ds-usp budget", "ds-usp tight"))
    parts = []
    if feats.get("peak_MiB") and full.get("peak_MiB"):
        parts.append(f"ds-usp with ALST's features: peak {feats['peak_MiB'] / full['peak_MiB']:.2f} x, step "
                     f"{feats['step_s'] / full['step_s']:.2f} x ALST full;" if feats.get("step_s") and full.get("step_s")
                     else f"ds-usp with ALST's features: peak {feats['peak_MiB'] / full['peak_MiB']:.2f} x ALST full;")
    for name, row in (("ds-usp budget", budget), ("ds-usp tight", tight)):
        if row.get("abs_peak_MiB"):
            kept = row["abs_peak_MiB"] <= row["budget_MiB"]
            predicted = predicted_growth(row)
            parts.append(f"{name}: absolute peak {row['abs_peak_MiB']} of a {row['budget_MiB']} MiB budget "
                         f"({'kept' if kept else 'MISSED'}), grew {row['peak_MiB']} MiB"
                         + (f" where the cost model said {predicted:.0f};" if predicted else ";"))
        elif row.get("note"):
            parts.append(f"{name} ({row.get('budget_MiB')} MiB): {row['note'][:160]};")
    if tight.get("peak_MiB") and full.get("peak_MiB"):
        ratio = tight["peak_MiB"] / full["peak_MiB"]
        heaps = "" if tight.get("heap") == full.get("heap") else \
            f" (heap: {tight.get('heap') or 'unrecorded'} against {full.get('heap') or 'unrecorded'})"
        parts.append(f"ds-usp tight grew {ratio:.2f} x ALST full's growth{heaps} (target <= "
                     f"{TARGET_PEAK_VS_ALST_FULL}: {'met' if ratio <= TARGET_PEAK_VS_ALST_FULL else 'missed'});")
    return parts


def predicted_growth(row: dict) -> Optional[float]:
    """What the cost model predicted a ds-usp row's step to grow by, in MiB, from the choices in its note: the
    activations and what the step gathers of the model (ZeRO-3's parameters); None where the note has no prediction."""
    found = dict(re.findall(r"\b(predicted|gathered)=([0-9.e+-]+)", row.get("note") or ""))
    return (float(found["predicted"]) + float(found.get("gathered", 0))) / MIB if "predicted" in found else None


def pivot(rows: list[dict]) -> str:
    """Markdown: one line per S, one column per system, ``peak MiB, step s`` in each cell."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by = {(r["system"], r["S"]): r for r in rows}
    cells = []
    for seq in sorted({r["S"] for r in rows}):
        line = {"S": seq}
        for s in systems:
            r = by.get((s, seq))
            line[s] = "-" if r is None or r["peak_MiB"] is None else \
                f"{r['peak_MiB']} MiB" + (f", {r['step_s']:.1f} s" if r["step_s"] else " (not timed)")
        cells.append(line)
    return table(cells, ["S", *systems], markdown=True)


def plot(rows: list[dict], path: str, args: argparse.Namespace) -> None:
    """Peak memory growth of a step against S, one line per system (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in dict.fromkeys(r["system"] for r in rows):
        points = sorted((r["S"], r["peak_MiB"]) for r in rows if r["system"] == system and r["peak_MiB"])
        if points:
            ax.plot(*zip(*points), marker="o", label=system)
    seqs = sorted({r["S"] for r in rows})
    ax.set(xscale="log", yscale="log", xlabel=f"sequence length S (tokens, over {args.ranks} ranks)",
           ylabel="per-rank peak growth of a step (MiB)",
           title=f"Llama {args.layers}x{args.hidden}, vocab {args.vocab}, {args.dtype}, ZeRO-{args.zero}")
    ax.set_xticks(seqs, [f"{s // 1024}K" for s in seqs])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the measured lengths on the axis
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # same bytes on every run
    print(f"{TAG} plot written to {path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every system at every length (or merge earlier runs), print the tables and the targets."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    meta = vars(args)
    if args.from_json:
        runs = {path: json.loads(result_path(path).read_text()) for path in args.from_json}
        merged = {(r["system"], r["S"]): {k: None if v == "-" else v for k, v in r.items()}
                  for run in runs.values() for r in run["rows"]}
        rows = sorted(merged.values(), key=lambda r: r["S"])
        meta = dict(meta, sources={path: run.get("provenance") for path, run in runs.items()})  # the rows' origins
    else:
        scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"long_seq_{os.getpid()}"
        scratch.mkdir(parents=True, exist_ok=True)
        prior = json.loads(result_path(args.prior_json).read_text())["rows"] if args.prior_json else []
        rows = [r for r in prior if r["system"] not in args.systems]  # a system run again replaces its rows
        for seq in args.seqs:
            for name in args.systems:
                rows.append(run_job(name, seq, args, argv, scratch, rows))
                print(f"{TAG} {rows[-1]}", flush=True)
    print(table(rows, ["system", "S", "peak_MiB", "abs_peak_MiB", "budget_MiB", "step_s", "first_s", "cpu_s",
                       "first_loss", "fits", "note"],
                {"step_s": ".1f", "first_s": ".1f", "cpu_s": ".1f", "first_loss": ".6f"}))
    print(pivot(rows))
    text, agree = compare(rows)
    print(text)
    print(f"{TAG} results written to {save_results(args.json, meta, rows)}")
    if args.plot:
        plot(rows, args.plot, args)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
