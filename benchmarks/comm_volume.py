"""Communication volume of USP attention (issue 6): bytes each rank sends per layer, measured vs closed form.

Run (4 CPU ranks over gloo; NCCL when CUDA is available; 8 ranks work the same way):

    deepspeed --num_gpus 4 benchmarks/comm_volume.py --seq 2048 --heads 8 --head-dim 64

For every ``(U, R)`` split of the world and every case of the matrix (dtype x kv heads x mask/layout)
each rank runs one ``ds_usp.usp_attention`` call forward and backward while :class:`CommCounter`
counts the bytes it hands to ``torch.distributed`` (``all_to_all_single``: the chunks for the other
ranks of the group, not the one it keeps; ``batch_isend_irecv``: the tensors of its ``isend`` ops;
any other collective is counted as ``other`` and should be 0). DeepSpeed's comms logger cannot do
this: ds-usp calls ``torch.distributed`` directly, not ``deepspeed.comm``.

The closed form (per rank, per attention layer; ``b`` batch, ``L`` padded global length,
``N = U*R``, ``e`` bytes per element of q/k/v, ``d_q = H*D``, ``d_kv' = max(H_kv, U)*D``: kv heads
after the GQA replication that the Ulysses all-to-all needs when ``H_kv < U``)::

    forward  = (b L / N) e [ (U-1)/U (2 d_q + 2 d_kv')  +  2 (R-1) d_kv' ]
    backward = (b L / N) [ e (U-1)/U (2 d_q + 2 d_kv')  +  e 2 (R-1) d_kv'  +  4 * 2 R d_kv' [R > 1] ]

Forward: one all-to-all for q, k, v (``d_q + 2 d_kv'`` per token), one for the output (``d_q``);
the ring passes the stacked K/V piece of this Ulysses rank (``U * L/N`` tokens x ``d_kv'/U``) R-1
times. Backward: the output's all-to-all reversed for dout (``d_q``); the ring passes K/V again R-1
times (they are not kept from the forward) and the fp32 dK/dV accumulator of each block R times (it
starts at its owner, visits the R-1 others and comes back home), 4 bytes per element whatever the
input dtype; the q/k/v all-to-all reversed for dq, dk, dv (``d_q + 2 d_kv'``). With ``H_kv >= U``
``d_kv' = d_kv`` and the forward is the issue's formula; :func:`issue_forward_bytes` is that
formula as given. See docs/choosing.md.

``--formula-only`` prints the closed form for any sizes and world without running anything.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACC_BYTES = 4  # the ring backward's dK/dV accumulators are fp32 whatever the input dtype
MASKS = ("causal-zigzag", "causal-contiguous", "full-zigzag", "full-contiguous")  # mask-layout
TOLERANCE = 0.01  # issue 6: measured and closed form agree within 1 %
TAG = "[comm-volume]"


# ------------------------------------------------------------------------------------ closed form


@dataclass(frozen=True)
class Volume:
    """Bytes one rank sends in one direction of one attention layer.

    Attributes:
        all_to_all: through the Ulysses all-to-alls (the chunks for the other U-1 ranks).
        ring: through the ring's point-to-point sends.
        other: through any other collective (0 for USP attention).
    """

    all_to_all: float
    ring: float
    other: float = 0.0

    @property
    def total(self) -> float:
        """All bytes sent."""
        return self.all_to_all + self.ring + self.other


def sent_kv_heads(kv_heads: int, ulysses: int) -> int:
    """KV heads that the Ulysses all-to-all carries per token: ``max(H_kv, U)``.

    When ``U % H_kv == 0`` and ``H_kv < U`` each kv head is replicated ``U / H_kv`` times before the
    all-to-all, so that every Ulysses rank receives the one kv head its query heads use.

    Args:
        kv_heads: H_kv.
        ulysses: U; ``H_kv % U == 0`` or ``U % H_kv == 0`` (what ds-usp accepts).

    Returns:
        ``H_kv`` if U divides it, else ``U``.

    Raises:
        ValueError: neither divides the other.
    """
    if kv_heads % ulysses == 0:
        return kv_heads
    if ulysses % kv_heads == 0:
        return ulysses
    raise ValueError(f"kv heads ({kv_heads}) and U ({ulysses}) must divide one another")


def forward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                  elem_bytes: int) -> Volume:
    """Closed form of the bytes one rank sends in the forward of one USP attention layer.

    Args:
        batch: b.
        seq: L, the padded global sequence length (a multiple of N, of 2N for zigzag).
        heads: H (query heads).
        kv_heads: H_kv.
        head_dim: D.
        ulysses: U.
        ring: R.
        elem_bytes: e, bytes per element of q, k, v (4 fp32, 2 bf16/fp16).

    Returns:
        The :class:`Volume` (exact; floats only because (U-1)/U need not divide).
    """
    tokens = Fraction(batch * seq, ulysses * ring)  # b L / N per rank
    d_q, d_kv = heads * head_dim, sent_kv_heads(kv_heads, ulysses) * head_dim
    a2a = tokens * elem_bytes * Fraction(ulysses - 1, ulysses) * (2 * d_q + 2 * d_kv)
    ring_b = tokens * elem_bytes * 2 * (ring - 1) * d_kv
    return Volume(float(a2a), float(ring_b))


def backward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                   elem_bytes: int, acc_bytes: int = ACC_BYTES) -> Volume:
    """Closed form of the bytes one rank sends in the backward of one USP attention layer.

    Args:
        batch: b.
        seq: L, the padded global sequence length.
        heads: H.
        kv_heads: H_kv.
        head_dim: D.
        ulysses: U.
        ring: R.
        elem_bytes: e.
        acc_bytes: bytes per element of the dK/dV accumulators passed around the ring (4: fp32).

    Returns:
        The :class:`Volume`: all-to-alls for dout and for dq/dk/dv, ring K/V (R-1 hops, e bytes) and
        dK/dV (R hops, ``acc_bytes``); no ring traffic when R = 1.
    """
    tokens = Fraction(batch * seq, ulysses * ring)
    d_q, d_kv = heads * head_dim, sent_kv_heads(kv_heads, ulysses) * head_dim
    a2a = tokens * elem_bytes * Fraction(ulysses - 1, ulysses) * (2 * d_q + 2 * d_kv)
    ring_b = tokens * 2 * d_kv * ((ring - 1) * elem_bytes + ring * acc_bytes) if ring > 1 else 0
    return Volume(float(a2a), float(ring_b))


def issue_forward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                        elem_bytes: int) -> float:
    """The forward formula as issue 6 gives it: ``(b L e / N) ((U-1)/U (2 d_q + 2 d_kv) + 2 (R-1) d_kv)``.

    It has ``d_kv = H_kv * D``, so it undercounts when ``H_kv < U`` (kv heads replicated); otherwise
    it equals :func:`forward_bytes`.

    Returns:
        Bytes per rank.
    """
    n = ulysses * ring
    d_q, d_kv = heads * head_dim, kv_heads * head_dim
    return float(Fraction(batch * seq * elem_bytes, n)
                 * (Fraction(ulysses - 1, ulysses) * (2 * d_q + 2 * d_kv) + 2 * (ring - 1) * d_kv))


def rel_err(measured: float, formula: float) -> float:
    """``|measured - formula| / formula`` (0 when both are 0, inf when only the formula is 0)."""
    if formula == 0:
        return 0.0 if measured == 0 else float("inf")
    return abs(measured - formula) / formula


# ------------------------------------------------------------------------------------ measurement


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter:
    """Count the bytes this rank sends through ``torch.distributed`` while inside :meth:`phase`.

    The functions are wrapped on the ``torch.distributed`` module object, which is where ds-usp looks
    them up (``dist.all_to_all_single``, ``dist.batch_isend_irecv``) at call time; ``isend``/``irecv``
    themselves are left alone because ``batch_isend_irecv`` recognises sends by identity with them.

    * ``all_to_all_single``: the input's chunks for the other ranks (equal splits: ``(W-1)/W`` of it).
    * ``batch_isend_irecv``: the tensors of its ``isend`` ops.
    * anything else (all_gather, all_reduce, broadcast, send, ...): the input's bytes times the
      number of other ranks, as ``other``.
    """

    _OTHER = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor",
              "all_to_all", "send", "gather", "scatter", "reduce", "all_gather_object", "broadcast_object_list")

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self._phase: Optional[str] = None

    def _add(self, kind: str, n: int) -> None:
        if self._phase is None:
            return
        self.counts.setdefault(self._phase, {}).setdefault(kind, 0)
        self.counts[self._phase][kind] += n
        self.calls.setdefault(self._phase, {}).setdefault(kind, 0)
        self.calls[self._phase][kind] += 1

    def volume(self, phase: str) -> Volume:
        """What was counted in ``phase``."""
        c = self.counts.get(phase, {})
        return Volume(c.get("all_to_all", 0), c.get("ring", 0), c.get("other", 0))

    @contextmanager
    def phase(self, phase: str) -> Iterator["CommCounter"]:
        """Count the sends made inside the block under ``phase`` (the wrappers are installed only meanwhile)."""
        saved: dict[str, Any] = {}
        a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            world, me = dist.get_world_size(group), dist.get_rank(group)
            if input_split_sizes is None:
                sent = _nbytes(input) * (world - 1) // world
            else:
                row = _nbytes(input) // max(input.shape[0], 1)
                sent = sum(n for i, n in enumerate(input_split_sizes) if i != me) * row
            self._add("all_to_all", sent)
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def batch_isend_irecv(p2p_op_list):
            for op in p2p_op_list:
                if getattr(op.op, "__name__", "") == "isend":
                    self._add("ring", _nbytes(op.tensor))
            return batch(p2p_op_list)

        def other(name: str, fn: Any) -> Any:
            def wrapped(*args, **kwargs):
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                group = kwargs.get("group")
                peers = dist.get_world_size(group) - 1 if name != "send" else 1
                self._add("other", sum(_nbytes(t) for t in tensors[-1:]) * peers)
                return fn(*args, **kwargs)
            return wrapped

        replacements = {"all_to_all_single": all_to_all_single, "batch_isend_irecv": batch_isend_irecv}
        for fn_name in self._OTHER:
            if hasattr(dist, fn_name):
                replacements[fn_name] = other(fn_name, getattr(dist, fn_name))
        for fn_name, fn in replacements.items():
            saved[fn_name] = getattr(dist, fn_name)
            setattr(dist, fn_name, fn)
        self._phase = phase
        self.counts.setdefault(phase, {})
        try:
            yield self
        finally:
            self._phase = None
            for fn_name, fn in saved.items():
                setattr(dist, fn_name, fn)


@dataclass(frozen=True)
class Case:
    """One attention layer to measure.

    Attributes:
        batch: b.
        seq: real global length (padded by ds-usp to its layout's multiple).
        heads: H.
        kv_heads: H_kv.
        head_dim: D.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        mask: ``"causal-zigzag"``, ``"causal-contiguous"``, ``"full-zigzag"`` or ``"full-contiguous"``.
    """

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    mask: str

    @property
    def causal(self) -> bool:
        """Causal mask."""
        return self.mask.startswith("causal")

    @property
    def layout(self) -> str:
        """Sequence layout."""
        return self.mask.split("-", 1)[1]

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of q/k/v."""
        return torch.empty(0, dtype=DTYPES[self.dtype]).element_size()

    def padded(self, ulysses: int, ring: int) -> int:
        """The global length ds-usp pads to for this split."""
        from ds_usp.sharding import padded_length

        return padded_length(self.seq, ulysses, ring, self.layout)

    def formula(self, ulysses: int, ring: int) -> tuple[Volume, Volume]:
        """Closed-form ``(forward, backward)`` volume per rank for this split."""
        args = (self.batch, self.padded(ulysses, ring), self.heads, self.kv_heads, self.head_dim, ulysses, ring,
                self.elem_bytes)
        return forward_bytes(*args), backward_bytes(*args)

    def issue_formula(self, ulysses: int, ring: int) -> float:
        """The issue's forward formula for this split (``d_kv = H_kv * D``)."""
        return issue_forward_bytes(self.batch, self.padded(ulysses, ring), self.heads, self.kv_heads,
                                   self.head_dim, ulysses, ring, self.elem_bytes)


def measure_layer(topo: Any, case: Case, native_op: Any = False, seed: int = 0, device: str = "cpu",
                  warmup: bool = True) -> tuple[Volume, Volume]:
    """Run one ``usp_attention`` forward and backward on this rank and count what it sends.

    Every rank of ``topo``'s SP group must call it with the same case. The inputs are random local
    shards of the padded length (the volume does not depend on the values). With ``warmup`` one
    uncounted call comes first, so that what is counted is the steady state of a layer (ds-usp may
    check once per input signature that all ranks agree on the shapes, with a small all-gather).

    Args:
        topo: the :class:`ds_usp.USPTopology`.
        case: what to run.
        native_op: ``usp_attention``'s ``native_op`` (same bytes either way).
        seed: input seed.
        device: where the inputs live (``"cpu"`` for gloo, this rank's CUDA device for NCCL).
        warmup: run one uncounted forward+backward first.

    Returns:
        ``(forward, backward)`` :class:`Volume` of this rank.
    """
    import ds_usp

    u, r = topo.ulysses_degree, topo.ring_degree
    s_local = case.padded(u, r) // (u * r)
    g = torch.Generator().manual_seed(seed + topo.rank)
    dtype = DTYPES[case.dtype]

    def randn(h: int) -> torch.Tensor:
        return torch.randn(case.batch, s_local, h, case.head_dim, generator=g).to(device=device, dtype=dtype)

    q, k, v = (randn(h).requires_grad_() for h in (case.heads, case.kv_heads, case.kv_heads))
    dout = randn(case.heads)

    def attn() -> torch.Tensor:
        return ds_usp.usp_attention(q, k, v, topo, causal=case.causal, layout=case.layout, seq_len=case.seq,
                                    native_op=native_op)

    if warmup:
        attn().backward(dout)
    counter = CommCounter()
    with counter.phase("fwd"):
        out = attn()
    with counter.phase("bwd"):
        out.backward(dout)
    return counter.volume("fwd"), counter.volume("bwd")


# ------------------------------------------------------------------------------------ report


@dataclass
class Row:
    """One line of the table: a split and a case, every rank's measurement and the closed form."""

    ulysses: int
    ring: int
    case: Case
    fwd: list[Volume]  # per rank
    bwd: list[Volume]
    fwd_formula: Volume
    bwd_formula: Volume
    issue_fwd: float

    @property
    def fwd_err(self) -> float:
        """Largest relative error over the ranks, forward."""
        return max(rel_err(v.total, self.fwd_formula.total) for v in self.fwd)

    @property
    def bwd_err(self) -> float:
        """Largest relative error over the ranks, backward."""
        return max(rel_err(v.total, self.bwd_formula.total) for v in self.bwd)

    @property
    def ranks_agree(self) -> bool:
        """Every rank sent the same bytes."""
        return len({v.total for v in self.fwd}) == 1 and len({v.total for v in self.bwd}) == 1

    @property
    def ok(self) -> bool:
        """Measured within :data:`TOLERANCE` of the formula on every rank, nothing outside USP's collectives."""
        return (self.fwd_err <= TOLERANCE and self.bwd_err <= TOLERANCE
                and all(v.other == 0 for v in self.fwd + self.bwd))


def splits(world: int) -> list[tuple[int, int]]:
    """Every ``(U, R)`` with ``U * R == world``, Ulysses-heaviest first."""
    return [(world // r, r) for r in range(1, world + 1) if world % r == 0]


def fmt_mib(x: float) -> str:
    """Bytes as MiB with 4 decimals."""
    return f"{x / 2**20:.4f}"


def render(rows: Sequence[Row], world: int, title: str) -> str:
    """The table (all byte columns in MiB per rank per layer)."""
    head = (f"{'UxR':>4} {'dtype':<5} {'H/Hkv':>5} {'mask-layout':<17} {'fwd a2a':>9} {'fwd ring':>9} "
            f"{'fwd meas':>9} {'fwd form':>9} {'rel err':>7} {'bwd a2a':>9} {'bwd ring':>9} {'bwd meas':>9} "
            f"{'bwd form':>9} {'rel err':>7} {'issue fwd':>9} {'ok':>4}")
    lines = [title, head, "-" * len(head)]
    for row in rows:
        f0, b0 = max(row.fwd, key=lambda v: v.total), max(row.bwd, key=lambda v: v.total)
        c = row.case
        lines.append(
            f"{f'{row.ulysses}x{row.ring}':>4} {c.dtype:<5} {f'{c.heads}/{c.kv_heads}':>5} {c.mask:<17} "
            f"{fmt_mib(f0.all_to_all):>9} {fmt_mib(f0.ring):>9} {fmt_mib(f0.total):>9} "
            f"{fmt_mib(row.fwd_formula.total):>9} {row.fwd_err:>7.1e} "
            f"{fmt_mib(b0.all_to_all):>9} {fmt_mib(b0.ring):>9} {fmt_mib(b0.total):>9} "
            f"{fmt_mib(row.bwd_formula.total):>9} {row.bwd_err:>7.1e} {fmt_mib(row.issue_fwd):>9} "
            f"{'ok' if row.ok else 'FAIL':>4}")
    bad = [r for r in rows if not r.ranks_agree]
    lines += [
        "columns: MiB sent by one rank in one attention layer (the largest over the ranks; 'rel err' is the largest",
        "  over the ranks). a2a = Ulysses all-to-alls (chunks for the other U-1 ranks), ring = isend of the ring.",
        "  'issue fwd' = the issue's forward formula with d_kv = H_kv*D (undercounts when H_kv < U: replication).",
        "  every rank sent the same bytes: "
        + ("yes" if not bad else "NO: " + ", ".join(f"{r.ulysses}x{r.ring}" for r in bad)),
        f"  collectives other than all-to-all and ring isend: "
        f"{sum(v.other for r in rows for v in r.fwd + r.bwd):.0f} bytes",
    ]
    return "\n".join(lines)


def formula_table(args: argparse.Namespace) -> str:
    """The closed form for every split of ``args.world`` (no measurement)."""
    e = torch.empty(0, dtype=DTYPES[args.dtypes[0]]).element_size()
    lines = [f"closed form per rank per layer: world N={args.world}, b={args.batch}, L={args.seq}, H={args.heads}, "
             f"H_kv={args.kv_heads[0]}, D={args.head_dim}, {args.dtypes[0]} (e={e}), fp32 ring dK/dV accumulators",
             f"{'UxR':>6} {'fwd a2a':>10} {'fwd ring':>10} {'fwd':>10} {'bwd a2a':>10} {'bwd ring':>10} {'bwd':>10} "
             f"{'fwd+bwd':>10} {'issue fwd':>10}   (MiB)"]
    for u, r in splits(args.world):
        try:
            sent_kv_heads(args.kv_heads[0], u)
        except ValueError as err:
            lines.append(f"{f'{u}x{r}':>6} not possible: {err}")
            continue
        if args.heads % u:
            lines.append(f"{f'{u}x{r}':>6} not possible: H ({args.heads}) not divisible by U ({u})")
            continue
        a = (args.batch, args.seq, args.heads, args.kv_heads[0], args.head_dim, u, r, e)
        f, b = forward_bytes(*a), backward_bytes(*a)
        lines.append(f"{f'{u}x{r}':>6} {fmt_mib(f.all_to_all):>10} {fmt_mib(f.ring):>10} {fmt_mib(f.total):>10} "
                     f"{fmt_mib(b.all_to_all):>10} {fmt_mib(b.ring):>10} {fmt_mib(b.total):>10} "
                     f"{fmt_mib(f.total + b.total):>10} {fmt_mib(issue_forward_bytes(*a)):>10}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description="bytes per rank per USP attention layer, measured vs closed form")
    p.add_argument("--seq", type=int, default=2048, help="global sequence length (padded to the layout's multiple)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated kv head counts to cover (default: H and 2 and 1)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32", "bf16"], help="e.g. fp32,bf16")
    p.add_argument("--masks", type=lambda s: s.split(","), default=["causal-zigzag", "causal-contiguous",
                                                                    "full-zigzag"],
                   help=f"comma-separated, from {', '.join(MASKS)}")
    p.add_argument("--native-op", choices=("off", "auto", "on"), default="off",
                   help="ds-usp's native_op (the packing differs, the bytes must not)")
    p.add_argument("--formula-only", action="store_true", help="print the closed form only (no ranks needed)")
    p.add_argument("--world", type=int, default=8, help="with --formula-only: N")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = sorted({args.heads, 2, 1} & {h for h in range(1, args.heads + 1) if args.heads % h == 0},
                               reverse=True)
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    for m in args.masks:
        if m not in MASKS:
            p.error(f"--masks: {m!r} is not one of {', '.join(MASKS)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure every split x case, print the table on rank 0; non-zero exit if any row disagrees > 1 %."""
    args = parse_args(argv)
    if args.formula_only:
        print(formula_table(args))
        return 0
    import ds_usp
    from ds_usp.attention.ulysses import check_heads

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    # torch.distributed directly (the deepspeed launcher sets RANK, WORLD_SIZE, MASTER_ADDR/PORT): on CPU
    # deepspeed.init_distributed also sets up DeepSpeed's shared-memory all-reduce, whose ~66 MB per rank
    # /dev/shm buffers outlive the run.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    device = "cpu"
    if cuda:
        torch.cuda.set_device(args.local_rank)
        device = f"cuda:{args.local_rank}"
    world, rank = dist.get_world_size(), dist.get_rank()
    native = {"off": False, "auto": "auto", "on": True}[args.native_op]
    cases = [Case(args.batch, args.seq, args.heads, kv, args.head_dim, dt, m)
             for dt, kv, m in itertools.product(args.dtypes, args.kv_heads, args.masks)]
    rows: list[Row] = []
    skipped: list[str] = []
    for u, r in splits(world):
        topo = ds_usp.USPTopology.build(u, r, timeout=datetime.timedelta(seconds=args.timeout))
        for case in cases:
            try:
                check_heads(case.heads, case.kv_heads, u)
            except ValueError as err:
                skipped.append(f"{u}x{r} H={case.heads} H_kv={case.kv_heads}: {err}")
                continue
            fwd, bwd = measure_layer(topo, case, native, device=device)
            mine = torch.tensor([fwd.all_to_all, fwd.ring, fwd.other, bwd.all_to_all, bwd.ring, bwd.other],
                                dtype=torch.float64, device=device)
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            parts = [p.cpu() for p in parts]
            f_form, b_form = case.formula(u, r)
            rows.append(Row(u, r, case, [Volume(*p[:3].tolist()) for p in parts],
                            [Volume(*p[3:].tolist()) for p in parts], f_form, b_form, case.issue_formula(u, r)))
            if rank == 0:
                print(f"{TAG} {u}x{r} {case.dtype} H_kv={case.kv_heads} {case.mask}: fwd err {rows[-1].fwd_err:.1e}, "
                      f"bwd err {rows[-1].bwd_err:.1e}", flush=True)
    ok = all(r.ok for r in rows)
    if rank == 0:
        title = (f"USP attention bytes sent per rank per layer: N={world}, b={args.batch}, S={args.seq}, "
                 f"H={args.heads}, D={args.head_dim}, native_op={args.native_op}; closed form with "
                 f"d_kv' = max(H_kv, U)*D and fp32 ring dK/dV")
        print(render(rows, world, title), flush=True)
        for s in skipped:
            print(f"  skipped {s}")
        verdict = "all rows within" if ok else "SOME ROWS OUTSIDE"
        print(f"{TAG} {verdict} {TOLERANCE:.0%} of the closed form", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
