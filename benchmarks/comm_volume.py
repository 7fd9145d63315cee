r"""Communication volume (issue 6): bytes each rank sends per USP attention layer, measured vs closed form.

Run (4 CPU ranks over gloo; NCCL when CUDA is available; any world size):

    deepspeed --num_gpus 4 benchmarks/comm_volume.py --seq 2048 --native-op off
    python benchmarks/comm_volume.py --formula-only --world 16 --seq 131072 --heads 32 --kv-heads 8 \
        --head-dim 128 --dtypes bf16
    deepspeed --num_gpus 4 benchmarks/comm_volume.py --seq 2048 --dtypes bf16 --comm-dtype fp8

For every ``(U, R)`` split and every case of the matrix (dtype x kv heads x mask-layout) each rank runs
one forward and backward under :func:`meters.measure_attention`, which counts what it hands to
``torch.distributed`` (``all_to_all_single``: the chunks for the other ranks; ``batch_isend_irecv``:
its ``isend`` tensors; anything else as ``other``, which must be 0). DeepSpeed's comms logger cannot
do this: ds-usp calls ``torch.distributed``, not ``deepspeed.comm``. The closed form is
:func:`ds_usp.cost.forward_bytes` / :func:`ds_usp.cost.backward_bytes` (derived in docs/choosing.md);
the run exits 1 if any rank of any row is more than 1 % off it.
"""
from __future__ import annotations

import datetime
import itertools
import sys
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from _common import (DTYPES, MIB, NATIVE_OP, close_distributed, comma_list, init_distributed, log, parse, parser,
                     random_qkv, save_results, split_refusal, splits, table)
from ds_usp.instruments.meters import measure_attention

MASKS = ("causal-zigzag", "causal-contiguous", "full-zigzag", "full-contiguous")  # mask-layout
TOLERANCE = 0.01


def closed_form(args: Any, seq: int, kv: int, dtype: str, u: int, r: int, layout: str) -> list[float]:
    """``[fwd a2a, fwd ring, bwd a2a, bwd ring]`` bytes per rank, at the length ds-usp pads ``seq`` to."""
    from ds_usp.cost import backward_bytes, forward_bytes
    from ds_usp.sharding import padded_length

    a = (args.batch, padded_length(seq, u, r, layout), args.heads, kv, args.head_dim, u, r,
         torch.empty(0, dtype=DTYPES[dtype]).element_size())
    f, b = forward_bytes(*a, comm_dtype=args.comm_dtype), backward_bytes(*a, comm_dtype=args.comm_dtype)
    return [f.all_to_all, f.ring, b.all_to_all, b.ring]


