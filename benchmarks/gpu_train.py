"""Training on one GPU (issues 27, 40, 49, 65): ds-usp's whole step against its peers, bf16, ZeRO-3, one sequence.

Run (on a machine with one CUDA GPU; each system is one process, S grows by ``--growth`` from ``--start`` until it
runs out of memory, passes ``--max-seq`` or the next length would not finish inside ``--budget`` seconds of steps):

    python benchmarks/gpu_train.py --shape 3b --systems "ds-usp,HF plain,ALST tiled loss,Liger all,Liger" \
        --start 16384 --max-seq 32768 --steps 3 --profile-seqs 16384 --json gpu_peers3b.json
    python benchmarks/gpu_train.py --shape 3b --report --prior-json gpu_peers3b.json,gpu_longest3b.json \
        --json gpu_issue65_3b.json     # run nothing: merge earlier runs' rows and report them together
    python benchmarks/gpu_train.py --attention --seqs 16384,131072 --json gpu_attention.json  # cuDNN vs flash SDPA
    python benchmarks/gpu_train.py --shape tiny --systems "ds-usp,Liger,ALST full offload" --start 64 \
        --max-seq 128 --steps 2 --profile-seqs 64 --json /tmp/dry.json      # a CPU dry run (TRITON_INTERPRET=1)

The model (``--shape``): a Llama-3-shaped decoder with random weights, the same for every system (seeded), untied
embeddings, rope theta 500000: ``1b`` hidden 2048, 16 layers, 32 heads, 8 kv heads (head dim 64), intermediate 8192,
vocab 128256 (1.50 B parameters); ``3b`` Llama-3.2 3B: hidden 3072, 28 layers, 24 heads, 8 kv heads (head dim 128),
intermediate 8192, vocab 128256; ``8b`` hidden 4096, 32 layers, 32 / 8 heads, intermediate 14336; ``tiny`` hidden 64,
2 layers, vocab 1000 (the CPU dry run of every path). bf16 with DeepSpeed's fp32 master weights, ZeRO-3, AdamW on the
GPU (``--offload-optimizer``: its state in host memory), one sequence of S random tokens per step, world size 1
(``sequence_parallel_size: 1``: every piece of the step but the collectives). Systems (``--systems``, from
:data:`SYSTEMS`):

* ``ds-usp``: ``"sequence_parallel": "usp"`` and nothing else (memory features "auto": the fastest that fit the
  GPU's memory, as the cost model prices them); ``ds-usp budget``: the same with ``usp.memory_gib`` =
  ``--memory-gib`` (only this system gets it: its planner prediction and its budget row use it);
* ``ds-usp off``: every memory feature false (only the attention path); ``ds-usp offload`` / ``ds-usp no offload``:
  "auto" with ``offload_activations`` true / false (what offloading the checkpointed inputs saves and costs);
  ``ds-usp torch attention``: "auto"'s memory features with ``usp.attn_backend = "torch"`` (cuDNN's op for long
  calls, PyTorch's otherwise: "auto"'s attention before FlashAttention-4, which nothing else keeps out of "auto");
* the peers (issue 65's :data:`PEERS`, each with HF's ``sdpa`` attention, as their users run them): ``HF plain``
  (HF + DeepSpeed, HF's loss over the whole logits, no memory feature); ``ALST tiled loss`` (DeepSpeed's
  ``TiledFusedLogitsLoss`` alone); ``ALST full`` (DeepSpeed's pieces as its ALST tutorial and ArcticTraining's SFT
  trainer wire them at sequence parallel 1: ``TiledMLP`` with ``ceil(S / hidden)`` shards, ``TiledFusedLogitsLoss``
  with 1/8 GiB fp32 logits tiles, the decoder called as ``model.model``, and HF gradient checkpointing); ``ALST full
  offload`` (the same with each checkpointed layer input in host memory, DeepSpeed's
  ``CheckpointHiddenStatesOffload``, DeepSpeed >= 0.19.8); ``Liger`` (Liger-Kernel's fused linear cross-entropy and
  HF gradient checkpointing: LLaMA-Factory's and axolotl's recipe); ``Liger all`` (also Liger's RoPE, RMSNorm and
  SwiGLU kernels; GPU only: they do not run under Triton's CPU interpreter).

Per (system, S): every step timed (``--steps``, one from ``--one-step-from`` on; each step's seconds in
``step_times_s``; the median is over the steps after the first, and their spread is ``(slowest - fastest) /
fastest``; ``spread_2_4`` is the same over steps 2 to 4 alone, issue 49's measure, where at least 4 steps ran),
tokens/s, model TFLOP/s and MFU, and per step ``torch.cuda.max_memory_allocated`` (``peak_GiB``: weights, optimizer
state and activations), ``torch.cuda.max_memory_reserved`` (``reserved_GiB``: what the caching allocator holds,
which a budget is judged on), the allocator's retries and the blocks it took from the device
(``device_allocs_per_step``), ds-usp's step choices (``choices``; ``choices_per_step`` where they changed between
steps), for ds-usp the attention backend its ``usp.attn_backend`` resolved to (``attn_backend``, e.g. ``"torch"`` or
``"auto(flash_attn_4 > torch)"``) and the local attention calls of a step by the kernel that ran them (``attn_calls``:
the last step's; ``attn_calls_per_step``; :func:`count_attention_calls`), and the planner's longest S before the run
(``predicted_longest_S``). Each system's sweep ends with a row saying why it stopped (``stopped``: ``out of memory``,
``the time budget``, ``the list's end``, or ``failed`` / ``stopped from outside``), tagged like its other rows with
the sweep's id (``sweep``). At each S of ``--profile-seqs`` one more step runs under ``torch.profiler`` after the
timed ones (``--profile-step K``: the K-th of them instead, left out of the median and the spreads): its operators
by device time, the kernels launched, the device's busy time against the step's wall time (``--trace-dir``: the
chrome trace too, ``SYSTEM_S_stepN.json.gz``); ``profiled_step`` says which step it was. FLOPs of a step (MFU
convention, recomputation not counted): ``6 N S`` with ``N`` the parameters that multiply (all but the input
embedding) plus causal attention ``6 L H d S^2`` (QK^T and PV, forward and backward, half the square). MFU divides
by ``--peak-tflops`` (default: the bf16 dense peak of the device's name).

The closing report (also over the rows of ``--prior-json`` files of the same shape, merged with this run's: a system
run again replaces its earlier rows; ``--report`` runs nothing): issue 49's targets (ds-usp against ALST full at
each S, the spread of steps, MFU at 128K) and issue 65's: ds-usp "auto" against the fastest peer configuration at
each S (>= 1.2x; where a peer configuration has no row at that S, the report names it, with why where its sweep
recorded a stop, and the ratio is to the fastest of those run), with the attention kernels ds-usp ran; ds-usp's
longest S against the longest any peer trains (>= 1.5x) and its tokens/s against the fastest peer at the peers'
longest S (>= 1.3x); the planner's prediction of ds-usp's longest S (within 10%); MFU at 128K on the 3B shape (>=
45%); ``ds-usp budget``'s reserved peak under ``usp.memory_gib``. A longest-S verdict is
given only where the sweeps' ``stopped`` rows establish it (a longest S is known only where its sweep ran out of
memory), else it says "not established (stopped by ...)".

``--attention``: no training; ds-usp's local attention kernel (PyTorch's flash SDPA ops) against the cuDNN SDPA op
with its log-sum-exp, forward and backward, causal, at the shape's heads for each S of ``--seqs``: milliseconds,
TFLOP/s and the largest difference of the outputs and log-sum-exps (skipped, saying why, where the op or CUDA is
missing).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from _common import base_parser, comma_list, result_path, save_results, start_ranks, table, world_of_one
from long_seq import alst_full, alst_tiled_loss

TAG = "[gpu_train]"
SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=128256),  # Llama-3.2 3B, hd 128
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1000),  # a CPU smoke run
}
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # bf16 dense, the vendors' data sheets
TARGET_VS_ALST = 1.3  # issue 49: ds-usp "auto" at least 1.3x ALST full's tokens/s at every S
TARGET_SPREAD = 0.05  # steps 2 to 4 within 5% of each other
TARGET_MFU_128K = 0.30
TARGET_VS_BEST_PEER = 1.2  # issue 65: "auto" against the fastest peer configuration that ran, at every S
TARGET_LONGEST = 1.5  # issue 65: ds-usp's longest S against the longest any peer configuration trains
TARGET_AT_PEER_LONGEST = 1.3  # and its tokens/s at that S
TARGET_MFU_3B_128K = 0.45
PEERS = ("HF plain", "ALST tiled loss", "ALST full", "ALST full offload", "Liger", "Liger all")  # issue 65's peers
# why a system's sweep of S stopped (its last row's "stopped"): only running out of memory establishes its longest S
STOP_OOM, STOP_BUDGET, STOP_END = "out of memory", "the time budget", "the list's end"
STOP_OUTSIDE = "stopped from outside"
Step = Callable[[], float]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = base_parser(__doc__)
    p.add_argument("--shape", choices=list(SHAPES), default="1b")
    p.add_argument("--systems", type=comma_list(str), default=["ds-usp", "ds-usp off", "ALST full"],
                   help=f"comma-separated, run in this order, from: {', '.join(SYSTEMS)} (default: ds-usp,ds-usp off,"
                   "ALST full)")
    p.add_argument("--start", type=int, default=16384, help="first S")
    p.add_argument("--max-seq", type=int, default=1 << 20, help="last S tried")
    p.add_argument("--steps", type=int, default=3, help="steps per S, each timed (the median: after the first)")
    p.add_argument("--one-step-from", type=int, default=262144, help="from this S on, one (timed) step per S")
    p.add_argument("--budget", type=float, default=240.0, help="seconds a system may spend on its steps")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 dense peak (MFU)")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-3 optimizer state in host memory")
    p.add_argument("--growth", type=float, default=2.0, help="each next S is this many times the last (a multiple "
                   "of 1024): 2 doubles; a smaller factor finds the longest S more closely")
    p.add_argument("--memory-gib", type=float, default=None, help="usp.memory_gib of 'ds-usp budget' alone (its "
                   "planner prediction too; its reserved peak must stay under it)")
    p.add_argument("--prior-json", type=comma_list(str), default=[],
                   help="comma-separated result files of earlier runs of this script (bare names: in "
                        "benchmarks/results/): their rows of the same --shape are reported with this run's (a later "
                        "file's row replaces one of the same system and S; a system run now replaces its rows)")
    p.add_argument("--report", action="store_true", help="run no system: report the rows of --prior-json")
    p.add_argument("--profile", action="store_true", help="--profile-seqs at the first S")
    p.add_argument("--profile-seqs", type=comma_list(int), default=[],
                   help="after the timed steps at each of these S, one more step under torch.profiler: its kernels "
                        "by device time, launches and the device's busy share go into the row ('profile')")
    p.add_argument("--profile-step", type=int, default=0,
                   help="K >= 1: at each S of --profile-seqs the K-th of the --steps steps runs under torch.profiler "
                        "instead (its time stays in step_times_s, marked by 'profiled_step', and the median and the "
                        "spreads leave it out); 0 (default): one more step after the timed ones")
    p.add_argument("--trace-dir", default="", help="also write each profiled step's chrome trace here (gzipped)")
    p.add_argument("--attention", action="store_true",
                   help="no training: ds-usp's flash SDPA against cuDNN's (with log-sum-exp) at each of --seqs")
    p.add_argument("--seqs", type=comma_list(int), default=[16384, 32768, 65536, 131072],
                   help="the lengths of --attention")
    p.add_argument("--iters", type=int, default=3, help="timed iterations of --attention (after one warm-up)")
    p.add_argument("--plot", default="", help="write a plot of tokens/s and peak memory against S here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "system|rows file"
    args = p.parse_args(argv)
    unknown = [name for name in args.systems if name not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(SYSTEMS)}")
    if args.steps < 1 or args.iters < 1:
        p.error("--steps and --iters must be at least 1")
    if not 0 <= args.profile_step <= args.steps:
        p.error(f"--profile-step must be 0 (one more step after the timed ones) or one of the {args.steps} --steps")
    if args.growth <= 1.0:
        p.error("--growth must be above 1")
    if args.report:
        if not args.prior_json:
            p.error("--report needs --prior-json")
        args.systems = []
    if "ds-usp budget" in args.systems and not args.memory_gib:
        p.error("--systems 'ds-usp budget' needs --memory-gib")
    if args.profile and args.start not in args.profile_seqs:
        args.profile_seqs = [*args.profile_seqs, args.start]
    return args


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


def llama_config(shape: dict) -> Any:
    """The HF config of ``shape`` (Llama-3: rope theta 500000, untied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], max_position_embeddings=1 << 23, rope_theta=500000.0,
                       tie_word_embeddings=False, use_cache=False)


