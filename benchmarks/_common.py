"""The one harness every benchmark uses: flags, ranks, process group, timing, inputs, table and JSON results.

The scripts run as ``python benchmarks/X.py`` or under the launcher (``deepspeed --num_gpus 4
benchmarks/X.py``); either way this folder is ``sys.path[0]``, so they ``from _common import ...``.
Each one's command line extends :func:`base_parser` (:func:`parser` for an attention shape), and a script that
starts ranks itself (one job per system it compares, usually itself again under ``--role``) starts them with
:func:`start_ranks`.
Raw runs go to ``benchmarks/results/*.json`` (:func:`save_results`, or :func:`write_result` for another shape),
each with a :func:`provenance` record: the command, commit, date, device and library versions it came from;
docs/benchmarks.md keeps the method, the tables and the command behind each.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_OP: dict[str, Union[bool, str]] = {"auto": "auto", "on": True, "off": False}  # --native-op -> usp.native_op
ROOT = Path(__file__).resolve().parent.parent  # the repository
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2.0 ** 20
NAME = Path(sys.argv[0]).stem  # the running benchmark: log tag and default result file name


# ------------------------------------------------------------------------------------------ arguments


def comma_list(kind: Callable[[str], Any], choices: Optional[Sequence[str]] = None) -> Callable[[str], list]:
    """An argparse type for comma-separated values of ``kind`` (from ``choices`` when given)."""

    def convert(text: str) -> list:
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not values or any(choices is not None and x not in choices for x in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list"
                                             + (f" from {', '.join(choices)}" if choices else ""))
        return values

    return convert


def base_parser(doc: str, *, json_file: Optional[str] = None, seed: Optional[int] = None,
                timeout: Optional[float] = None, ranks: Optional[int] = None,
                master_port: Optional[int] = None) -> argparse.ArgumentParser:
    """The command line every benchmark starts from; the benchmark adds its own flags (:func:`parser` those of an
    attention shape).

    Every benchmark has ``--json`` and the DeepSpeed launcher's hidden ``--local_rank``; a flag below is added when
    its default is given, so that a flag two benchmarks share has one name and one meaning.

    Args:
        doc: the benchmark's module docstring (its first line is the description).
        json_file: the default of ``--json``, the result file (a bare name goes into ``benchmarks/results/``).
        seed: the default of ``--seed``, the seed of the random inputs.
        timeout: the default of ``--timeout``: seconds a job, a run or a collective may take before the run fails
            instead of hanging.
        ranks: the default of ``--ranks``, the ranks of each job it starts (= the sequence-parallel size).
        master_port: the default of ``--master-port``, the rendezvous port of the first job it starts (each next
            job: one more; 0: a free port for each, :func:`job_port`).

    Returns:
        The parser.
    """
    p = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
    default = json_file or f"the benchmark's own, e.g. {NAME}-<date>.json"
    p.add_argument("--json", default=json_file,
                   help=f"write the raw run here (a bare name goes into benchmarks/results/; default: {default})")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed, help="seed of the random inputs")
    if timeout is not None:
        p.add_argument("--timeout", type=float, default=timeout,
                       help="seconds a job, a run or a collective may take before the run fails instead of hanging")
    if ranks is not None:
        p.add_argument("--ranks", type=int, default=ranks, help="ranks of each job (= the sequence-parallel size)")
    if master_port is not None:
        p.add_argument("--master-port", type=int, default=master_port,
                       help="rendezvous port of the first job it starts (each next job: +1; 0: a free port each)")
    return p


def parser(description: str, *, seq: Union[int, Sequence[int]] = 8192, dtype: Union[str, Sequence[str], None] = "fp32",
           kv_heads_list: bool = False, heads: int = 8, head_dim: Optional[int] = 64,
           timing: Optional[tuple[int, int]] = None, native_op: bool = True, **common: Any) -> argparse.ArgumentParser:
    """:func:`base_parser` with the flags of an attention shape (``--seed 0`` and ``--timeout 900`` unless
    ``common`` says otherwise); the benchmark adds its own flags.

    A list default makes a flag a comma-separated list with a plural name that also answers to the
    singular (``--seqs``/``--seq``, ``--dtypes``/``--dtype``); a single default makes it one value.
    ``timing=(iters, warmup)`` adds ``--iters``/``--warmup``; ``dtype=None`` leaves the dtype out;
    ``head_dim=None`` lets the benchmark derive it; ``common``: :func:`base_parser`'s keywords.
    """
    p = base_parser(description, **{"seed": 0, "timeout": 900.0, **common})
    if isinstance(seq, int):
        p.add_argument("--seq", type=int, default=seq, help="global sequence length (ds-usp pads it to its layout)")
    else:
        p.add_argument("--seqs", "--seq", dest="seqs", type=comma_list(int), default=list(seq),
                       help="comma-separated global sequence lengths")
    if isinstance(dtype, str):
        p.add_argument("--dtype", choices=list(DTYPES), default=dtype)
    elif dtype is not None:
        p.add_argument("--dtypes", "--dtype", dest="dtypes", type=comma_list(str, list(DTYPES)), default=list(dtype),
                       help=f"comma-separated, from {', '.join(DTYPES)}")
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--heads", type=int, default=heads, help="query heads")
    p.add_argument("--kv-heads", type=comma_list(int) if kv_heads_list else int, default=None,
                   help="key/value heads" + (", comma-separated (default: --heads, 2, 1)" if kv_heads_list
                                             else " (default: --heads)"))
    p.add_argument("--head-dim", type=int, default=head_dim)
    if timing is not None:
        p.add_argument("--iters", type=int, default=timing[0], help="timed iterations (the median is reported)")
        p.add_argument("--warmup", type=int, default=timing[1], help="untimed iterations before them (at least 1)")
    if native_op:
        p.add_argument("--native-op", choices=list(NATIVE_OP), default="auto",
                       help="ds-usp's usp.native_op: auto (the library default), on, off (the PyTorch twins)")
    p.kv_heads_list = kv_heads_list  # read by parse()
    return p


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the shared flags: sizes at least 1, query heads a multiple of every kv head count.

    An unset ``--kv-heads`` is ``--heads`` (as a list: ``--heads``, 2 and 1 where they divide it: MHA, GQA, MQA).
    """
    from ds_usp.splits import gqa_compatible

    args = p.parse_args(argv)
    if args.kv_heads is None:
        divisors = [h for h in (args.heads, 2, 1) if gqa_compatible(args.heads, h)]
        args.kv_heads = sorted(set(divisors), reverse=True) if p.kv_heads_list else args.heads
    kv = args.kv_heads if isinstance(args.kv_heads, list) else [args.kv_heads]
    sizes = [("batch", args.batch), ("heads", args.heads), ("head-dim", args.head_dim),
             ("iters", getattr(args, "iters", 1)), ("warmup", getattr(args, "warmup", 1))]
    sizes += [("kv-heads", h) for h in kv] + [("seq", s) for s in getattr(args, "seqs", [getattr(args, "seq", 1)])]
    for name, value in sizes:
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    for h in kv:
        if not gqa_compatible(args.heads, h):
            p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({h})")
    return args


