"""Communication volume of USP attention (issue 6): bytes each rank sends per layer, measured vs closed form.

Run (4 CPU ranks over gloo; NCCL when CUDA is available; 8 ranks work the same way):

    deepspeed --num_gpus 4 benchmarks/comm_volume.py --seq 2048 --heads 8 --head-dim 64

For every ``(U, R)`` split of the world and every case of the matrix (dtype x kv heads x mask/layout)
each rank runs one ``ds_usp.usp_attention`` forward and backward under
:func:`meters.measure_attention` (benchmarks/meters.py), whose meter counts the bytes it hands to ``torch.distributed``
(``all_to_all_single``: the chunks for the other ranks of the group; ``batch_isend_irecv``: the
tensors of its ``isend`` ops; any other collective as ``other``, which should be 0). DeepSpeed's
comms logger cannot do this: ds-usp calls ``torch.distributed`` directly, not ``deepspeed.comm``.

The closed form is :func:`ds_usp.cost.forward_bytes` / :func:`ds_usp.cost.backward_bytes` (derived
there and in docs/choosing.md). The ``issue fwd`` column is issue 6's forward formula as given, with
``d_kv = H_kv * D``: short by the kv replication when ``H_kv < U``.

``--formula-only`` prints the closed form for any sizes and world without running anything.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

import ds_usp
from _common import (DTYPES, MIB, NATIVE_OP, close_distributed, comma_list, init_distributed, log, parse, parser,
                     random_qkv, save_results, split_refusal, splits, table)
from ds_usp.cost import Volume, backward_bytes, forward_bytes
from meters import measure_attention
from ds_usp.sharding import padded_length

MASKS = ("causal-zigzag", "causal-contiguous", "full-zigzag", "full-contiguous")  # mask-layout
TOLERANCE = 0.01  # issue 6: measured and closed form agree within 1 %


def issue_forward_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                        elem_bytes: int) -> float:
    """Issue 6's forward formula as given: ``(b L e / N) ((U-1)/U (2 d_q + 2 d_kv) + 2 (R-1) d_kv)``.

    Returns:
        Bytes per rank; equal to :func:`ds_usp.cost.forward_bytes` unless ``H_kv < U``.
    """
    d_q, d_kv = heads * head_dim, kv_heads * head_dim
    return float(Fraction(batch * seq * elem_bytes, ulysses * ring)
                 * (Fraction(ulysses - 1, ulysses) * (2 * d_q + 2 * d_kv) + 2 * (ring - 1) * d_kv))


def rel_err(measured: float, formula: float) -> float:
    """``|measured - formula| / formula`` (0 when both are 0, inf when only the formula is 0)."""
    if formula == 0:
        return 0.0 if measured == 0 else float("inf")
    return abs(measured - formula) / formula


@dataclass(frozen=True)
class Case:
    """One attention layer to measure: the shared sizes plus a dtype, kv heads and ``mask-layout``."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    mask: str

    def closed_form(self, ulysses: int, ring: int) -> tuple[Volume, Volume, float]:
        """``(forward, backward, issue's forward)`` per rank for this split, at the length ds-usp pads to."""
        padded = padded_length(self.seq, ulysses, ring, self.mask.split("-", 1)[1])
        e = torch.empty(0, dtype=DTYPES[self.dtype]).element_size()
        a = (self.batch, padded, self.heads, self.kv_heads, self.head_dim, ulysses, ring, e)
        return forward_bytes(*a), backward_bytes(*a), issue_forward_bytes(*a)


@dataclass
class Row:
    """One split and case: every rank's measurement and the closed form."""

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

    def cells(self) -> dict[str, Any]:
        """The table's columns (MiB, the largest rank)."""
        f, b = max(self.fwd, key=lambda v: v.total), max(self.bwd, key=lambda v: v.total)
        c = self.case
        return {"UxR": f"{self.ulysses}x{self.ring}", "dtype": c.dtype, "H/Hkv": f"{c.heads}/{c.kv_heads}",
                "mask-layout": c.mask, "fwd a2a": f.all_to_all / MIB, "fwd ring": f.ring / MIB,
                "fwd meas": f.total / MIB, "fwd form": self.fwd_formula.total / MIB, "fwd rel err": self.fwd_err,
                "bwd a2a": b.all_to_all / MIB, "bwd ring": b.ring / MIB, "bwd meas": b.total / MIB,
                "bwd form": self.bwd_formula.total / MIB, "bwd rel err": self.bwd_err,
                "issue fwd": self.issue_fwd / MIB, "ok": "ok" if self.ok else "FAIL"}


def measure(topo: Any, case: Case, native_op: Any, device: torch.device, seed: int) -> tuple[Volume, Volume]:
    """This rank's ``(forward, backward)`` bytes for one case: random shards of the padded length, one
    unmetered call first (ds-usp checks each new input signature once, with a small all-gather)."""
    u, r = topo.ulysses_degree, topo.ring_degree
    layout = case.mask.split("-", 1)[1]
    s_local = padded_length(case.seq, u, r, layout) // (u * r)
    q, k, v, dout = random_qkv(case.batch, s_local, case.heads, case.kv_heads, case.head_dim, DTYPES[case.dtype],
                               device, seed + topo.rank)
    fwd, bwd, _ = measure_attention(topo, q, k, v, dout, causal=case.mask.startswith("causal"), layout=layout,
                                    seq_len=case.seq, native_op=native_op)
    return fwd, bwd