def build_model(shape: dict, attn: str) -> Any:
    """Random Llama-3-shaped weights, the same for every system (seeded, made on the GPU in bf16)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        return AutoModelForCausalLM.from_config(llama_config(shape), attn_implementation=attn, dtype=torch.bfloat16)


def predicted_longest(name: str, shape: dict, args: argparse.Namespace) -> Optional[int]:
    """The planner's longest S for the ds-usp system ``name`` ("auto") on this device before the run (``python -m
    ds_usp.plan``'s ``largest_fitting_seq``: one GPU, ZeRO-3, bf16, the GPU's memory, or ``--memory-gib`` for ``ds-usp
    budget`` alone, as its ``usp`` block has it; this host's available memory for offloaded layer inputs; to 1%)."""
    from ds_usp.cost import Hardware
    from ds_usp.integration.models.shape import model_shape
    from ds_usp.integration.step.choices import host_memory_per_rank
    from ds_usp.plan import largest_fitting_seq

    memory = (args.memory_gib if name == "ds-usp budget" else
              torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if CUDA else 80.0)
    host = host_memory_per_rank() / 2 ** 30  # offloaded layer inputs must fit this host (what "auto" reads too)
    hw = Hardware(nodes=1, gpus_per_node=1, gpu_mem_gib=memory, host_mem_gib=host)
    return largest_fitting_seq(model_shape(llama_config(shape)), hw, 1 << 23, zero=3, presets=("auto",),
                               offload=args.offload_optimizer)


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
    usp = dict(USP_SETTINGS[name], **({"memory_gib": args.memory_gib} if name == "ds-usp budget" else {}))
    model = build_model(shape, "usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(),
                                   config=dict(ds_config(args), sequence_parallel="usp", usp=usp))
    count_attention_calls(name, usp.get("attn_backend", "auto"), torch.device(engine.device))

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