def formula_table(args: Any) -> str:
    """The closed form for every split of ``--world`` (nothing runs), MiB per rank per layer."""
    dtype, kv = args.dtypes[0], args.kv_heads[0]
    rows = []
    for u, r in splits(args.world):
        skip = split_refusal(args.heads, kv, u)
        v = [x / MIB for x in closed_form(args, args.seq, kv, dtype, u, r, "contiguous")] if not skip else [None] * 4
        total = (lambda *x: None) if skip else (lambda *x: sum(x))
        rows.append({"UxR": f"{u}x{r}", "fwd a2a": v[0], "fwd ring": v[1], "fwd": total(v[0], v[1]), "bwd a2a": v[2],
                     "bwd ring": v[3], "bwd": total(v[2], v[3]), "fwd+bwd": total(*v),
                     "note": skip and f"not possible: {skip}"})
    return (f"closed form per rank per layer (MiB): N={args.world}, b={args.batch}, L={args.seq}, H={args.heads}, "
            f"H_kv={kv}, D={args.head_dim}, {dtype}, comm_dtype={args.comm_dtype}\n"
            + table(rows, fmt={c: ".4f" for c in rows[0] if c not in ("UxR", "note")}))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure every split x case, print the table on rank 0; exit 1 if any row is off by more than 1 %."""
    import ds_usp
    from ds_usp.sharding import padded_length

    p = parser(__doc__, seq=2048, dtype=["fp32", "bf16"], kv_heads_list=True)
    p.add_argument("--masks", type=comma_list(str, MASKS), default=list(MASKS[:3]),
                   help=f"comma-separated, from {', '.join(MASKS)} (default: the first three)")
    p.add_argument("--comm-dtype", default="input", choices=("input", "fp8"), help="usp.comm_dtype (default input)")
    p.add_argument("--formula-only", action="store_true", help="print the closed form only (no ranks needed)")
    p.add_argument("--world", type=int, default=8, help="with --formula-only: N")
    args = parse(p, argv)
    if args.formula_only:
        print(formula_table(args))
        return 0
    device = init_distributed(args.timeout)
    world = dist.get_world_size()
    rows, skipped = [], []
    for u, r in splits(world):
        topo = ds_usp.USPTopology.build(u, r, timeout=datetime.timedelta(seconds=args.timeout))
        for dtype, kv, mask in itertools.product(args.dtypes, args.kv_heads, args.masks):
            if split_refusal(args.heads, kv, u):
                skipped.append(f"{u}x{r} H_kv={kv}: {split_refusal(args.heads, kv, u)}")
                continue
            causal, layout = mask.split("-")
            s_local = padded_length(args.seq, u, r, layout) // (u * r)
            q, k, v, dout = random_qkv(args.batch, s_local, args.heads, kv, args.head_dim, DTYPES[dtype], device,
                                       args.seed + topo.rank)
            fwd, bwd, _ = measure_attention(topo, q, k, v, dout, causal=causal == "causal", layout=layout,
                                            seq_len=args.seq, native_op=NATIVE_OP[args.native_op],
                                            comm_dtype=args.comm_dtype)
            mine = torch.tensor([fwd.all_to_all, fwd.ring, bwd.all_to_all, bwd.ring, fwd.other + bwd.other],
                                dtype=torch.float64, device=device)
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            ranks = [x.cpu().tolist() for x in parts]
            form = closed_form(args, args.seq, kv, dtype, u, r, layout)
            err = [max(abs(x[i] + x[i + 1] - form[i] - form[i + 1]) / max(form[i] + form[i + 1], 1) for x in ranks)
                   for i in (0, 2)]
            worst = max(ranks, key=lambda x: sum(x[:4]))
            ok = max(err) <= TOLERANCE and all(x[4] == 0 for x in ranks)
            rows.append({"UxR": f"{u}x{r}", "dtype": dtype, "H/Hkv": f"{args.heads}/{kv}", "mask-layout": mask,
                         "fwd a2a": worst[0] / MIB, "fwd ring": worst[1] / MIB, "fwd": (worst[0] + worst[1]) / MIB,
                         "fwd form": (form[0] + form[1]) / MIB, "fwd err": err[0], "bwd a2a": worst[2] / MIB,
                         "bwd ring": worst[3] / MIB, "bwd": (worst[2] + worst[3]) / MIB,
                         "bwd form": (form[2] + form[3]) / MIB, "bwd err": err[1],
                         "ranks agree": "yes" if len({tuple(x) for x in ranks}) == 1 else "NO",
                         "ok": "ok" if ok else "FAIL", "per_rank": ranks})
            log(f"{u}x{r} {dtype} H_kv={kv} {mask}: fwd err {err[0]:.1e}, bwd err {err[1]:.1e}")
    ok = all(row["ok"] == "ok" for row in rows)
    if dist.get_rank() == 0:
        cols = [c for c in rows[0] if c != "per_rank"]
        print(f"bytes sent per rank per USP attention layer (MiB, the largest rank; err: the largest relative error "
              f"over the ranks): N={world}, b={args.batch}, S={args.seq}, H={args.heads}, D={args.head_dim}, "
              f"native_op={args.native_op}, comm_dtype={args.comm_dtype}; a2a = Ulysses all-to-alls, ring = the ring's "
              f"isend\n"
              + table(rows, cols, {c: ".4f" for c in cols} | {"fwd err": ".1e", "bwd err": ".1e"}), flush=True)
        for s in skipped:
            print(f"  skipped {s}")
        log(f"every row within {TOLERANCE:.0%} of the closed form, nothing sent by other collectives" if ok else
            f"SOME ROWS more than {TOLERANCE:.0%} off the closed form or sending through other collectives")
        log(f"results written to {save_results(args.json, dict(vars(args), skipped=skipped), rows)}")
    close_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
