"""Training benchmark (issue 5): a tiny HF Llama trained with ds-usp's U x R splits vs DeepSpeed-Ulysses.

Run (4 CPU ranks over gloo; NCCL when CUDA is available):

    deepspeed --num_gpus 4 benchmarks/train.py --seq 8192 --steps 5 --warmup 1 --zero 2 --kv-heads 2

One launch measures, on the same model config, the same initial weights and the same data:

* ``ds-usp UxR`` for every split U x R of the ranks: ``ds_usp.initialize`` with
  ``attn_implementation="usp"``, batches sharded by ``ds_usp.shard_batch``, loss
  ``ds_usp.sp_cross_entropy`` (logged with ``ds_usp.sp_loss_value``);
* ``DeepSpeed-Ulysses``: DeepSpeed's own HF path, ``UlyssesSPAttentionHF.register_with_transformers``
  (sdpa core attention, its ``mpu`` passed to ``deepspeed.initialize``), batches from
  ``UlyssesSPDataLoaderAdapter`` and the loss aggregated over the SP group the way DeepSpeed's tests
  do it (per-rank mean of ``model.loss_function`` weighted by the rank's label count through a
  differentiable all-gather). When DeepSpeed refuses the model (head counts vs. SP size) its own
  error is printed as the reason the row is skipped.

Every method runs in fresh processes: each launched rank (the "driver") starts one worker process
per method, and the 4 workers of a method form their own process group on a fresh port. So each
method's peak memory is that of a process that ran only this method (``ru_maxrss`` of the worker),
and DeepSpeed's process-global state (its registered attention, sequence-parallel groups, mpu)
cannot leak from one method into another.

Per step: forward, loss, backward and optimizer step, after a barrier; wall time and the process
CPU time (``time.process_time``: the compute thread plus gloo's threads) per rank. A step's time is
its slowest rank's; the table shows the median over the timed steps. Preparing the batch shards is
done before the barrier and not timed (for both methods). See docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

TAG = "[train-bench]"
IGNORE_INDEX = -100
FIRST_LOSS_RTOL = 1e-4  # ds-usp splits must agree on the first-step loss to this relative tolerance
NATIVE_OP: dict[str, Any] = {"auto": "auto", "on": True, "off": False}


@dataclass(frozen=True)
class Method:
    """One row of the table: ``kind`` is ``"usp"`` or ``"deepspeed"``; U x R the split."""

    kind: str
    ulysses: int
    ring: int

    @property
    def label(self) -> str:
        return "ds-usp" if self.kind == "usp" else "DeepSpeed-Ulysses"

    @property
    def key(self) -> str:
        return f"{self.kind}_{self.ulysses}x{self.ring}"


class SetupRefused(Exception):
    """A method's own setup refused this model/config (the row is skipped with this reason)."""