def hf_system(name: str, shape: dict, args: argparse.Namespace) -> tuple[Any, Callable[[int], Step]]:
    """HF + DeepSpeed as its users run it: ``HF plain`` (sdpa, HF's loss on the whole logits, no memory feature);
    ``Liger``: Liger-Kernel's fused linear cross-entropy (no logits) and HF gradient checkpointing; ``Liger all``:
    also its RoPE, RMSNorm and SwiGLU kernels (Liger's defaults: what LLaMA-Factory's ``enable_liger_kernel`` and
    axolotl's Liger plugin apply; GPU only: those kernels do not run under Triton's CPU interpreter). Liger's loss
    reads ``lm_head.weight`` without calling ``lm_head``, so under ZeRO-3 the weight is registered as an external
    parameter of the model (DeepSpeed's way: gathered for the model's forward, its gradient reduced)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo")
    model = build_model(shape, "sdpa")
    liger = name.startswith("Liger")
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        every = name == "Liger all"
        apply_liger_kernel_to_llama(model=model, rope=every, rms_norm=every, swiglu=every,
                                    fused_linear_cross_entropy=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    if liger:
        deepspeed.zero.register_external_parameter(engine.module, engine.module.lm_head.weight)

    def at(seq: int) -> Step:
        ids = tokens(shape, seq).to(engine.device)

        def step() -> float:
            loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            return float(loss)
        return step

    return engine, at


def alst_system(name: str, shape: dict, args: argparse.Namespace) -> tuple[Any, Callable[[int], Step]]:
    """DeepSpeed's TiledMLP, TiledFusedLogitsLoss and HF checkpointing, as ALST's tutorial wires them; ``ALST full
    offload``: with DeepSpeed's checkpoint offload of each layer's input around the forward and backward; ``ALST
    tiled loss``: the tiled loss alone (no TiledMLP, no checkpointing: the fastest ALST setting where it fits)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo")
    model = build_model(shape, "sdpa")
    if name != "ALST tiled loss":
        alst_full(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    module = engine.module
    offload = None
    if name == "ALST full offload":  # one context for every step: its pinned host buffers are pooled across steps
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            get_checkpoint_hidden_states_offloading_ctx_manager)

        offload = get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory=CUDA, use_streams=CUDA)

    def at(seq: int) -> Step:
        ids = tokens(shape, seq)
        batch = {"input_ids": ids.to(engine.device), "position_ids": torch.arange(seq, device=engine.device)[None]}
        shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1).to(engine.device)

        def step() -> float:
            with offload if offload is not None else contextlib.nullcontext():
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
                "ds-usp no offload": {"offload_activations": False},
                "ds-usp budget": {},  # usp.memory_gib: --memory-gib
                "ds-usp torch attention": {"attn_backend": "torch"}}  # "auto"'s memory, FA4 kept out of attention
SYSTEMS = {**{name: usp_system for name in USP_SETTINGS}, "ALST full": alst_system, "ALST full offload": alst_system,
           "ALST tiled loss": alst_system, "HF plain": hf_system, "Liger": hf_system, "Liger all": hf_system}


# ---------------------------------------------------------------------------------------- worker