# ------------------------------------------------------------------------------------ process group


def init_distributed(timeout: float) -> torch.device:
    """Join the launcher's process group (NCCL with CUDA, else gloo), one intra-op thread per rank.

    ``torch.distributed`` directly: ``deepspeed.init_distributed`` on CPU also sets up DeepSpeed's
    shared-memory all-reduce, whose buffers outlive the run (see :func:`close_distributed`); only what
    needs ``deepspeed.comm`` sets it up. Returns this rank's device.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise SystemExit(f"[{NAME}] {', '.join(missing)} not set: run it through the launcher, e.g. "
                         f"deepspeed --num_gpus 4 {sys.argv[0]}")
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout))
    return device


def close_distributed() -> None:
    """Wait for every rank, leave the group, remove this rank's DeepSpeed shared-memory buffer (about 66 MB
    in ``/dev/shm``, named after MASTER_ADDR/PORT, which DeepSpeed's CPU backend never removes)."""
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    leftover = f"deepspeed_allreduce_buffer_*_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}"
    for path in Path("/dev/shm").glob(leftover):
        path.unlink(missing_ok=True)


def free_port() -> int:
    """A TCP port free on this host right now (for a job a benchmark launches itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def world_of_one() -> None:
    """The launcher's variables for this process alone (rank 0 of 1, a free port), so that ``ds_usp.initialize`` or
    ``deepspeed.init_distributed`` starts a one-process world without a launcher."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def job_port(args: argparse.Namespace, job: int) -> int:
    """The rendezvous port of the ``job``-th job (from 0) a benchmark starts: ``--master-port`` plus ``job``, or a
    free port when it is 0 (:func:`base_parser`'s ``master_port``).

    Args:
        args: the parsed command line, with ``master_port``.
        job: the job's number.

    Returns:
        The port.
    """
    return args.master_port + job if args.master_port else free_port()