# ----------------------------------------------------------------------------------------------
# arguments


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring and docs/benchmarks.md)."""
    p = argparse.ArgumentParser(description="ds-usp training benchmark: tiny Llama, every U x R split vs "
                                "DeepSpeed-Ulysses")
    p.add_argument("--seq", type=int, default=8192, help="global sequence length (tokens per sample)")
    p.add_argument("--batch", type=int, default=1, help="micro batch size (sequences per step)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: = --heads)")
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (at least 1)")
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ring-impl", default="zigzag", choices=("zigzag", "basic"), help="ds-usp usp.ring_impl")
    p.add_argument("--native-op", default=None, choices=tuple(NATIVE_OP), help="ds-usp usp.native_op "
                   "(default: the library's)")
    p.add_argument("--methods", default="all", help="comma list of rows to run: 'deepspeed', 'usp' (every "
                   "split) or splits like '2x2'; default all")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one method may take (its worker "
                   "processes are killed after that) and every collective's timeout")
    p.add_argument("--json", default=None, help="also write the rows to this file (rank 0)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: JSON of the worker's job
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.hidden % args.heads:  # transformers' LlamaConfig refuses it, whatever head_dim is
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.head_dim is None:
        args.head_dim = args.hidden // args.heads
    for name in ("seq", "batch", "layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                 "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


def plan_methods(methods: str, world: int) -> list[Method]:
    """The rows to run: every split U x R = world of ds-usp, then DeepSpeed-Ulysses (U = world)."""
    splits = [(u, world // u) for u in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True)]
    rows = [Method("usp", u, r) for u, r in splits] + [Method("deepspeed", world, 1)]
    if methods == "all":
        return rows
    wanted = {w.strip() for w in methods.split(",") if w.strip()}
    known = {"usp", "deepspeed"} | {f"{u}x{r}" for u, r in splits}
    if not wanted or wanted - known:
        raise SystemExit(f"--methods {methods!r}: unknown {sorted(wanted - known)}; valid: {sorted(known)}")
    return [m for m in rows if m.kind in wanted or (m.kind == "usp" and f"{m.ulysses}x{m.ring}" in wanted)]


# ----------------------------------------------------------------------------------------------
# model, data, config (identical for every method)


def build_model(args: argparse.Namespace, attn: str) -> Any:
    """The tiny Llama, fp32, initialized from ``args.seed`` (same weights for every method)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=max(args.seq, 2048), attention_dropout=0.0, use_cache=False,
                      tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def make_batch(args: argparse.Namespace, index: int) -> dict[str, Any]:
    """Sample ``index``: ``(batch, seq)`` token ids from a Zipf-like unigram distribution (learnable, so
    the loss falls within a few steps), labels = ids, global positions. Same on every rank."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + 17 + index)
    probs = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64)
    ids = torch.multinomial(probs.expand(args.batch, -1), args.seq, replacement=True, generator=g)
    positions = torch.arange(args.seq).expand(args.batch, -1).contiguous()
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed config shared by every method (the methods add their sequence-parallel keys)."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


# ----------------------------------------------------------------------------------------------
# worker: one method, one rank, in a fresh process


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this worker when its driver dies (so a killed launch leaves no workers)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the driver died before the prctl
        raise SystemExit(f"{TAG} driver {parent_pid} is gone")


def setup_usp(args: argparse.Namespace, m: Method) -> tuple[Any, Callable[[int], Any], Callable[[Any], float]]:
    """ds-usp: ``ds_usp.initialize`` for split U x R; returns the engine, a batch preparer and a step."""
    import ds_usp

    ds_usp.hf.register_usp_attention()
    model = build_model(args, "usp")
    usp: dict[str, Any] = {"ulysses_degree": m.ulysses, "ring_degree": m.ring, "ring_impl": args.ring_impl}
    if args.native_op is not None:
        usp["native_op"] = NATIVE_OP[args.native_op]
    cfg = dict(ds_config(args), sequence_parallel="usp", sequence_parallel_size=m.ulysses * m.ring, usp=usp)
    try:
        engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except ValueError as e:  # ds-usp refuses the split for this model (e.g. heads vs. ulysses_degree)
        raise SetupRefused(f"ds-usp: {e}") from e
    topo = engine.usp.topo
    if (topo.ulysses_degree, topo.ring_degree) != (m.ulysses, m.ring):
        raise RuntimeError(f"ds-usp built {topo.ulysses_degree}x{topo.ring_degree}, asked {m.ulysses}x{m.ring}")

    def prepare(index: int) -> Any:
        return ds_usp.shard_batch(make_batch(args, index), topo, layout=engine.usp.layout)

    def step(shard: Any) -> float:
        logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo)
        engine.backward(loss)
        engine.step()
        return ds_usp.sp_loss_value(loss, topo)

    return engine, prepare, step


class _RankBatches:
    """Rank r's own data loader for DeepSpeed's adapter: samples r, r + sp, r + 2 sp, ...

    ``UlyssesSPDataLoaderAdapter`` gathers one sample from every SP rank and hands them out one per
    step, so with this loader step i of every rank trains on sample i, as the ds-usp rows do.
    """

    def __init__(self, args: argparse.Namespace, sp_rank: int, sp: int, total: int) -> None:
        self.args, self.indices = args, list(range(sp_rank, sp * math.ceil(total / sp), sp))

    def __iter__(self) -> Any:
        return (make_batch(self.args, i) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def setup_deepspeed(args: argparse.Namespace, m: Method, total_steps: int
                    ) -> tuple[Any, Callable[[int], Any], Callable[[Any], float]]:
    """DeepSpeed's HF Ulysses path (``UlyssesSPAttentionHF``); same contract as :func:`setup_usp`."""
    import deepspeed
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    sp = m.ulysses * m.ring
    model = build_model(args, "sdpa")
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=args.batch, seq_length=args.seq, seq_length_is_variable=False)
        if args.seq % sp:  # the adapter refuses it at the first batch; say so before training
            raise ValueError(f"batch's seqlen={args.seq} isn't divisible by sp-size={sp}")
    except (ValueError, AssertionError) as e:
        raise SetupRefused(f"DeepSpeed: {type(e).__name__}: {e}") from e
    cfg = dict(ds_config(args), sequence_parallel_size=sp)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    loader = iter(UlyssesSPDataLoaderAdapter(_RankBatches(args, mpu.get_sequence_parallel_rank(), sp, total_steps),
                                             sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                             sp_world_size=sp, device=engine.device))
    vocab = engine.module.config.vocab_size

    def prepare(index: int) -> Any:
        del index  # the adapter yields sample i at step i (see _RankBatches)
        return next(loader)

    def step(batch: Any) -> float:
        shift_labels = batch["shift_labels"].to(engine.device)
        out = engine(input_ids=batch["input_ids"].to(engine.device),
                     position_ids=batch["position_ids"].to(engine.device))
        # DeepSpeed's recipe (tests/unit/ulysses_alst): weighted per-shard-loss aggregation across ranks
        local = engine.module.loss_function(logits=out.logits, labels=None, shift_labels=shift_labels,
                                            vocab_size=vocab)
        losses = dist_fn.all_gather(local, group=group)
        good = (shift_labels != IGNORE_INDEX).sum()
        goods = dist_fn.all_gather(good, group=group)
        loss = sum(losses[r] * goods[r] for r in range(sp)) / sum(goods)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return engine, prepare, step