def run_worker(args: argparse.Namespace) -> None:
    """One system: S doubling in one process; a JSON line per S (a crash or timeout keeps the lines so far)."""
    name, path = args.worker.split("|")
    shape = SHAPES[args.shape]
    world_of_one()
    if CUDA:
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    predicted = predicted_longest(name, shape, args) if name.startswith("ds-usp") else None
    if predicted:
        print(f"{TAG} {name}: the planner predicts the longest S at {predicted} before the run", flush=True)
    engine, at = SYSTEMS[name](name, shape, args)
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    out = open(path, "a")
    sweep = f"{name}@{os.getpid()}-{time.time_ns() // 10 ** 6}"  # this sweep's rows and its stop row share it
    print(f"{TAG} {name}: built in {time.perf_counter() - t0:.0f} s, {params / 1e9:.3f} B parameters", flush=True)
    t0 = time.perf_counter()  # --budget counts the steps
    seq, last, stop = args.start, None, None
    while seq <= args.max_seq:
        steps = 1 if seq >= args.one_step_from else args.steps
        if last is not None:  # attention grows as S^2: the next length costs up to growth^2 x
            expected = args.growth ** 2 * last * steps
            if time.perf_counter() - t0 + expected > args.budget:
                stop = {"system": name, "S": seq, "stopped": STOP_BUDGET, "note": f"not run: ~{expected:.0f} s would "
                        f"pass --budget {args.budget:.0f} s"}
                break
        step = at(seq)
        stats, losses, error, row, profiled = [], [], None, {}, None
        for i in range(steps):
            inside = seq in args.profile_seqs and args.profile_step == i + 1  # --profile-step: this one profiled
            retries, mallocs = _alloc_retries(), _device_allocs()
            ATTENTION_CALLS.clear()
            if CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            w0 = time.perf_counter()
            try:
                if inside:
                    profile, loss = profile_step(step, name, seq, args.trace_dir, i + 1)
                else:
                    loss = step()
                losses.append(loss)
            except torch.OutOfMemoryError as e:
                error = "out of memory: " + str(e).split("\n")[0][:160]
                break
            if CUDA:
                torch.cuda.synchronize()
            if inside:
                profiled = i
            # the caching allocator per step: what it held, how often it had to free its cache and retry, and how
            # many blocks it took from the device (cudaMalloc: a step slower than the one before with the same work
            # points there), "auto"'s choices and the attention kernels each call ran (a step that differs shows it)
            stats.append((time.perf_counter() - w0, torch.cuda.max_memory_allocated() / 2 ** 30 if CUDA else 0.0,
                          torch.cuda.max_memory_reserved() / 2 ** 30 if CUDA else 0.0, _alloc_retries() - retries,
                          _device_allocs() - mallocs, _choices(engine), _attention_calls(name)))
            row = dict(_row(name, seq, stats, losses[0], params, shape, args, engine, profiled),
                       predicted_longest_S=predicted, budget_GiB=args.memory_gib if name == "ds-usp budget" else None,
                       sweep=sweep)
            if profiled is not None:
                row["profile"] = profile
            out.write(json.dumps(row) + "\n")  # after every step: a run stopped from outside keeps its steps
            out.flush()
        if error:  # the row of this S (its steps before the error, if any) says the sweep stopped here
            stop = dict(row, system=name, S=seq, stopped=STOP_OOM, note=error)
            break
        if seq in args.profile_seqs and not args.profile_step:
            row["profile"], _ = profile_step(step, name, seq, args.trace_dir, len(stats) + 1)
            row["profiled_step"] = len(stats) + 1  # one step more, after the timed ones
            out.write(json.dumps(row) + "\n")
            out.flush()
        if row.get("profile"):
            print(f"{TAG} {name} S={seq}, step {row['profiled_step']} under torch.profiler: "
                  f"{row['profile']['summary']}\n{row['profile']['table']}", flush=True)
        last = row["step_s"]
        print(f"{TAG} {name} S={seq}: {last:.2f} s/step (steps {', '.join(f'{t:.2f}' for t in row['step_times_s'])}"
              + (f"; step {row['profiled_step']} profiled" if row.get("profiled_step") else "")
              + (f"; steps 2-4 within {row['spread_2_4']:.1%}" if row.get("spread_2_4") is not None else "")
              + f"), {row['tokens_per_s']:.0f} tokens/s, {row['tflops']:.0f} TFLOP/s (MFU {row['mfu']:.1%}), peak "
              f"{row['peak_GiB']:.1f} GiB, reserved {row['reserved_GiB']:.1f} GiB, {row['alloc_retries']} allocator "
              f"retries, device allocations per step {row['device_allocs_per_step']}"
              + (f"; attention {_attention_text(row)}" if row.get("attn_backend") else ""), flush=True)
        seq = next_seq(seq, args.growth)
    out.write(json.dumps(dict(stop or {"system": name, "S": seq, "stopped": STOP_END,
                                       "note": f"not run: past --max-seq {args.max_seq}"}, sweep=sweep)) + "\n")
    out.close()


def next_seq(seq: int, growth: float) -> int:
    """The next length tried: ``seq * growth`` rounded to a multiple of 1024, at least 1024 more (tiny shapes:
    doubled)."""
    if seq < 1024:
        return seq * 2
    return max(seq + 1024, round(seq * growth / 1024) * 1024)


def _row(name: str, seq: int, stats: list[tuple], loss: float, params: int, shape: dict, args: argparse.Namespace,
         engine: Any, profiled: Optional[int] = None) -> dict:
    """One (system, S) row from its steps so far: ``(seconds, peak GiB, reserved GiB, allocator retries, device
    allocations, "auto"'s choices, attention calls by kernel)`` each; ``profiled``: the index of a step that ran under
    torch.profiler (``--profile-step``), kept in ``step_times_s`` but left out of the median and the spreads.
    ``spread`` is over the steps after the first, ``spread_2_4`` over steps 2 to 4 alone (issue 49's measure: the
    slowest over the fastest, less 1; None with fewer than 4 steps or one of them profiled)."""
    times, peaks, reserved, retries, mallocs, choices, calls = (list(x) for x in zip(*stats))
    plain = [t for i, t in enumerate(times) if i != profiled]
    timed = plain[1:] or plain or times
    step_s = statistics.median(timed)
    tflops = flops_per_step(shape, params, seq) / step_s / 1e12
    steps_2_4 = times[1:4] if len(times) >= 4 and profiled not in (1, 2, 3) else None
    last = max((i for i in range(len(times)) if i != profiled), default=len(times) - 1)  # the last unprofiled step
    return {"system": name, "S": seq, "step_s": step_s, "steps_timed": len(timed), "first_step_s": times[0],
            "spread": (max(timed) - min(timed)) / min(timed),
            "spread_2_4": max(steps_2_4) / min(steps_2_4) - 1 if steps_2_4 else None,
            "profiled_step": None if profiled is None else profiled + 1, "peak_GiB": max(peaks), "loss": loss,
            "params": params, "reserved_GiB": max(reserved), "alloc_retries": sum(retries), "step_times_s": times,
            "peak_GiB_per_step": peaks, "reserved_GiB_per_step": reserved, "alloc_retries_per_step": retries,
            "device_allocs_per_step": mallocs, "choices": choices[-1],
            "choices_per_step": choices if len(set(choices)) > 1 else None,
            "attn_backend": _attention_backend(name), "attn_calls": calls[last], "attn_calls_per_step": calls,
            "tflops": tflops, "mfu": tflops / peak_tflops(args), "tokens_per_s": seq / step_s, "device": DEVICE}


def profile_step(step: Step, name: str, seq: int, trace_dir: str = "", number: int = 0) -> tuple[dict, float]:
    """One step (the ``number``-th at this S) under torch.profiler, and its loss: the operators by device time (CPU
    time without CUDA), and a summary: the step's wall time under the profiler, the kernels launched and their summed
    device time (its share of the wall time: how busy the host kept the device), the aten ops dispatched."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    w0 = time.perf_counter()
    with profile(activities=activities) as prof:
        loss = step()
        if CUDA:
            torch.cuda.synchronize()
    wall = time.perf_counter() - w0
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels) / 1e6
    summary = {"step": number, "wall_s": wall, "kernels": len(kernels), "kernel_s": busy,
               "busy_share": busy / wall if CUDA else None,
               "aten_ops": sum(1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")),
               "launches": sum(1 for e in events if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC"))}
    key = "self_device_time_total" if CUDA else "self_cpu_time_total"
    try:
        text = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
    except (AttributeError, KeyError, ValueError):  # an older torch names the column after CUDA
        text = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60)
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        raw = Path(trace_dir) / f"{name.replace(' ', '_')}_{seq}_step{number}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
        summary["trace"] = f"{raw}.gz"
    return {"summary": summary, "table": text}, loss


def _alloc_retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if CUDA else 0


def _device_allocs() -> int:
    """The blocks the caching allocator has taken from the device so far (cudaMalloc calls; 0 without CUDA)."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if CUDA else 0


