"""What every benchmark shares: one argument set, one process-group start, one table, one SDPA reference.

The scripts run as ``python benchmarks/X.py`` or under the launcher (``deepspeed --num_gpus 4
benchmarks/X.py``); either way this folder is ``sys.path[0]``, so they ``from _common import ...``.
Raw runs go to ``benchmarks/results/*.json`` (:func:`save_results`); docs/benchmarks.md keeps the
method and the current tables.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_OP: dict[str, Union[bool, str]] = {"auto": "auto", "on": True, "off": False}  # --native-op -> usp.native_op
RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2.0 ** 20
NAME = Path(sys.argv[0]).stem  # the running benchmark: log tag and default result file name


# ------------------------------------------------------------------------------------------ arguments


def comma_list(kind: Callable[[str], Any], choices: Optional[Sequence[str]] = None) -> Callable[[str], list]:
    """An argparse type for comma-separated values.

    Args:
        kind: converts one value (e.g. ``int``).
        choices: the values allowed (None: any).

    Returns:
        The type function; it raises ``argparse.ArgumentTypeError`` for an empty list or a value not allowed.
    """

    def convert(text: str) -> list:
        values = [kind(x) for x in text.split(",") if x.strip()]
        bad = [x for x in values if choices is not None and x not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list"
                                             + (f" from {', '.join(choices)}" if choices else ""))
        return values

    return convert


def parser(description: str, *, seq: Union[int, Sequence[int]] = 8192,
           dtype: Union[str, Sequence[str], None] = "fp32",
           kv_heads_list: bool = False, heads: int = 8, head_dim: Optional[int] = 64,
           timing: Optional[tuple[int, int]] = None, native_op: bool = True) -> argparse.ArgumentParser:
    """The command line every benchmark starts from; the benchmark adds its own flags to it.

    A list default makes the flag a comma-separated list with a plural name that also answers to the
    singular (``--seqs``/``--seq``, ``--dtypes``/``--dtype``); a single default makes it one value.

    Args:
        description: the ``--help`` text.
        seq: default global sequence length (``--seq``), or lengths (``--seqs``).
        dtype: default dtype name (``--dtype``), or names (``--dtypes``), from :data:`DTYPES`; None: no flag.
        kv_heads_list: ``--kv-heads`` takes a comma-separated list (default: the benchmark's).
        heads: default ``--heads``.
        head_dim: default ``--head-dim`` (None: the benchmark derives it).
        timing: ``(iters, warmup)`` defaults: adds ``--iters`` and ``--warmup``.
        native_op: add ``--native-op {auto,on,off}`` (default ``auto``, the library's).

    Returns:
        The parser; read it with :func:`parse`.
    """
    p = argparse.ArgumentParser(description=description)
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
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds any collective may wait before the run fails instead of hanging")
    p.add_argument("--json", default=None,
                   help=f"write the raw run here (default: benchmarks/results/{NAME}-<date>.json)")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    p.kv_heads_list = kv_heads_list  # read by parse()
    return p


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the shared flags: sizes at least 1, query heads a multiple of every kv head count.

    Args:
        p: a parser from :func:`parser`.
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The arguments; an unset ``--kv-heads`` is ``--heads``, or as a list ``--heads``, 2 and 1 (those
        that divide ``--heads``: MHA, GQA and MQA).
    """
    args = p.parse_args(argv)
    if args.kv_heads is None:
        divisors = [h for h in (args.heads, 2, 1) if args.heads % h == 0]
        args.kv_heads = sorted(set(divisors), reverse=True) if p.kv_heads_list else args.heads
    kv = args.kv_heads if isinstance(args.kv_heads, list) else [args.kv_heads]
    sizes = [("batch", args.batch), ("heads", args.heads), ("head-dim", args.head_dim),
             ("iters", getattr(args, "iters", 1)), ("warmup", getattr(args, "warmup", 1))]
    sizes += [("kv-heads", h) for h in kv] + [("seq", s) for s in getattr(args, "seqs", [getattr(args, "seq", 1)])]
    for name, value in sizes:
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    for h in kv:
        if args.heads % h:
            p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({h})")
    return args


# ------------------------------------------------------------------------------------ process group


def init_distributed(timeout: float, gloo: bool = False) -> torch.device:
    """Join the process group that the launcher describes, one intra-op thread per rank.

    ``torch.distributed`` directly, NCCL when CUDA is available (else, or with ``gloo``, gloo on CPU):
    ``deepspeed.init_distributed`` on CPU also sets up DeepSpeed's shared-memory all-reduce, whose
    buffers outlive the run (see :func:`close_distributed`); only what needs ``deepspeed.comm`` sets it up.

    Args:
        timeout: seconds any collective may wait.
        gloo: gloo and the CPU even when CUDA is available (a driver that only coordinates).

    Returns:
        This rank's device (``cuda:LOCAL_RANK`` or ``cpu``).

    Raises:
        SystemExit: RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT is not set (no launcher).
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise SystemExit(f"[{NAME}] {', '.join(missing)} not set: run it through the launcher, e.g. "
                         f"deepspeed --num_gpus 4 {sys.argv[0]}")
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if torch.cuda.is_available() and not gloo:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout))
    return device


def close_distributed() -> None:
    """Wait for every rank, leave the process group, and remove this rank's DeepSpeed shared-memory buffer.

    DeepSpeed's CPU communication backend (set up by ``deepspeed.initialize`` or a DeepSpeed layer's
    ``deepspeed.init_distributed``) maps an all-reduce buffer of about 66 MB per rank in ``/dev/shm``,
    named after MASTER_ADDR and MASTER_PORT, and never removes it.
    """
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    leftover = f"deepspeed_allreduce_buffer_*_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}"
    for path in Path("/dev/shm").glob(leftover):
        path.unlink(missing_ok=True)


def free_port() -> int:
    """A TCP port free on this host right now (for a process group started by a benchmark itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    """Print a progress line, tagged with the benchmark's name, on rank 0 (or without a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{NAME}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------- workloads


def splits(world: int) -> list[tuple[int, int]]:
    """Every ``(U, R)`` with ``U * R == world``, Ulysses-heaviest first."""
    return [(world // r, r) for r in range(1, world + 1) if world % r == 0]


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
    """Random q, k, v and an output gradient, drawn on the CPU from ``seed`` (the same values on any device).

    Args:
        batch, seq, heads, kv_heads, head_dim: the shapes, ``(batch, seq, heads or kv_heads, head_dim)``.
        dtype: their dtype.
        device: where they go.
        seed: the generator's seed.

    Returns:
        ``(q, k, v, dout)``, bshd; none requires grad.
    """
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, h, head_dim, generator=gen).to(device=device, dtype=dtype)
                 for h in (heads, kv_heads, kv_heads, heads))  # type: ignore[return-value]


def sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float] = None,
         mask: Optional[Tensor] = None) -> Tensor:
    """The reference: ``F.scaled_dot_product_attention`` over the whole sequence, on bshd tensors.

    KV heads are shared by groups of query heads (GQA/MQA, ``enable_gqa``: no repeated copy); the
    transposes are views, so on CPU this is PyTorch's flash attention, the kernel ds-usp's ``torch``
    backend runs too (with an explicit ``mask``, SDPA picks a kernel that takes one).

    Args:
        q: ``(b, S, H, D)``.
        k: ``(b, S, H_kv, D)``.
        v: ``(b, S, H_kv, D)``.
        causal: causal mask (ignored when ``mask`` is given).
        scale: softmax scale (default ``1/sqrt(D)``).
        mask: an explicit boolean mask, ``(b, 1, S, S)``, True where a query may see a key.

    Returns:
        ``(b, S, H, D)``; differentiable (its backward is the reference backward).
    """
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal and mask is None, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)  # (b, h, s, d) -> (b, s, h, d)


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
    """Rows as an aligned text table (numbers right-aligned, a rule under the header) or a Markdown table.

    Args:
        rows: dicts or dataclass instances.
        columns: the keys to show, in order (default: the first row's).
        fmt: format spec per column (e.g. ``{"ms": ".1f"}``); default ``.6g`` for floats.
        markdown: a Markdown table instead.

    Returns:
        The table; None and NaN show as ``-``.
    """
    plain = [_plain(r) for r in rows]
    columns = list(columns if columns is not None else (plain[0] if plain else []))
    fmt = fmt or {}
    cells = [[_cell(r.get(c), fmt.get(c)) for c in columns] for r in plain]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None or r.get(c) == "-" for r in plain)
               for c in columns]
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


def save_results(path: Optional[str], meta: Union[Mapping[str, Any], argparse.Namespace], rows: Sequence[Any]) -> Path:
    """Write one run as JSON: what ran, where, and its rows.

    Args:
        path: the file; a bare file name goes into ``benchmarks/results/``; empty or None:
            ``benchmarks/results/<benchmark>-<UTC date and time>.json``.
        meta: the run's settings (``args``, or a dict such as ``vars(args)`` with more keys).
        rows: the measurements, dicts or dataclass instances.

    Returns:
        The path written. Besides ``args`` and ``rows`` the file holds the command line, the date, the
        torch and deepspeed versions, the device and the world size.
    """
    meta = vars(meta) if isinstance(meta, argparse.Namespace) else meta
    now = datetime.datetime.now(datetime.timezone.utc)
    target = Path(path) if path else RESULTS / f"{NAME}-{now:%Y%m%d-%H%M%S}.json"
    if path and target.parent == Path("."):
        target = RESULTS / target
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    payload = {"benchmark": NAME, "command": " ".join([Path(sys.executable).name] + sys.argv),
               "date": now.isoformat(timespec="seconds"), "torch": torch.__version__, "deepspeed": ds_version,
               "device": device, "world_size": world,
               "args": {k: v for k, v in meta.items() if k != "local_rank"}, "rows": [_plain(r) for r in rows]}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(_json_safe(payload), indent=1) + "\n")
    return target
