"""Fault tolerance: when one of 4 ranks dies or stalls mid-training, the others exit with an error
that names the failing collective's group and the training step, within the group timeout.

The job (tests/fault_job.py) runs as 4 plain processes (not under the ``deepspeed`` launcher,
which would kill the survivors itself) with ``usp.timeout_seconds`` = 5.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dist_harness import _free_port

JOB = os.path.join(os.path.dirname(__file__), "fault_job.py")
TIMEOUT_S = 5.0
STARTUP_S = 120.0  # importing torch + deepspeed on 4 ranks of a 2-core machine, then one step


def _launch(mode: str) -> list[subprocess.Popen]:
    port = str(_free_port())
    procs = []
    for rank in range(4):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="4",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="4", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, JOB, mode, str(TIMEOUT_S)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_survivors_exit_with_a_named_error(mode):
    procs = _launch(mode)
    victim, survivors = procs[3], procs[:3]
    start = time.monotonic()
    outputs, ends = {}, {}
    try:
        for rank, p in enumerate(survivors):
            outputs[rank] = p.communicate(timeout=max(1.0, STARTUP_S + 4 * TIMEOUT_S - (time.monotonic() - start)))[0]
            ends[rank] = time.monotonic()
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: survivors still running {STARTUP_S + 4 * TIMEOUT_S:.0f} s after launch (hang)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
    for rank, out in outputs.items():
        assert survivors[rank].returncode != 0, f"rank {rank} exited 0:\n{out}"
        assert "rank %d: step 1 done" % rank in out, out  # the fault came in step 2, not at start-up
        assert "step 2 done" not in out, out
        assert "USPCommError" in out and "over ranks [" in out, out  # the collective and its group
        assert "during training step 2" in out, out  # the step
    # all survivors are out within a few timeouts of each other (no one waits for a dead peer forever)
    assert max(ends.values()) - min(ends.values()) <= 4 * TIMEOUT_S, ends