# ds-usp's local attention calls of the step running, by the kernel that ran them (count_attention_calls), and the
# backend each ds-usp system's usp.attn_backend resolved to
ATTENTION_CALLS: collections.Counter = collections.Counter()
ATTENTION_BACKEND: dict[str, str] = {}


def count_attention_calls(name: str, setting: str, device: torch.device) -> None:
    """Record which attention kernels the ds-usp system ``name`` runs (every ds-usp row carries them).

    ``attn_backend``: what its ``usp.attn_backend`` (``setting``) resolves to on ``device`` in bf16
    (:func:`ds_usp.kernels.get_backend`, as the ring resolves it): ``"torch"``, or ``"auto(flash_attn_4 > torch)"``
    where FlashAttention-4 is installed and usable there. The name lists what "auto" may take; which kernel ran is
    decided per call, so each step also counts its local attention calls (forward and backward, a checkpointed
    layer's recomputation included) by kernel into :data:`ATTENTION_CALLS`: ``flash_attn_4`` (or another
    ``ds_usp.kernels.AUTO_ORDER`` candidate) where "auto"'s per-call choice took it, else the torch backend's kernel:
    ``cudnn`` (cuDNN's op), ``sdpa_flash`` / ``sdpa_efficient`` (PyTorch's FlashAttention-2 or memory-efficient op:
    calls under 16K x 16K query-key pairs, ``DS_USP_CUDNN_ATTENTION=0``, or cuDNN not agreeing on the device),
    ``cpu`` (the CPU op). Counted by wrapping ds_usp's functions that make those choices (``kernels._auto_kernels``,
    ``torch_sdpa._cuda_use_cudnn``, ``_cpu_forward`` / ``_cpu_backward``) in this worker process only; ds_usp itself
    is not changed. FA4's once-per-kind device check (``flash_attn4.disagreement``, whose reference runs on the torch
    backend) is not counted. Where those functions have moved, nothing is counted (the rows' ``attn_calls`` stay
    empty) and the worker says so. There is no switch that keeps FA4 out of "auto" (``DS_USP_CUDNN_ATTENTION=0`` is
    cuDNN's); the system ``ds-usp torch attention`` names ``usp.attn_backend = "torch"`` (cuDNN's op and PyTorch's,
    as before FA4)."""
    from ds_usp import kernels

    ATTENTION_BACKEND[name] = kernels.get_backend(setting, device, torch.bfloat16).name
    if ATTENTION_BACKEND.get(""):  # wrapped once per process
        return
    from ds_usp.kernels import flash_attn4, torch_sdpa

    try:
        auto, use_cudnn, use_flash = kernels._auto_kernels, torch_sdpa._cuda_use_cudnn, torch_sdpa._cuda_use_flash
        cpu_forward, cpu_backward, check = torch_sdpa._cpu_forward, torch_sdpa._cpu_backward, flash_attn4.disagreement
    except AttributeError as e:
        print(f"{TAG} attention calls not counted: ds_usp has moved ({e})", flush=True)
        ATTENTION_BACKEND[""] = "not counted"
        return
    checking: list[int] = []

    def counted(kernel: str) -> None:
        if not checking:
            ATTENTION_CALLS[kernel] += 1

    def auto_kernels(fast: tuple, *a: Any, **kw: Any) -> tuple:
        forward, backward = auto(fast, *a, **kw)
        taken = next((c.name for c in fast if c.forward_fn is forward), None)
        if taken:  # else the torch backend's kernels, counted below
            counted(taken)
        return forward, backward

    def cuda_use_cudnn(q: torch.Tensor, *a: Any, **kw: Any) -> bool:
        use = use_cudnn(q, *a, **kw)
        counted("cudnn" if use else "sdpa_flash" if use_flash(q) else "sdpa_efficient")
        return use

    def on_cpu(fn: Callable) -> Callable:
        def run(*a: Any, **kw: Any) -> Any:
            counted("cpu")
            return fn(*a, **kw)
        return run

    def disagreement(*a: Any, **kw: Any) -> Any:
        checking.append(1)
        try:
            return check(*a, **kw)
        finally:
            checking.pop()

    disagreement.cache_clear = check.cache_clear  # type: ignore[attr-defined]
    kernels._auto_kernels, torch_sdpa._cuda_use_cudnn, flash_attn4.disagreement = auto_kernels, cuda_use_cudnn, \
        disagreement
    torch_sdpa._cpu_forward, torch_sdpa._cpu_backward = on_cpu(cpu_forward), on_cpu(cpu_backward)
    ATTENTION_BACKEND[""] = "counted"


def _attention_backend(name: str) -> Optional[str]:
    """What the ds-usp system ``name``'s ``usp.attn_backend`` resolved to (None for a peer)."""
    return ATTENTION_BACKEND.get(name) if name in USP_SETTINGS else None


def _attention_calls(name: str) -> Optional[dict]:
    """The attention calls of the step just run by kernel (None for a peer, or where they could not be counted)."""
    if name not in USP_SETTINGS or ATTENTION_BACKEND.get("") != "counted":
        return None
    return dict(sorted(ATTENTION_CALLS.items()))


def _attention_text(row: dict) -> str:
    """A row's attention backend and its last step's calls by kernel, for the report."""
    calls = row.get("attn_calls")
    return (f"{row.get('attn_backend') or 'not recorded'}"
            + (f" ({', '.join(f'{k} {n}' for k, n in calls.items())} calls in a step)" if calls else
               " (calls not counted)" if row.get("attn_backend") else ""))


def _choices(engine: Any) -> Optional[str]:
    """What ds-usp's "auto" memory features chose for the last step (None for a system without them)."""
    usp = getattr(engine, "usp", None)
    memory = getattr(usp, "memory", None)
    choices = getattr(memory, "choices", None)
    return None if choices is None else str(choices)


# ---------------------------------------------------------------------------------------- driver


def prior_rows(paths: Sequence[str], shape: str) -> tuple[list[dict], dict]:
    """The rows of earlier result files of this script (``--prior-json``) run on ``shape`` (another shape's file is
    skipped, saying so), merged: a later file's measured row replaces one of the same system and S; rows that
    measured nothing (a sweep's stop row) are kept per sweep. Returns the rows and each file's provenance."""
    merged: dict = {}
    sources = {}
    for path in paths:
        run = json.loads(result_path(path).read_text())
        theirs = (run.get("args") or {}).get("shape")
        if theirs and theirs != shape:
            print(f"{TAG} --prior-json {path}: shape {theirs}, not {shape}: skipped", flush=True)
            continue
        sources[path] = run.get("provenance")
        for r in run.get("rows", []):
            key = (r["system"], r["S"]) if r.get("step_s") else (r["system"], r["S"], r.get("sweep"), r.get("note"))
            merged[key] = r
    return list(merged.values()), sources


