"""A 4-rank training job in which one rank dies or stalls at a chosen step (run by tests/test_faults.py).

Usage: ``python fault_job.py MODE TIMEOUT_S`` on every rank, with the launcher's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
MODE ``kill``: rank 3 kills itself (SIGKILL) before the forward of step 2; ``stall``: it stops
itself (SIGSTOP) there, so the others can only notice through the process-group timeout.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

VICTIM, FAIL_STEP = 3, 2


class TinyAttention(nn.Module):
    """q/k/v projections around usp_attention, enough to make every step communicate."""

    def __init__(self, topo_holder: dict, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads, self.topo_holder = heads, topo_holder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import ds_usp

        b, s, dim = x.shape
        # (b, s, 3*dim) -> 3 x (b, s, heads, dim/heads)
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, dim // self.heads).unbind(2)
        return ds_usp.usp_attention(q, k, v, self.topo_holder["topo"], causal=True, layout="zigzag")


def main(mode: str, timeout_s: float) -> None:
    import ds_usp

    torch.manual_seed(0)
    holder: dict = {}
    model = TinyAttention(holder)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2},
           "sequence_parallel": "usp", "sequence_parallel_size": 4,
           "usp": {"ulysses_degree": 2, "ring_degree": 2, "timeout_seconds": timeout_s}}
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    topo = holder["topo"] = engine.usp.topo
    for step in range(1, 5):
        x = ds_usp.shard_sequence(torch.randn(1, 32, 16, generator=torch.Generator().manual_seed(step)), topo)
        if topo.rank == VICTIM and step == FAIL_STEP:
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        print(f"rank {topo.rank}: step {step} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
