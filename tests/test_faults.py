"""Fault tolerance: when one of 4 ranks dies or stalls mid-training, the others exit with an error
that names the failing collective's group and the training step, within the group timeout.

The job (tests/fault_job.py) runs as 4 plain processes (a ``dist_harness.Job`` that leaves the survivors alone, not
under the ``deepspeed`` launcher, which would kill them itself) with ``usp.timeout_seconds`` = 5.
"""
from __future__ import annotations

import time

import pytest

TIMEOUT_S = 5.0
STARTUP_S = 120.0  # 4 ranks of a 2-core machine building the engine, then one step


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_survivors_exit_with_a_named_error(mode, tmp_path):
    import fault_job
    from dist_harness import Job

    job = Job(fault_job.main, mode, TIMEOUT_S, logdir=str(tmp_path))
    survivors = job.procs[:fault_job.VICTIM]
    start = time.monotonic()
    ends = {}
    try:
        while len(ends) < len(survivors):
            if time.monotonic() - start > STARTUP_S + 4 * TIMEOUT_S:
                pytest.fail(f"{mode}: survivors still running {STARTUP_S + 4 * TIMEOUT_S:.0f} s after launch (hang)")
            for rank, p in enumerate(survivors):
                if rank not in ends and p.exitcode is not None:
                    ends[rank] = time.monotonic()
            time.sleep(0.05)
    finally:
        job.kill()  # the victim (stopped, in "stall")
    for rank, p in enumerate(survivors):
        out = job.output(rank)
        assert p.exitcode != 0, f"rank {rank} exited 0:\n{out}"
        assert "rank %d: step 1 done" % rank in out, out  # the fault came in step 2, not at start-up
        assert "step 2 done" not in out, out
        assert "USPCommError" in out and "over ranks [" in out, out  # the collective and its group
        assert "during training step 2" in out, out  # the step
    # all survivors are out within a few timeouts of each other (no one waits for a dead peer forever)
    assert max(ends.values()) - min(ends.values()) <= 4 * TIMEOUT_S, ends