def run_worker(args: argparse.Namespace) -> None:
    """One rank of one method: train ``warmup + steps`` steps and write this rank's result JSON."""
    job = json.loads(args.worker)
    die_with_parent(job["parent_pid"])
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    m = Method(**job["method"])
    out_path = Path(job["out"])
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    # Import what either method uses before the baseline, so that it is not counted as the method's memory.
    import transformers.models.llama.modeling_llama  # noqa: F401
    from deepspeed.runtime.sequence_parallel import ulysses_sp  # noqa: F401

    import ds_usp  # noqa: F401

    result: dict[str, Any] = {"rank": rank, "status": "ok", "reason": None, "rss_base": rss_bytes()}
    total = args.warmup + args.steps
    try:
        setup = setup_usp if m.kind == "usp" else (lambda a, mm: setup_deepspeed(a, mm, total))
        engine, prepare, step = setup(args, m)
    except SetupRefused as e:
        result.update(status="skipped", reason=str(e).splitlines()[0] if str(e) else repr(e))
        out_path.write_text(json.dumps(result))
        return
    result["rss_setup"] = rss_bytes()
    walls, cpus, losses = [], [], []
    for i in range(total):
        batch = prepare(i)
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(batch))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        if rank == 0:
            print(f"{TAG} {m.label} {m.ulysses}x{m.ring} step {i + 1}/{total}: loss {losses[-1]:.6f} "
                  f"{walls[-1]:.2f} s", flush=True)
    result.update(walls=walls, cpus=cpus, losses=losses, rss_peak=peak_rss_bytes(), rss_end=rss_bytes())
    if torch.cuda.is_available():
        result["cuda_peak"] = torch.cuda.max_memory_allocated()
    dist.barrier()
    out_path.write_text(json.dumps(result))
    del engine


