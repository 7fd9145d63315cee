"""Hybrid linear attention (issue 24): a Gated DeltaNet layer and a Qwen3.5 step on 4 CPU ranks vs one process.

Run:

    deepspeed --num_gpus 4 --master_port 29693 benchmarks/hybrid.py --seq 4096 --json hybrid.json

For each split of the 4 ranks (4x1, 2x2, 1x4; zigzag):

* ``layer``: one Qwen3.5-text Gated DeltaNet layer (transformers' own torch kernels), forward + backward on the
  sequence, wrapped by ds-usp, against the same layer forward + backward on the whole sequence in one process
  (rank 0 while the others wait). Ranks share the machine's cores, so the comparison is **total work**: the sum
  of the ranks' thread CPU times over the single process's (``work_ratio``; target at 2x2: <= 1.5). Beside it,
  the bytes one rank sends in the layer, measured by ``benchmarks/meters.py``, and the closed form
  ``ds_usp.cost.linear_bytes``.
* ``model``: a whole training step of a tiny Qwen3.5-text model (3 linear layers + 1 softmax layer) through
  ``ds_usp.initialize`` (ZeRO-2), against the same model's step in one process: total work ratio, and the linear
  layers' share of the single process's step (their forward + backward, from the layer rows).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from _common import close_distributed, init_distributed, log, parse, parser, save_results, splits, table, timed

WORK_TARGET = 1.5  # linear layers' SP work / one-process work at 2x2


def _config(hidden: int, heads: int, dim: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                             num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=dim,
                             max_position_embeddings=1 << 20, linear_num_key_heads=heads,
                             linear_num_value_heads=2 * heads, linear_key_head_dim=dim, linear_value_head_dim=dim,
                             layer_types=["linear_attention"] * 3 + ["full_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                              "mrope_section": [dim // 8, dim // 16, dim // 16]})


def _layer(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from ds_usp.integration.models.hybrid import is_gated_deltanet

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return next(m for m in model.modules() if is_gated_deltanet(m))


def _total(timing: Any, ranks: int) -> float:
    """Summed thread CPU time of the ranks (median per rank)."""
    return sum(r[2] for r in timing.ranks[:ranks])


def _model_rows(config: Any, seq: int, args: Any, device: torch.device, world: int, linear_cpu: float) -> list[dict]:
    """A training step of the whole model (ZeRO-2, SGD) per split, and in one process; total work ratios."""
    from transformers import AutoModelForCausalLM

    import ds_usp

    ds_usp.hf.register_usp_attention()
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(args.seed))
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def single() -> None:
        if dist.get_rank() == 0:
            ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    base, _ = timed(single, args.iters, args.warmup, device, only_rank0=True)
    rows = [{"split": "model 1 process", "wall_s": base.wall, "work_ratio": 1.0,
             "linear_share": linear_cpu / base.thread}]
    for u, r in splits(world):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="usp")
        engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "sequence_parallel": "usp",
            "sequence_parallel_size": world, "usp": {"ulysses_degree": u, "ring_degree": r, "native_op": False}})
        shard = ds_usp.shard_batch({"input_ids": ids}, engine.usp.topo, layout=engine.usp.layout)

        def step() -> None:
            engine.backward(engine(**shard).loss)
            engine.step()

        t, _ = timed(step, args.iters, args.warmup, device)
        rows.append({"split": f"model {u}x{r}", "wall_s": t.wall, "work_ratio": _total(t, world) / base.thread})
    return rows


def main() -> None:
    p = parser("Gated DeltaNet under USP vs one process: total work and bytes", seq=4096, dtype=None, heads=4,
               head_dim=32, timing=(3, 1), native_op=False)
    p.add_argument("--hidden", type=int, default=256)
    args = parse(p)
    device = init_distributed(args.timeout)
    import ds_usp
    from ds_usp.cost import linear_bytes
    from ds_usp.integration.models.attention import USPContext, attach
    from ds_usp.instruments.meters import CommCounter
    from ds_usp.integration.models.hybrid import wrap_linear_layers

    world, seq = dist.get_world_size(), args.seq
    config = _config(args.hidden, args.heads, args.head_dim)
    x = torch.randn(1, seq, args.hidden, generator=torch.Generator().manual_seed(args.seed))
    one = _layer(config)

    def single() -> None:
        if dist.get_rank() == 0:
            xr = x.clone().requires_grad_()
            one(xr).sum().backward()

    base, _ = timed(single, args.iters, args.warmup, device, only_rank0=True)
    rows = []
    for u, r in splits(world):
        topo = ds_usp.USPTopology.build(u, r)
        mine = _layer(config)
        attach(mine, USPContext(topo=topo, layout="zigzag", native_op=False))
        wrap_linear_layers(mine)
        shard = ds_usp.shard_sequence(x, topo, dim=1, layout="zigzag")

        def step() -> None:
            xl = shard.clone().requires_grad_()
            mine(xl).sum().backward()

        t, _ = timed(step, args.iters, args.warmup, device)
        counter = CommCounter()
        with counter.phase("fwd"):
            out = mine(shard.clone().requires_grad_())
        with counter.phase("bwd"):
            out.sum().backward()
        segments = 1 if r == 1 else 2
        want = linear_bytes(1, ds_usp.sharding.padded_length(seq, u, r, "zigzag"), args.heads, 2 * args.heads,
                            args.head_dim, args.head_dim, 4, u, r, 4, segments)
        got = counter.volume("fwd"), counter.volume("bwd")
        rows.append({"split": f"{u}x{r}", "wall_s": t.wall, "work_ratio": _total(t, world) / base.thread,
                     "fwd_bytes": got[0].total, "fwd_closed_form": want[0].total, "bwd_bytes": got[1].total,
                     "bwd_closed_form": want[1].total})
    rows += _model_rows(config, seq, args, device, world, 3 * base.thread)
    log(f"one Gated DeltaNet layer, S={seq}, hidden {args.hidden}, {args.heads} k / {2 * args.heads} v heads of "
        f"{args.head_dim}; one process: {base.wall:.2f} s wall, {base.thread:.2f} s CPU")
    log("\n" + table(rows, fmt={"wall_s": ".2f", "work_ratio": ".2f", "fwd_bytes": ".0f", "fwd_closed_form": ".0f",
                                 "bwd_bytes": ".0f", "bwd_closed_form": ".0f", "linear_share": ".2f"}))
    log(f"the linear layers' share of the one-process step: {rows[len(splits(world))]['linear_share']:.2f}")
    two_by_two = next(r for r in rows if r["split"] == "2x2")
    log(f"target: 2x2 linear-layer work <= {WORK_TARGET}x one process: {two_by_two['work_ratio']:.2f} "
        f"({'met' if two_by_two['work_ratio'] <= WORK_TARGET else 'missed'})")
    save_results(args.json, args, rows)
    close_distributed()


if __name__ == "__main__":
    main()
