"""Smoke program: read the USP keys of a DeepSpeed config, build the groups, check and print them.

Run: deepspeed --num_gpus 4 examples/smoke_topology.py --deepspeed_config ds_configs/cpu_demo.json

It follows NCCL's rules on every backend: this rank's GPU is chosen and set before distributed starts
(``choose_device``: the launcher's local rank, or the device you set), and every tensor handed to a collective is
made on the device the group's backend moves (``group_device``: this rank's GPU for NCCL, the CPU for gloo), never
on torch's default device. tests/test_startup.py runs it on 4 CPU ranks with torch's default device set to ``meta``,
so that a tensor left on the default device fails there as a CPU tensor fails on NCCL.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import deepspeed
import torch
import torch.distributed as dist

import ds_usp
from ds_usp.comm import all_gather_objects, all_reduce_sum_, group_device, ring_shift
from ds_usp.integration.engine.preflight import choose_device


def check_groups(topo: ds_usp.USPTopology) -> list[str]:
    """Check that each of this rank's groups connects exactly its ranks (an all-reduce of the ranks' numbers per
    group, one exchange around the ring) and gather every rank's layout line.

    Args:
        topo: this rank's topology.

    Returns:
        Every rank's :meth:`~ds_usp.USPTopology.describe` line, in rank order.

    Raises:
        RuntimeError: a group that does not connect its ranks, or a ring that passes another rank's number.
    """
    for kind in ("ulysses", "ring", "sp", "dp", "sp_dp"):
        group, ranks = getattr(topo, f"{kind}_group"), topo.ranks.member_of(kind, topo.rank)
        total = all_reduce_sum_(torch.tensor([float(topo.rank)], device=group_device(group)), group,
                                f"smoke all-reduce of the {kind} group")
        if total.item() != sum(ranks):
            raise RuntimeError(f"the {kind} group {list(ranks)} does not connect its ranks (sum {total.item()})")
    if topo.ring_degree > 1:
        mine = torch.tensor([float(topo.rank)], device=group_device(topo.ring_group))
        got = ring_shift(mine, topo.ring_group, topo.ring_ranks, topo.ring_rank)().item()
        before = topo.ring_ranks[(topo.ring_rank - 1) % topo.ring_degree]
        if got != before:
            raise RuntimeError(f"ring {list(topo.ring_ranks)}: rank {topo.rank} received {got:g}, not rank {before}'s")
    return all_gather_objects(topo.describe(), topo.sp_dp_group, "smoke gather of the layout lines")


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    """Build the groups of ``--deepspeed_config`` on this rank, check them and print the layout (rank 0).

    Args:
        argv: the command line (None: ``sys.argv``).

    Returns:
        Every rank's layout line.
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = parser.parse_args(argv)

    device = choose_device()  # before any CUDA work and before NCCL starts
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    cfg = ds_usp.load_usp_config(args.deepspeed_config, dist.get_world_size())
    topo = ds_usp.USPTopology.build(cfg.ulysses_degree, cfg.ring_degree)
    lines = check_groups(topo)
    if topo.rank == 0:
        print(f"USP layout from {args.deepspeed_config}: mode={cfg.mode} "
              f"ulysses_degree={cfg.ulysses_degree} ring_degree={cfg.ring_degree} dp={cfg.data_parallel_size}")
        print("\n".join(lines))
        print("all groups checked with an all-reduce and the ring with an exchange: OK")
    return lines


if __name__ == "__main__":
    main()
