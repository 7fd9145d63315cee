"""Training benchmark (issue 5): a tiny HF Llama trained with ds-usp's U x R splits vs DeepSpeed-Ulysses.

Run (4 CPU ranks over gloo; NCCL when CUDA is available):

    deepspeed --num_gpus 4 benchmarks/train.py --seq 8192 --steps 5 --warmup 1 --zero 2 --kv-heads 2

One launch measures, on the same model config, the same initial weights and the same data:

* ``ds-usp UxR`` for every split U x R of the ranks: ``ds_usp.initialize`` with
  ``attn_implementation="usp"``, batches sharded by ``ds_usp.shard_batch``, loss
  ``ds_usp.sp_cross_entropy`` (the whole sequence's mean loss on every rank);
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
import importlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from _common import (NATIVE_OP, close_distributed, free_port, init_distributed, log, parse, parser, save_results,
                     splits, table)

IGNORE_INDEX = -100
FIRST_LOSS_RTOL = 1e-4  # ds-usp splits must agree on the first-step loss to this relative tolerance


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
    """The shared flags (fp32 only: no ``--dtype``) and the model, training and method flags."""
    p = parser("ds-usp training benchmark: tiny Llama, every U x R split vs DeepSpeed-Ulysses", dtype=None,
               head_dim=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (at least 1)")
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--ring-impl", default="zigzag", choices=("zigzag", "basic"), help="ds-usp usp.ring_impl")
    p.add_argument("--methods", default="all", help="comma list of rows to run: 'deepspeed', 'usp' (every "
                   "split) or splits like '2x2'; default all")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: JSON of the worker's job
    args = parse(p, argv)
    if args.hidden % args.heads:  # transformers' LlamaConfig refuses it, whatever head_dim is
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.head_dim is None:
        args.head_dim = args.hidden // args.heads
    for name in ("layers", "hidden", "intermediate", "vocab", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def plan_methods(methods: str, world: int) -> list[Method]:
    """The rows to run: every split U x R = world of ds-usp, then DeepSpeed-Ulysses (U = world)."""
    rows = [Method("usp", u, r) for u, r in splits(world)] + [Method("deepspeed", world, 1)]
    if methods == "all":
        return rows
    wanted = {w.strip() for w in methods.split(",") if w.strip()}
    known = {"usp", "deepspeed"} | {f"{u}x{r}" for u, r in splits(world)}
    if not wanted or wanted - known:
        raise SystemExit(f"--methods {methods!r}: unknown {sorted(wanted - known)}; valid: {sorted(known)}")
    return [m for m in rows if m.kind in wanted or (m.kind == "usp" and f"{m.ulysses}x{m.ring}" in wanted)]


# ----------------------------------------------------------------------------------------------
# model, data, config (identical for every method)


def build_model(args: argparse.Namespace, attn: str) -> Any:
    """The tiny Llama, fp32, initialized from ``args.seed`` (same weights for every method)."""
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
        raise SystemExit(f"driver {parent_pid} is gone")


def setup_usp(args: argparse.Namespace, m: Method) -> tuple[Any, Callable[[int], Any], Callable[[Any], torch.Tensor]]:
    """ds-usp: ``ds_usp.initialize`` for split U x R.

    Returns:
        The engine, a batch preparer (sample index -> this rank's batch) and the loss of a batch (the
        whole sequence's mean on every rank, for ``engine.backward``).
    """
    import ds_usp

    ds_usp.hf.register_usp_attention()
    model = build_model(args, "usp")
    usp: dict[str, Any] = {"ulysses_degree": m.ulysses, "ring_degree": m.ring, "ring_impl": args.ring_impl}
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

    def loss_of(shard: Any) -> torch.Tensor:
        logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        return ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo)

    return engine, prepare, loss_of


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
                    ) -> tuple[Any, Callable[[int], Any], Callable[[Any], torch.Tensor]]:
    """DeepSpeed's HF Ulysses path (``UlyssesSPAttentionHF``); same contract as :func:`setup_usp`."""
    import deepspeed
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # its ALST path uses deepspeed.comm
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

    def loss_of(batch: Any) -> torch.Tensor:
        shift_labels = batch["shift_labels"].to(engine.device)
        out = engine(input_ids=batch["input_ids"].to(engine.device),
                     position_ids=batch["position_ids"].to(engine.device))
        # DeepSpeed's recipe (tests/unit/ulysses_alst): weighted per-shard-loss aggregation across ranks
        local = engine.module.loss_function(logits=out.logits, labels=None, shift_labels=shift_labels,
                                            vocab_size=vocab)
        losses = dist_fn.all_gather(local, group=group)
        good = (shift_labels != IGNORE_INDEX).sum()
        goods = dist_fn.all_gather(good, group=group)
        return sum(losses[r] * goods[r] for r in range(sp)) / sum(goods)

    return engine, prepare, loss_of


def run_worker(args: argparse.Namespace) -> None:
    """One rank of one method: train ``warmup + steps`` steps and write this rank's result JSON."""
    job = json.loads(args.worker)
    die_with_parent(job["parent_pid"])
    m = Method(**job["method"])
    out_path = Path(job["out"])
    init_distributed(args.timeout)
    rank = dist.get_rank()
    # Import what either method uses before the baseline, so that it is not counted as the method's memory.
    for module in ("transformers.models.llama.modeling_llama", "deepspeed.runtime.sequence_parallel.ulysses_sp",
                   "ds_usp"):
        importlib.import_module(module)

    result: dict[str, Any] = {"rank": rank, "status": "ok", "reason": None, "rss_base": rss_bytes()}
    total = args.warmup + args.steps
    try:
        setup = setup_usp if m.kind == "usp" else (lambda a, mm: setup_deepspeed(a, mm, total))
        engine, prepare, loss_of = setup(args, m)
    except SetupRefused as e:
        result.update(status="skipped", reason=str(e).splitlines()[0] if str(e) else repr(e))
        out_path.write_text(json.dumps(result))
        close_distributed()
        return
    result["rss_setup"] = rss_bytes()
    walls, cpus, losses = [], [], []
    for i in range(total):
        batch = prepare(i)
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        loss = loss_of(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        log(f"{m.label} {m.ulysses}x{m.ring} step {i + 1}/{total}: loss {losses[-1]:.6f} {walls[-1]:.2f} s")
    result.update(walls=walls, cpus=cpus, losses=losses, rss_peak=peak_rss_bytes(), rss_end=rss_bytes())
    if torch.cuda.is_available():
        result["cuda_peak"] = torch.cuda.max_memory_allocated()
    out_path.write_text(json.dumps(result))
    del engine
    close_distributed()


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
    """The table printed by rank 0 (skipped rows with their reason below it)."""
    head = (f"train: {world} ranks, Llama layers={args.layers} hidden={args.hidden} heads={args.heads} "
            f"kv_heads={args.kv_heads} head_dim={args.head_dim} ffn={args.intermediate} vocab={args.vocab}, "
            f"seq={args.seq} batch={args.batch} fp32, ZeRO-{args.zero}, AdamW lr={args.lr}, steps={args.steps} "
            f"(median) after warmup={args.warmup}, 1 thread/rank, {os.cpu_count()} cores")
    cols = {"method": "method", "split": "UxR", "tokens_per_s": "tok/s", "s_per_step": "s/step",
            "cpu_s_per_step": "cpu s/step", "tokens_per_cpu_s": "tok/cpu-s", "rss_peak_mib": "peak RSS MiB",
            "rss_train_mib": "+train MiB", "first_loss": "loss step 1",
            "last_loss": f"loss step {args.warmup + args.steps}"}
    ok = [{cols[k]: v for k, v in asdict(r).items() if k in cols} for r in rows if r.status == "ok"]
    fmt = {"tok/s": ".0f", "s/step": ".2f", "cpu s/step": ".2f", "tok/cpu-s": ".0f", "peak RSS MiB": ".0f",
           "+train MiB": ".0f", "loss step 1": ".6f", cols["last_loss"]: ".6f"}
    skipped = [f"{r.method} {r.split} skipped: {r.reason}" for r in rows if r.status != "ok"]
    return "\n".join([head, table(ok, list(cols.values()), fmt)] + skipped + [first_check])


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

    init_distributed(args.timeout + 300, gloo=True)  # only coordinates: the workers form their own groups
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = plan_methods(args.methods, world)
    shared: list[Any] = [None, None]
    if rank == 0:
        shared = [tempfile.mkdtemp(prefix="ds_usp_train_"), [free_port() for _ in methods]]
    dist.broadcast_object_list(shared, src=0)
    workdir, ports = Path(shared[0]), shared[1]
    log(f"{len(methods)} methods, each in fresh worker processes; logs in {workdir}")
    rows: list[Row] = []
    failed: Optional[str] = None
    for m, port in zip(methods, ports):
        logfile = workdir / f"{m.key}.rank{rank}.log"
        job = {"method": asdict(m), "out": str(workdir / f"{m.key}.rank{rank}.json"), "parent_pid": os.getpid()}
        env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, f"--local_rank={args.local_rank}",
               "--worker", json.dumps(job)]
        log(f"{m.label} {m.ulysses}x{m.ring}: start")
        t0 = time.perf_counter()
        with open(logfile, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = -1000
        status = [None] * world
        dist.all_gather_object(status, (rc, str(logfile)))
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
            log(f"{m.label} {m.ulysses}x{m.ring}: {done} ({time.perf_counter() - t0:.0f} s)")
    if rank == 0:
        check, ok = first_loss_check(rows) if rows else ("", True)
        print(render(args, world, rows, check), flush=True)
        meta = {k: v for k, v in vars(args).items() if k != "worker"} | {"first_loss_check": check}
        log(f"results written to {save_results(args.json, meta, rows)}")
        if failed is None and not ok:
            failed = check
    close_distributed()
    if rank == 0 and failed is None:
        shutil.rmtree(workdir, ignore_errors=True)  # kept (with the worker logs) when the run failed
    if failed is not None:
        raise SystemExit(f"[train] FAILED: {failed}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point: the driver (launched by deepspeed) or, internally, one method's worker."""
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