def start_ranks(script: Union[str, Path], script_args: Sequence[Any], ranks: Optional[int] = None, *,
                launcher: str = "torchrun", port: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                timeout: Optional[float] = None, capture: Union[bool, str] = False, check: bool = False,
                cwd: Optional[Union[str, Path]] = None, echo: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` as a job of ``ranks`` processes on this host and wait for it: the one way the benchmarks start
    ranks (a benchmark that compares systems runs itself as one job per system, see :func:`run_as_job`).

    With ``ranks`` torch's launcher starts them (``python -m torch.distributed.run --nproc_per_node N --master_port
    P``), or with ``launcher="deepspeed"`` DeepSpeed's (``deepspeed --num_gpus N --master_port P``, from this
    interpreter; it appends ``--local_rank``); without, one plain process (``python script``: a single-process
    system). The job runs in a session of its own, and on a timeout or when this process is stopped
    (``KeyboardInterrupt``, ``SystemExit``) the launcher and every rank are killed: killing the launcher alone (as
    ``subprocess.run``'s timeout does) left its ranks running, holding the port, the memory and the output pipes,
    which kept the caller waiting until they ended.

    Args:
        script: the Python file (a benchmark's own jobs: ``__file__``).
        script_args: its arguments (each made a string).
        ranks: processes of the job; None: one process without a launcher.
        launcher: ``"torchrun"`` or ``"deepspeed"``.
        port: the rendezvous port (default: a free one).
        env: variables set for the job, over this process's.
        timeout: seconds the job may take.
        capture: keep the output in the result (``stdout``, ``stderr``) instead of passing it through; ``"stderr"``:
            the error stream only.
        check: raise when the job fails.
        cwd: the job's working directory.
        echo: print the command first (tagged with the benchmark's name).

    Returns:
        The finished job: ``returncode``, and what ``capture`` kept.

    Raises:
        ValueError: an unknown ``launcher``.
        subprocess.TimeoutExpired: the job ran past ``timeout`` (all its processes killed).
        subprocess.CalledProcessError: ``check`` and the job failed.
    """
    if launcher not in ("torchrun", "deepspeed"):
        raise ValueError(f"launcher {launcher!r}: use 'torchrun' or 'deepspeed'")
    cmd = [sys.executable]
    if ranks is not None:
        runner = ["torch.distributed.run", "--nproc_per_node"] if launcher == "torchrun" else \
            ["deepspeed.launcher.runner", "--num_gpus"]
        cmd += ["-m", *runner, str(ranks), "--master_port", str(free_port() if port is None else port)]
    cmd += [str(script), *(str(a) for a in script_args)]
    if echo:
        print(f"[{NAME}] {shlex.join(cmd)}", flush=True)
    streams = {"stdout": subprocess.PIPE if capture is True else None, "stderr": subprocess.PIPE if capture else None}
    with subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=cwd, text=True, start_new_session=True,
                          **streams) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except BaseException:  # the timeout, or this process stopped: the whole job goes
            _kill_job(job)
            raise
    done = subprocess.CompletedProcess(cmd, job.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _kill_job(job: subprocess.Popen) -> None:
    """Kill a job of :func:`start_ranks`, its launcher and every process under it, and reap the launcher.

    Process by process: torch's launcher starts each rank in a session of its own (the job's session does not hold
    them), and a rank holds the pipes the output is read from until it ends."""
    import psutil

    try:
        launcher = psutil.Process(job.pid)
        procs = [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(job.pid, signal.SIGKILL)  # whatever else is left in the job's own session
    except (ProcessLookupError, PermissionError):
        pass
    job.communicate()


def log(msg: str) -> None:
    """Print a progress line, tagged with the benchmark's name, on rank 0 (or without a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{NAME}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Timing:
    """Seconds of a step on three clocks: per iteration the slowest rank, then the median over iterations.

    ``wall`` is ``perf_counter``; ``cpu`` the process CPU time (the compute thread plus gloo's transfer
    threads; not the time spent descheduled); ``thread`` the compute thread's CPU time. ``ranks`` has,
    per rank, the medians of the three clocks.
    """

    wall: float
    cpu: float
    thread: float
    ranks: list[list[float]]

    def imbalance(self, clock: int = 1) -> float:
        """Slowest rank's median over the mean rank's, on clock 0 (wall), 1 (cpu) or 2 (thread)."""
        values = [r[clock] for r in self.ranks]
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else float("nan")


def timed(step: Callable[[], Any], iters: int, warmup: int, device: torch.device, only_rank0: bool = False
          ) -> tuple[Timing, Any]:
    """Run ``step`` ``warmup + iters`` times on every rank, each after a barrier; time the last ``iters``.

    Args:
        step: one iteration (ranks that only wait pass a no-op).
        only_rank0: the times of rank 0 alone (a single-rank baseline while the others wait).

    Returns:
        The :class:`Timing` (the same on every rank) and ``step``'s last return value.
    """
    times = torch.zeros(iters, 3, dtype=torch.float64)
    out = None
    for i in range(warmup + iters):
        dist.barrier()
        w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        out = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times[i - warmup] = torch.tensor([time.perf_counter() - w0, time.process_time() - c0,
                                              time.thread_time() - t0], dtype=torch.float64)
    parts = [torch.empty_like(times, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, times.to(device))
    every = torch.stack(parts).cpu()[: 1 if only_rank0 else None]  # (ranks, iters, 3)
    slowest = every.max(dim=0).values
    med = [statistics.median(slowest[:, j].tolist()) for j in range(3)]
    ranks = [[statistics.median(every[r, :, j].tolist()) for j in range(3)] for r in range(every.shape[0])]
    return Timing(*med, ranks), out


# ---------------------------------------------------------------------------------------- workloads


def splits(world: int) -> list[tuple[int, int]]:
    """Every ``(U, R)`` with ``U * R == world``, Ulysses-heaviest first (:func:`ds_usp.splits.factorizations`)."""
    from ds_usp.splits import factorizations

    return factorizations(world)


def split_refusal(heads: int, kv_heads: int, ulysses: int) -> Optional[str]:
    """ds-usp's own reason why a Ulysses degree does not fit these head counts, or None when it does."""
    from ds_usp.attention.ulysses import check_heads

    try:
        check_heads(heads, kv_heads, ulysses)
    except ValueError as err:
        return f"ds-usp: {err}"
    return None


def random_qkv(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random bshd ``(q, k, v, dout)`` drawn on the CPU from ``seed`` (the same values on any device)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, h, head_dim, generator=gen).to(device=device, dtype=dtype)
                 for h in (heads, kv_heads, kv_heads, heads))  # type: ignore[return-value]


def sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The reference: ``F.scaled_dot_product_attention`` over the whole sequence on bshd tensors (GQA without
    copies); on CPU that is PyTorch's flash attention, the kernel ds-usp's ``torch`` backend runs too."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------ results


def _plain(row: Any) -> dict[str, Any]:
    return dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(row)


def _cell(value: Any, spec: Optional[str]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec or (".6g" if isinstance(value, float) else "d"))
    return str(value)


def table(rows: Sequence[Any], columns: Optional[Sequence[str]] = None, fmt: Optional[Mapping[str, str]] = None,
          markdown: bool = False) -> str:
    """Rows (dicts or dataclasses) as an aligned text table, or a Markdown one; None and NaN show as ``-``.

    ``columns``: the keys to show (default: the first row's); ``fmt``: a format spec per column.
    """
    plain = [_plain(r) for r in rows]
    columns = list(columns if columns is not None else (plain[0] if plain else []))
    cells = [[_cell(r.get(c), (fmt or {}).get(c)) for c in columns] for r in plain]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in plain) for c in columns]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return " ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    head = line(columns)
    return "\n".join([head, "-" * len(head)] + [line(row) for row in cells])


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _json_safe(dataclasses.asdict(x))
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def result_path(path: str) -> Path:
    """``path``, or for a bare file name ``benchmarks/results/<name>``."""
    return RESULTS / path if Path(path).parent == Path(".") else Path(path)


def _command_line(argv: Sequence[str]) -> str:
    """The command a person typed to start this process, as far as the environment tells it.

    Under the DeepSpeed launcher (which sets ``LOCAL_SIZE`` and ``CROSS_SIZE`` and appends ``--local_rank=N``):
    ``deepspeed --num_gpus N [--num_nodes M] [--master_port P] script args``; under torchrun:
    ``torchrun --nproc_per_node N script args``; otherwise ``python script args``.
    """
    args = [a for a in argv[1:] if not a.startswith("--local_rank")]
    env = os.environ
    if "LOCAL_SIZE" in env and "CROSS_SIZE" in env:
        head = ["deepspeed", "--num_gpus", env["LOCAL_SIZE"]]
        if env["CROSS_SIZE"] != "1":
            head += ["--num_nodes", env["CROSS_SIZE"]]
        if env.get("MASTER_PORT", "29500") != "29500":
            head += ["--master_port", env["MASTER_PORT"]]
    elif "TORCHELASTIC_RUN_ID" in env:
        head = ["torchrun", "--nproc_per_node", env.get("LOCAL_WORLD_SIZE", "?")]
    else:
        head = ["python"]
    script = Path(argv[0]) if argv else Path("-")
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(head + [str(script)] + args)


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Where a result comes from: the command, commit, date, device and library versions.

    Args:
        argv: the process's arguments (default ``sys.argv``).

    Returns:
        ``{"command", "commit", "date", "device", "versions"}``: ``commit`` is ``git rev-parse HEAD``, with
        ``+dirty`` (and ``"changed"``: the paths) when tracked or untracked files outside ``benchmarks/results/``
        differ from it; ``device`` the CPU model and cores, plus the GPUs when CUDA is there.
    """
    from importlib import metadata

    head = (_git("rev-parse", "HEAD") or "").strip() or "unknown (not a git checkout)"
    changed = [line[3:] for line in (_git("status", "--porcelain") or "").splitlines()
               if not line[3:].startswith("benchmarks/results/")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = f"cpu: {_cpu_name()}, {cores} cores"
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        device += "; gpu: " + ", ".join(f"{n} x {gpus.count(n)}" for n in dict.fromkeys(gpus))
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for dist_name in ("torch", "deepspeed", "transformers", "triton", "ds-usp"):
        try:
            versions[dist_name.replace("-", "_")] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[dist_name.replace("-", "_")] = None
    record = {"command": _command_line(sys.argv if argv is None else argv),
              "commit": head + ("+dirty" if changed else ""),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device, "versions": versions}
    if changed:
        record["changed"] = changed
    return record


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The hidden flags of a benchmark that launches itself as jobs: ``--role`` (which system this job runs) and
    ``--out`` (where it writes its row)."""
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)


def run_as_job(args: argparse.Namespace, run: Callable[[argparse.Namespace], Mapping[str, Any]]) -> bool:
    """When started as one of its own jobs (``--role``): ``run(args)`` and its row (empty on all but rank 0) written
    to ``--out``. Returns whether it was such a job."""
    if not args.role:
        return False
    row = run(args)
    if row:
        Path(args.out).write_text(json.dumps(row))
    return True


def write_result(path: Union[str, Path], payload: Any) -> Path:
    """Write ``payload`` as JSON with this process's :func:`provenance` (the one writer of ``benchmarks/results``).

    A dict payload gets a ``"provenance"`` key (first); anything else becomes ``{"provenance": ...,
    "results": payload}``. A bare file name goes into ``benchmarks/results/``. Returns the path written.
    """
    record = provenance()
    if isinstance(payload, Mapping) and isinstance(payload.get("args"), Mapping):  # the launcher's, not the run's
        payload = {**payload, "args": {k: v for k, v in payload["args"].items() if k != "local_rank"}}
    body = ({"provenance": record, **{k: v for k, v in payload.items() if k != "provenance"}}
            if isinstance(payload, Mapping) else {"provenance": record, "results": payload})
    target = result_path(str(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(_json_safe(body), indent=1) + "\n")
    return target


def save_results(path: Optional[str], meta: Union[Mapping[str, Any], argparse.Namespace], rows: Sequence[Any]) -> Path:
    """Write one run as JSON through :func:`write_result`: its provenance, the benchmark, the world size, ``args``
    (``meta``) and ``rows``. A bare file name goes into ``benchmarks/results/``; none:
    ``benchmarks/results/<benchmark>-<UTC date and time>.json``. Returns the path written."""
    meta = vars(meta) if isinstance(meta, argparse.Namespace) else meta
    now = datetime.datetime.now(datetime.timezone.utc)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    args = {k: v for k, v in meta.items() if k != "local_rank"}
    return write_result(path or f"{NAME}-{now:%Y%m%d-%H%M%S}.json",
                        {"benchmark": NAME, "world_size": world, "args": args, "rows": [_plain(r) for r in rows]})