# ----------------------------------------------------------------------------------------------
# driver: one per launched rank, starts the workers of each method


@dataclass
class Row:
    """A printed row (per-rank figures reduced as the header of the table says)."""

    method: str
    split: str
    status: str
    reason: Optional[str] = None
    tokens_per_s: float = math.nan
    s_per_step: float = math.nan
    cpu_s_per_step: float = math.nan
    tokens_per_cpu_s: float = math.nan
    rss_peak_mib: float = math.nan
    rss_train_mib: float = math.nan
    first_loss: float = math.nan
    last_loss: float = math.nan


def free_port() -> int:
    """A TCP port free right now on this host (for one method's worker process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def reduce_rows(m: Method, per_rank: list[dict[str, Any]], tokens_per_step: int, warmup: int) -> Row:
    """Per step the slowest rank, then the median over timed steps; memory: the largest rank."""
    split = f"{m.ulysses}x{m.ring}"
    skipped = [r for r in per_rank if r["status"] == "skipped"]
    if skipped:
        return Row(m.label, split, "skipped", reason=skipped[0]["reason"])
    mib = 2.0**20
    steps = range(warmup, len(per_rank[0]["walls"]))
    wall = statistics.median(max(r["walls"][i] for r in per_rank) for i in steps)
    cpu = statistics.median(max(r["cpus"][i] for r in per_rank) for i in steps)
    losses = per_rank[0]["losses"]
    for r in per_rank[1:]:
        if r["losses"] != losses:
            raise RuntimeError(f"{m.label} {split}: ranks disagree on the loss: {losses} vs {r['losses']} "
                               f"(rank {r['rank']})")
    return Row(m.label, split, "ok", tokens_per_s=tokens_per_step / wall, s_per_step=wall, cpu_s_per_step=cpu,
               tokens_per_cpu_s=tokens_per_step / cpu,
               rss_peak_mib=max(r["rss_peak"] for r in per_rank) / mib,
               rss_train_mib=max(r["rss_peak"] - r["rss_setup"] for r in per_rank) / mib,
               first_loss=losses[0], last_loss=losses[-1])


def render(args: argparse.Namespace, world: int, rows: list[Row], first_check: str) -> str:
    """The table printed by rank 0."""
    head = (f"train: {world} ranks, Llama layers={args.layers} hidden={args.hidden} heads={args.heads} "
            f"kv_heads={args.kv_heads} head_dim={args.head_dim} ffn={args.intermediate} vocab={args.vocab}, "
            f"seq={args.seq} batch={args.batch} fp32, ZeRO-{args.zero}, AdamW lr={args.lr}, steps={args.steps} "
            f"(median) after warmup={args.warmup}, 1 thread/rank, {os.cpu_count()} cores")
    cols = ("method", "UxR", "tok/s", "s/step", "cpu s/step", "tok/cpu-s", "peak RSS MiB", "+train MiB",
            "loss step 1", f"loss step {args.warmup + args.steps}")
    lines = [head, f"{cols[0]:<18} {cols[1]:>4} {cols[2]:>8} {cols[3]:>7} {cols[4]:>10} {cols[5]:>9} "
             f"{cols[6]:>12} {cols[7]:>10} {cols[8]:>12} {cols[9]:>12}"]
    lines.append("-" * len(lines[1]))
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.method:<18} {r.split:>4} skipped: {r.reason}")
            continue
        lines.append(f"{r.method:<18} {r.split:>4} {r.tokens_per_s:8.0f} {r.s_per_step:7.2f} {r.cpu_s_per_step:10.2f} "
                     f"{r.tokens_per_cpu_s:9.0f} {r.rss_peak_mib:12.0f} {r.rss_train_mib:10.0f} "
                     f"{r.first_loss:12.6f} {r.last_loss:12.6f}")
    lines.append(first_check)
    return "\n".join(lines)


def first_loss_check(rows: list[Row]) -> tuple[str, bool]:
    """Compare the first-step losses: ds-usp splits with each other (must agree), DeepSpeed beside them."""
    usp = [r for r in rows if r.method == "ds-usp" and r.status == "ok"]
    ds = [r for r in rows if r.method != "ds-usp" and r.status == "ok"]
    if not usp:
        return "first-step loss: no ds-usp row ran", False
    ref = usp[0].first_loss
    spread = max(abs(r.first_loss - ref) / abs(ref) for r in usp)
    ok = spread <= FIRST_LOSS_RTOL
    text = (f"first-step loss: ds-usp splits agree to {spread:.1e} relative (limit {FIRST_LOSS_RTOL:.0e}): "
            f"{'ok' if ok else 'FAIL'}")
    for r in ds:
        text += f"; {r.method} {r.first_loss:.6f} ({abs(r.first_loss - ref) / abs(ref):.1e} relative to ds-usp)"
    return text, ok


def tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a worker's log."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def run_driver(args: argparse.Namespace) -> None:
    """Start each method's worker on this rank, collect the results (rank 0 prints the table)."""
    import torch
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise SystemExit(f"{TAG} {var} is not set: run through the launcher, e.g. "
                             f"deepspeed --num_gpus 4 benchmarks/train.py")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout + 300))
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = plan_methods(args.methods, world)
    shared: list[Any] = [None, None]
    if rank == 0:
        shared = [tempfile.mkdtemp(prefix="ds_usp_train_"), [free_port() for _ in methods]]
    dist.broadcast_object_list(shared, src=0)
    workdir, ports = Path(shared[0]), shared[1]
    if rank == 0:
        print(f"{TAG} {len(methods)} methods, each in fresh worker processes; logs in {workdir}", flush=True)
    rows: list[Row] = []
    failed: Optional[str] = None
    for m, port in zip(methods, ports):
        log = workdir / f"{m.key}.rank{rank}.log"
        out = workdir / f"{m.key}.rank{rank}.json"
        job = {"method": asdict(m), "out": str(out), "parent_pid": os.getpid()}
        env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, f"--local_rank={args.local_rank}",
               "--worker", json.dumps(job)]
        if rank == 0:
            print(f"{TAG} {m.label} {m.ulysses}x{m.ring}: start", flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = -1000
        status = [None] * world
        dist.all_gather_object(status, (rc, str(log)))
        bad = [(r, c, p) for r, (c, p) in enumerate(status) if c != 0]
        if bad:
            r, c, p = bad[0]
            why = "timed out" if c == -1000 else f"exited with {c}"
            failed = f"{m.label} {m.ulysses}x{m.ring}: rank {r}'s worker {why}; log {p}:\n{tail(Path(p))}"
            break
        if rank == 0:
            per_rank = [json.loads((workdir / f"{m.key}.rank{r}.json").read_text()) for r in range(world)]
            rows.append(reduce_rows(m, per_rank, args.batch * args.seq, args.warmup))
            row = rows[-1]
            done = f"{row.s_per_step:.2f} s/step" if row.status == "ok" else f"skipped: {row.reason}"
            print(f"{TAG} {m.label} {m.ulysses}x{m.ring}: {done} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if rank == 0:
        check, ok = first_loss_check(rows) if rows else ("", True)
        print(render(args, world, rows, check), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                           if k not in ("local_rank", "worker")},
                                                  "world": world, "rows": [asdict(r) for r in rows],
                                                  "first_loss_check": check}, indent=1))
        if failed is None and not ok:
            failed = check
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and failed is None:
        shutil.rmtree(workdir, ignore_errors=True)  # kept (with the worker logs) when the run failed
    if failed is not None:
        raise SystemExit(f"{TAG} FAILED: {failed}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point: the driver (launched by deepspeed) or, internally, one method's worker."""
    args = parse_args(argv)
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1")
    if args.worker is not None:
        run_worker(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