def sweep_stops(rows: list[dict]) -> dict[str, dict]:
    """Per system: its longest S that trained (a row with a timed step) and why the sweep that reached it stopped
    (``stopped`` of that sweep's last row: :data:`STOP_OOM`, :data:`STOP_BUDGET`, :data:`STOP_END`, failed or stopped
    from outside; "not recorded" for rows of a run before sweeps said why), with the S it stopped at (``at``). Where
    several sweeps reached the same longest S, one that ran out of memory decides (it establishes the S)."""
    out = {}
    for name in dict.fromkeys(r["system"] for r in rows):
        ran = [r for r in rows if r["system"] == name and r.get("step_s")]
        if not ran:
            continue
        longest = max(r["S"] for r in ran)
        sweeps = {r.get("sweep") for r in ran if r["S"] == longest} - {None}
        ends = [r for r in rows if r["system"] == name and r.get("stopped") and r.get("sweep") in sweeps]
        end = next((r for r in ends if r["stopped"] == STOP_OOM), ends[0] if ends else None)
        out[name] = {"S": longest, "stopped": end["stopped"] if end else "not recorded",
                     "at": end.get("S") if end else None}
    return out


def compare(rows: list[dict]) -> str:
    """Issue 49's targets: ds-usp against ALST full at equal S (tokens/s, target >= 1.3x), every system's steps after
    the first within 5% of each other, MFU at 128K >= 30%, and each system's longest S."""
    by = {(r["system"], r["S"]): r for r in rows if r.get("step_s")}
    lines = []
    for seq in sorted({s for _, s in by}):
        usp, alst = by.get(("ds-usp", seq)), by.get(("ALST full", seq))
        if usp and alst:
            ratio = usp["tokens_per_s"] / alst["tokens_per_s"]
            lines.append(f"S={seq}: ds-usp {ratio:.2f} x ALST full's tokens/s (target >= {TARGET_VS_ALST}: "
                         f"{'met' if ratio >= TARGET_VS_ALST else 'missed'}), peak {usp['peak_GiB']:.1f} / "
                         f"{alst['peak_GiB']:.1f} GiB, first losses {usp['loss']:.4f} / {alst['loss']:.4f}")
        for (name, _), r in sorted((k, v) for k, v in by.items() if k[1] == seq):
            if r["steps_timed"] > 1:
                lines.append(f"S={seq}: {name} steps after the first within {r['spread']:.1%} of each other (target "
                             f"<= {TARGET_SPREAD:.0%}: {_met(r['spread'] <= TARGET_SPREAD)}){_steps_text(r)}; "
                             f"{r['alloc_retries']} allocator retries, reserved up to {r['reserved_GiB']:.1f} GiB")
        if seq == 131072 and usp and usp["params"] < 2.5e9:  # issue 49's: the 1.5B shape
            lines.append(f"S={seq}: ds-usp MFU {_pct(usp['mfu'])} (target >= {TARGET_MFU_128K:.0%}: "
                         f"{_met(usp['mfu'] >= TARGET_MFU_128K) if usp['mfu'] else 'no peak known'})")
    stops = sweep_stops(rows)
    for name, stop in stops.items():
        top = by[(name, stop["S"])]
        lines.append(f"{name}: longest S {stop['S']} ({top['tokens_per_s']:.0f} tokens/s, MFU {_pct(top['mfu'])}, "
                     f"peak {top['peak_GiB']:.1f} GiB, reserved {top['reserved_GiB']:.1f} GiB); its sweep stopped by "
                     f"{stop['stopped']}" + (f" at S={stop['at']}" if stop["at"] else ""))
    lines += peer_lines(rows, by, stops)
    return "\n".join(f"{TAG} {line}" for line in lines)


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _steps_text(r: dict) -> str:
    """A row's steps 2 to 4 (issue 49's spread), each step's seconds, which one was profiled and how busy the device
    was in it, and the blocks the allocator took from the device per step where any step took some."""
    text, spread = "", _spread_2_4(r)
    if spread is not None:
        text += f", steps 2-4 within {spread:.1%} (target <= {TARGET_SPREAD:.0%}: {_met(spread <= TARGET_SPREAD)})"
    text += "; steps " + ", ".join(f"{t:.2f}" for t in r.get("step_times_s") or []) + " s"
    summary = (r.get("profile") or {}).get("summary") or {}
    if r.get("profiled_step"):
        busy = summary.get("busy_share")
        text += (f" (step {r['profiled_step']} under torch.profiler: {summary.get('wall_s', float('nan')):.2f} s"
                 + (f", the device busy {busy:.0%}" if busy is not None else "") + ")")
    if any(r.get("device_allocs_per_step") or []):
        text += f"; device allocations per step {r['device_allocs_per_step']}"
    return text


def _spread_2_4(r: dict) -> Optional[float]:
    """A row's ``spread_2_4``; for a row of a run before it was recorded, from its ``step_times_s``."""
    if "spread_2_4" in r:
        return r["spread_2_4"]
    times = r.get("step_times_s") or []
    return max(times[1:4]) / min(times[1:4]) - 1 if len(times) >= 4 else None


def _no_row(rows: list[dict], name: str, seq: int) -> str:
    """Why the system ``name`` has no measured row at ``seq``: its sweep stopped at or before it (the stop row's
    reason), or it was not run at that S (or not at all) in these rows."""
    if not any(r["system"] == name for r in rows):
        return "not run in these rows"
    stops = [r for r in rows if r["system"] == name and r.get("stopped") and r["S"] <= seq]
    if not stops:
        return "not run at this S"
    stop = max(stops, key=lambda r: r["S"])
    return (f"out of memory at S={stop['S']}" if stop["stopped"] == STOP_OOM else
            f"its sweep stopped at S={stop['S']}: {stop['stopped']}")


def _pct(x: Optional[float]) -> str:
    """A share as a percentage; "-" where none is known (an MFU without the device's peak, saved as null)."""
    return "-" if x is None or x != x else f"{x:.1%}"


def _established(stop: dict) -> bool:
    """Whether a system's longest S is known: its sweep ran out of memory at the next S."""
    return stop["stopped"] == STOP_OOM