def formula_table(args: argparse.Namespace) -> str:
    """The closed form for every split of ``--world`` (no measurement), MiB per rank per layer."""
    dtype, kv = args.dtypes[0], args.kv_heads[0]
    cols = ["UxR", "fwd a2a", "fwd ring", "fwd", "bwd a2a", "bwd ring", "bwd", "fwd+bwd", "issue fwd", "note"]
    rows = []
    for u, r in splits(args.world):
        skip = split_refusal(args.heads, kv, u)
        if skip:
            rows.append({"UxR": f"{u}x{r}", "note": f"not possible: {skip}"})
            continue
        f, b, issue = Case(args.batch, args.seq, args.heads, kv, args.head_dim, dtype, "full-contiguous"
                           ).closed_form(u, r)
        rows.append(dict(zip(cols, [f"{u}x{r}", f.all_to_all / MIB, f.ring / MIB, f.total / MIB, b.all_to_all / MIB,
                                    b.ring / MIB, b.total / MIB, (f.total + b.total) / MIB, issue / MIB])))
    return (f"closed form per rank per layer (MiB): world N={args.world}, b={args.batch}, L={args.seq}, "
            f"H={args.heads}, H_kv={kv}, D={args.head_dim}, {dtype}, fp32 ring dK/dV accumulators\n"
            + table(rows, cols, {c: ".4f" for c in cols}))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The shared flags (``--dtypes`` and ``--kv-heads`` as lists) and the matrix's masks."""
    p = parser("bytes per rank per USP attention layer, measured vs closed form", seq=2048,
               dtype=["fp32", "bf16"], kv_heads_list=True)
    p.add_argument("--masks", type=comma_list(str, MASKS), default=list(MASKS[:3]),
                   help=f"comma-separated, from {', '.join(MASKS)} (default: the first three)")
    p.add_argument("--formula-only", action="store_true", help="print the closed form only (no ranks needed)")
    p.add_argument("--world", type=int, default=8, help="with --formula-only: N")
    return parse(p, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure every split x case, print the table on rank 0; non-zero exit if any row is off by > 1 %."""
    args = parse_args(argv)
    if args.formula_only:
        print(formula_table(args))
        return 0
    device = init_distributed(args.timeout)
    world = dist.get_world_size()
    cases = [Case(args.batch, args.seq, args.heads, kv, args.head_dim, dt, m)
             for dt, kv, m in itertools.product(args.dtypes, args.kv_heads, args.masks)]
    rows: list[Row] = []
    skipped: list[str] = []
    for u, r in splits(world):
        topo = ds_usp.USPTopology.build(u, r, timeout=datetime.timedelta(seconds=args.timeout))
        for case in cases:
            skip = split_refusal(case.heads, case.kv_heads, u)
            if skip:
                skipped.append(f"{u}x{r} H={case.heads} H_kv={case.kv_heads}: {skip}")
                continue
            fwd, bwd = measure(topo, case, NATIVE_OP[args.native_op], device, args.seed)
            mine = torch.tensor([fwd.all_to_all, fwd.ring, fwd.other, bwd.all_to_all, bwd.ring, bwd.other],
                                dtype=torch.float64, device=device)
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            ranks = [p.cpu().tolist() for p in parts]
            rows.append(Row(u, r, case, [Volume(*p[:3]) for p in ranks], [Volume(*p[3:]) for p in ranks],
                            *case.closed_form(u, r)))
            log(f"{u}x{r} {case.dtype} H_kv={case.kv_heads} {case.mask}: fwd err {rows[-1].fwd_err:.1e}, "
                f"bwd err {rows[-1].bwd_err:.1e}")
    ok = all(r.ok for r in rows)
    if dist.get_rank() == 0:
        cells = [r.cells() for r in rows]
        fmt = {c: ".4f" for c in cells[0]} | {"fwd rel err": ".1e", "bwd rel err": ".1e"}
        disagree = [f"{r.ulysses}x{r.ring}" for r in rows if not r.ranks_agree]
        print(f"USP attention bytes sent per rank per layer: N={world}, b={args.batch}, S={args.seq}, H={args.heads}, "
              f"D={args.head_dim}, native_op={args.native_op}; closed form with d_kv' = max(H_kv, U)*D and fp32 "
              f"ring dK/dV\n{table(cells, fmt=fmt)}\n"
              "columns: MiB sent by one rank in one attention layer (the largest over the ranks; 'rel err' is the\n"
              "  largest over the ranks). a2a = Ulysses all-to-alls (chunks for the other U-1 ranks), ring = isend of\n"
              "  the ring. 'issue fwd' = the issue's forward formula with d_kv = H_kv*D (undercounts when H_kv < U).\n"
              f"  every rank sent the same bytes: {'yes' if not disagree else 'NO: ' + ', '.join(disagree)}\n"
              f"  collectives other than all-to-all and ring isend: "
              f"{sum(v.other for r in rows for v in r.fwd + r.bwd):.0f} bytes", flush=True)
        for s in skipped:
            print(f"  skipped {s}")
        log(f"{'all rows within' if ok else 'SOME ROWS OUTSIDE'} {TOLERANCE:.0%} of the closed form")
        per_rank = [dict(r.cells(), fwd_per_rank=r.fwd, bwd_per_rank=r.bwd) for r in rows]
        log(f"results written to {save_results(args.json, dict(vars(args), skipped=skipped), per_rank)}")
    close_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
