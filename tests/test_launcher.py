"""The multi-node path, for real: two ``deepspeed`` launchers, one per "node", on one machine.

``deepspeed --no_ssh --num_nodes 2 --node_rank {0,1} --master_addr 127.0.0.1 --master_port P --hostfile H``, with a
hostfile of two host names of 2 slots each (the names are labels: ``--no_ssh`` and ``--master_addr`` mean nothing
resolves or connects to them), start 2 ranks each, the launcher's own multi-node code path (world info, node
ranks, ``LOCAL_SIZE``, ``CROSS_RANK``). The job (tests/multinode_job.py) leaves the degrees to ds-usp: with 2 ranks
per node and 4 heads that is Ulysses 2 inside each node x ring 2 across the nodes, which the job logs; the losses
of 3 steps equal one process's (rtol 1e-5).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

JOB = Path(__file__).resolve().parent / "multinode_job.py"
TIMEOUT_S = 600  # two launchers start 4 ranks that import torch, DeepSpeed and transformers on 2 cores


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_picks_ulysses_inside_nodes(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOB.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["DS_ACCELERATOR"] = "cpu"  # CPU ranks over gloo also on a GPU host (multinode_job.py hides the GPU)
    launchers = [subprocess.Popen(
        ["deepspeed", "--no_ssh", "--num_nodes", "2", "--node_rank", str(node), "--master_addr", "127.0.0.1",
         "--master_port", str(port), "--hostfile", str(hostfile), "--no_local_rank", str(JOB), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    logs = []
    try:
        for proc in launchers:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in launchers:
            proc.kill()
    for node, (proc, log) in enumerate(zip(launchers, logs)):
        assert proc.returncode == 0, f"launcher of node {node} exited {proc.returncode}:\n{log[-4000:]}"
    assert "ulysses_degree=2 x ring_degree=2" in logs[0], logs[0][-3000:]  # logged by rank 0 at start-up
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, rec in enumerate(records):
        node = rank // 2
        assert rec["env"]["LOCAL_SIZE"] == "2" and rec["env"]["CROSS_RANK"] == str(node), rec["env"]
        assert (rec["ulysses"], rec["ring"]) == (2, 2)
        assert rec["ulysses_ranks"] == [2 * node, 2 * node + 1], "the all-to-all must stay inside a node"
        assert rec["ring_ranks"] == [rank % 2, rank % 2 + 2], "the ring crosses the nodes"
        assert rec["losses"] == records[0]["losses"]
    sys.path.insert(0, str(JOB.parent))
    from multinode_job import reference

    torch.testing.assert_close(torch.tensor(records[0]["losses"]), torch.tensor(reference()), rtol=1e-5, atol=1e-6)