def peer_lines(rows: list[dict], by: dict, stops: dict[str, dict]) -> list[str]:
    """Issue 65's targets: ds-usp "auto" against the fastest peer configuration that ran at each S (>= 1.2x; the
    configurations of :data:`PEERS` without a row there are named, with why where a sweep recorded it, and the ratio
    is then to the fastest of those run), the attention kernels ds-usp ran, its longest S against the longest any
    peer trains (>= 1.5x) and its tokens/s against the fastest peer at that S (>= 1.3x), the planner's prediction of
    its longest S (within 10%), MFU at 128K on the 3B shape (>= 45%), and a budget's reserved peak under it. A longest
    S counts only where its sweep stopped by running out of memory (:func:`sweep_stops`): a sweep stopped by the time
    budget, the list's end or from outside gives a lower bound, and a verdict it cannot establish is printed as "not
    established (stopped by ...)", never as met."""
    lines = []
    compared = any(r["system"] in PEERS for r in rows)  # a run of ds-usp alone names no missing peer
    for seq in sorted({s for _, s in by}):
        ran = [p for p in PEERS if (p, seq) in by]
        peers = [by[(p, seq)] for p in ran]
        usp = by.get(("ds-usp", seq))
        missing = [f"{p} ({_no_row(rows, p, seq)})" for p in PEERS if p not in ran]
        if peers and usp:
            best = max(peers, key=lambda r: r["tokens_per_s"])
            ratio = usp["tokens_per_s"] / best["tokens_per_s"]
            lines.append(f"S={seq}: ds-usp {ratio:.2f} x the fastest peer"
                         + (f" of those run ({', '.join(ran)})" if missing else "") + f", {best['system']} (target >= "
                         f"{TARGET_VS_BEST_PEER}: {_met(ratio >= TARGET_VS_BEST_PEER)}"
                         + (" against those run" if missing else "") + f"); auto chose: {usp['choices']}; "
                         f"attention: {_attention_text(usp)}")
        elif usp:
            lines.append((f"S={seq}: no peer configuration has a row: ds-usp's ratio not established; " if compared
                          else f"S={seq}: ds-usp ") + f"auto chose: {usp['choices']}; attention: {_attention_text(usp)}")
        elif peers:
            lines.append(f"S={seq}: no ds-usp row (peers run: {', '.join(ran)})")
        if missing and compared and (usp or peers):
            lines.append(f"S={seq}: peer configurations with no row: {'; '.join(missing)}")
        if seq == 131072 and usp and usp["params"] > 2.5e9:
            lines.append(f"S={seq}: ds-usp MFU {_pct(usp['mfu'])} on the 3B shape (target >= "
                         f"{TARGET_MFU_3B_128K:.0%}: " + (_met(usp['mfu'] >= TARGET_MFU_3B_128K) if usp['mfu'] else
                                                          "no peak known") + ")")
        budget = by.get(("ds-usp budget", seq))
        if budget and budget.get("budget_GiB"):
            measured = budget.get("device", "cuda") == "cuda"  # on CPU torch.cuda measures nothing
            kept = budget["reserved_GiB"] <= budget["budget_GiB"]
            lines.append(f"S={seq}: ds-usp budget reserved {budget['reserved_GiB']:.1f} GiB (allocated peak "
                         f"{budget['peak_GiB']:.1f}) of usp.memory_gib {budget['budget_GiB']:g}: "
                         + (("kept" if kept else "MISSED") if measured else "not measured (no CUDA device)"))
    peer_stops = {n: st for n, st in stops.items() if n in PEERS}
    if peer_stops and "ds-usp" in stops:
        usp = stops["ds-usp"]
        seq = max(st["S"] for st in peer_stops.values())
        tops = [n for n, st in peer_stops.items() if st["S"] == seq]
        fastest = max((by[(n, seq)] for n in tops), key=lambda r: r["tokens_per_s"])["system"]
        peers_known = all(_established(peer_stops[n]) for n in tops)
        # met needs the peers' longest established (ds-usp's measured S is a lower bound of its own), missed needs
        # ds-usp's established (the peers' measured S is a lower bound of theirs)
        ratio = usp["S"] / seq
        known = peers_known if ratio >= TARGET_LONGEST else _established(usp)
        why = "; ".join(f"{n} stopped by {st['stopped']}" for n, st in [("ds-usp", usp)] + [
            (n, peer_stops[n]) for n in tops] if not _established(st))
        short = ", ".join(f"{n} at {st['S']} ({st['stopped']})" for n, st in peer_stops.items()
                          if n not in tops and not _established(st))
        lines.append(f"longest S: ds-usp {usp['S']}, the peers' {seq} ({', '.join(tops)}): {ratio:.2f} x (target >= "
                     f"{TARGET_LONGEST}: " + (_met(ratio >= TARGET_LONGEST) if known else
                                                f"not established ({why})") + ")"
                     + (f"; peers not swept to their longest, taken as shorter (they hold more memory per token than "
                        f"ALST full offload): {short}" if short else ""))
        if ("ds-usp", seq) in by:
            at = by[("ds-usp", seq)]["tokens_per_s"] / by[(fastest, seq)]["tokens_per_s"]
            lines.append(f"at the peers' longest S={seq}: ds-usp {at:.2f} x the fastest peer there, {fastest} "
                         f"(target >= {TARGET_AT_PEER_LONGEST}: " + (
                             _met(at >= TARGET_AT_PEER_LONGEST) if peers_known else
                             "not established (" + "; ".join(f"{n} stopped by {peer_stops[n]['stopped']}" for n
                                                             in tops if not _established(peer_stops[n]))
                             + ": the peers' longest S is not known)") + ")")
        else:
            lines.append(f"at the peers' longest S={seq}: no ds-usp row at that S (target >= "
                         f"{TARGET_AT_PEER_LONGEST}: not established)")
    predicted = next((r.get("predicted_longest_S") for r in rows if r["system"] == "ds-usp"
                      and r.get("predicted_longest_S")), None)
    if predicted and "ds-usp" in stops:
        usp = stops["ds-usp"]
        off = usp["S"] / predicted - 1
        lines.append(f"ds-usp's longest S {usp['S']} against the planner's {predicted} before the run: {off:+.1%} "
                     + (f"(target within 10%: {_met(abs(off) <= 0.1)})" if _established(usp) else
                        f"(target within 10%: not established (stopped by {usp['stopped']}))"))
    return lines


# ---------------------------------------------------------------------------------------- attention kernels


