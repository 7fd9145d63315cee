"""Smoke program: read the USP keys of a DeepSpeed config, build the groups, check and print them.

Run: deepspeed --num_gpus 4 examples/smoke_topology.py --deepspeed_config ds_configs/cpu_demo.json
"""
from __future__ import annotations

import argparse

import deepspeed
import torch
import torch.distributed as dist

import ds_usp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    cfg = ds_usp.load_usp_config(args.deepspeed_config, dist.get_world_size())
    topo = ds_usp.USPTopology.build(cfg.ulysses_degree, cfg.ring_degree)
    for group, ranks in ((topo.ulysses_group, topo.ulysses_ranks), (topo.ring_group, topo.ring_ranks),
                         (topo.sp_group, topo.sp_ranks), (topo.dp_group, topo.dp_ranks)):
        t = torch.tensor([float(topo.rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks), f"group {ranks} does not connect its ranks"
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, topo.describe())
    if topo.rank == 0:
        print(f"USP layout from {args.deepspeed_config}: mode={cfg.mode} "
              f"ulysses_degree={cfg.ulysses_degree} ring_degree={cfg.ring_degree} dp={cfg.data_parallel_size}")
        print("\n".join(lines))
        print("all groups checked with an all-reduce: OK")


if __name__ == "__main__":
    main()