def attention_rows(args: argparse.Namespace, save: Callable[[list[dict]], Any]) -> list[dict]:
    """``--attention``: ds-usp's flash SDPA against cuDNN's, forward and backward with the log-sum-exp, causal, bf16,
    at the 1B shape's heads, one row per S and backend (see the module docstring); ``save`` gets the rows after each
    S."""
    shape = SHAPES[args.shape]
    heads, kv, d = shape["heads"], shape["kv_heads"], shape["hidden"] // shape["heads"]
    cudnn = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
    why = ("no CUDA device (--shape tiny runs the code on CPU, to check it)" if not CUDA and args.shape != "tiny" else
           "this torch has no aten._scaled_dot_product_cudnn_attention" if cudnn is None else None)
    if why:
        print(f"{TAG} --attention: {why}; nothing measured", flush=True)
        return [{"system": "attention", "S": None, "note": why}]
    from ds_usp.kernels.torch_sdpa import attention_backward, attention_forward

    rows, dtype = [], torch.bfloat16 if CUDA else torch.float32
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    for seq in args.seqs:
        g = torch.Generator(device=DEVICE).manual_seed(seq)
        q, k, v, dout = (torch.randn(1, seq, h, d, device=DEVICE, dtype=dtype, generator=g)
                         for h in (heads, kv, kv, heads))  # bshd
        scale = d ** -0.5
        flops = 4.0 * seq * seq * heads * d / 2  # causal forward: QK^T and PV over half the square

        def flash() -> tuple:
            out, lse = attention_forward(q, k, v, True, scale)
            return (out, lse), lambda: attention_backward(dout, q, k, v, out, lse, True, scale)

        def cudnn_op(expand: bool) -> Callable[[], tuple]:
            rep = heads // kv if expand else 1  # GQA by repeating the kv heads, where the op wants them equal
            qh, kh, vh = (x.transpose(1, 2).detach().requires_grad_() for x in (
                q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))  # bshd -> bhsd
            dh = dout.transpose(1, 2)

            def run() -> tuple:  # the op's backward through autograd (its attn_bias argument takes no None)
                for x in (qh, kh, vh):
                    x.grad = None
                out, lse, *_ = cudnn(qh, kh, vh, None, True, 0.0, True, False, scale=scale)
                return (out.detach().transpose(1, 2), lse.detach().reshape(1, heads, seq)), lambda: out.backward(dh)
            return run

        reference = None
        for backend, run in (("flash", flash), ("cudnn", cudnn_op(False)), ("cudnn, kv heads repeated",
                                                                             cudnn_op(True))):
            row = {"system": f"attention: {backend}", "S": seq, "heads": heads, "kv_heads": kv, "head_dim": d}
            try:
                times = {"forward_ms": [], "backward_ms": []}
                for i in range(args.iters + 1):
                    sync()
                    w0 = time.perf_counter()
                    outs, backward = run()
                    sync()
                    w1 = time.perf_counter()
                    backward()
                    sync()
                    if i:  # the first is a warm-up
                        times["forward_ms"].append((w1 - w0) * 1e3)
                        times["backward_ms"].append((time.perf_counter() - w1) * 1e3)
            except (RuntimeError, TypeError, ValueError) as e:  # e.g. the op refuses GQA, or this device
                rows.append(dict(row, note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
                continue
            fwd, bwd = (statistics.median(times[key]) for key in ("forward_ms", "backward_ms"))
            row.update(forward_ms=fwd, backward_ms=bwd, forward_tflops=flops / fwd / 1e9,
                       backward_tflops=2.5 * flops / bwd / 1e9)
            if reference is None:
                reference = outs
            else:
                row["max_out_diff"] = float((outs[0].float() - reference[0].float()).abs().max())
                row["max_lse_diff"] = float((outs[1].float() - reference[1].float()).abs().max())
            rows.append(row)
            print(f"{TAG} S={seq} {backend}: forward {fwd:.1f} ms, backward {bwd:.1f} ms", flush=True)
        save(rows)
    return rows


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
    if args.attention:
        args.json = args.json or time.strftime("gpu_attention-%Y%m%d-%H%M%S.json", time.gmtime())
        rows = attention_rows(args, lambda done: save_results(args.json, vars(args), done))
        print(table(rows, ["system", "S", "forward_ms", "backward_ms", "forward_tflops", "backward_tflops",
                           "max_out_diff", "max_lse_diff", "note"], {"forward_ms": ".1f", "backward_ms": ".1f",
                                                                      "forward_tflops": ".0f", "backward_tflops": ".0f",
                                                                      "max_out_diff": ".2e", "max_lse_diff": ".2e"}))
        print(f"{TAG} results written to {save_results(args.json, vars(args), rows)}")
        return 0
    if not CUDA and args.shape != "tiny" and not args.report:
        raise SystemExit(f"{TAG} needs a CUDA GPU (--shape tiny runs on CPU, to check the script)")
    prior, sources = prior_rows(args.prior_json, args.shape)
    rows = [r for r in prior if r["system"] not in args.systems]  # a system run again replaces its earlier rows
    meta = dict(vars(args), sources=sources)  # where the merged rows come from
    args.json = args.json or time.strftime("gpu_train-%Y%m%d-%H%M%S.json", time.gmtime())  # one file, saved often
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{TAG} stopped (SIGTERM): the rows so far are saved"))
    for name in args.systems:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_train_{os.getpid()}_{name.replace(' ', '_')}.jsonl"
        path.unlink(missing_ok=True)
        print(f"{TAG} {name}: running", flush=True)
        failed: Any = [f"{STOP_OUTSIDE} (e.g. a session step's time limit) while {name} ran"]
        try:
            proc = start_ranks(__file__, [*argv, "--worker", f"{name}|{path}"], timeout=args.budget + 300,
                               capture="stderr", echo=False)  # one process: a world of one (world_of_one)
            failed = proc.returncode != 0 and ([ln for ln in proc.stderr.splitlines() if "Error" in ln][-1:]
                                               or [f"exit status {proc.returncode}"])
        except subprocess.TimeoutExpired:
            failed = [f"timed out after {args.budget + 300:.0f} s"]
        finally:  # the worker's lines so far, also when this process is stopped: a run cut short keeps them
            lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            got = list({(r["system"], r["S"]): r for r in lines}.values())  # a row per S: its last line
            if failed and not any(r.get("stopped") for r in got):  # the sweep ended without saying why: this is why
                why, ran = (failed or ["failed"])[0][:300], [r["S"] for r in got if r.get("step_s")]
                got.append({"system": name, "S": next_seq(max(ran), args.growth) if ran else args.start,
                            "stopped": why if why.startswith(STOP_OUTSIDE) else f"failed: {why}", "note": why,
                            "sweep": next((r["sweep"] for r in got if r.get("sweep")), None)})
            rows += got
            save_results(args.json, meta, rows)
    print(table(rows, ["system", "S", "step_s", "spread", "spread_2_4", "tokens_per_s", "tflops", "mfu", "peak_GiB",
                       "reserved_GiB", "alloc_retries", "loss", "attn_backend", "note"],
                {"step_s": ".2f", "spread": ".3f", "spread_2_4": ".3f", "tokens_per_s": ".0f", "tflops": ".0f",
                 "mfu": ".3f", "peak_GiB": ".1f", "reserved_GiB": ".1f", "loss": ".4f"}, markdown=True))
    print(compare(rows))
    print(f"{TAG} results written to {save_results(args.json, meta, rows)}")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
