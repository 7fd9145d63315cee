"""benchmarks/gpu_train.py and benchmarks/gpu_session.sh without a GPU and without training (issue 65's prepared run).

What a GPU session reads from the rows and the report: each step's time and the spread of steps 2 to 4 with a profiled
step left out, the peer configurations without a row at an S named (with why), the attention kernels ds-usp's calls
ran, and every group of device calls inside its 600 s with 60 s to spare, as docs/benchmarks.md lists them.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import gpu_train

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "benchmarks" / "gpu_session.sh"


def _stats(times: list[float], calls: dict | None = None) -> list[tuple]:
    """``_row``'s per-step tuples for steps of these seconds."""
    return [(t, 1.0, 2.0, 0, i == 1, "same", calls) for i, t in enumerate(times)]


def _row(name: str, seq: int, times: list[float], profiled: int | None = None, **extra) -> dict:
    shape = gpu_train.SHAPES["tiny"]
    args = argparse.Namespace(peak_tflops=1000.0)
    row = gpu_train._row(name, seq, _stats(times), 1.0, 10_000, shape, args, None, profiled)
    return dict(row, sweep=f"{name}@1", **extra)


def test_a_row_keeps_every_step_and_the_spread_of_steps_2_to_4():
    row = _row("ds-usp", 16384, [1.28, 0.86, 0.56, 0.55, 0.56])
    assert row["step_times_s"] == [1.28, 0.86, 0.56, 0.55, 0.56]
    assert row["spread_2_4"] == pytest.approx(0.86 / 0.55 - 1)
    assert row["spread"] == pytest.approx(0.86 / 0.55 - 1) and row["steps_timed"] == 4
    assert row["device_allocs_per_step"] == [False, True, False, False, False] and row["choices_per_step"] is None
    assert _row("ds-usp", 16384, [1.0, 0.5, 0.5])["spread_2_4"] is None  # fewer than 4 steps
    # a step under the profiler (--profile-step) stays in the times but out of the median and the spreads
    profiled = _row("ds-usp", 16384, [1.0, 9.0, 0.5, 0.5], profiled=1)
    assert profiled["profiled_step"] == 2 and profiled["step_times_s"][1] == 9.0
    assert profiled["step_s"] == 0.5 and profiled["spread"] == 0 and profiled["spread_2_4"] is None
    assert gpu_train._spread_2_4({"step_times_s": [1.28, 0.86, 0.56, 0.55]}) == pytest.approx(0.86 / 0.55 - 1)


def test_the_report_names_the_peers_without_a_row_and_the_kernels_ds_usp_ran(monkeypatch):
    """The fastest peer is the fastest of those with a row: the others are named, with their sweeps' stops."""
    monkeypatch.setitem(gpu_train.ATTENTION_BACKEND, "ds-usp", "auto(flash_attn_4 > torch)")
    usp = [dict(_row("ds-usp", s, [2.0, 1.0, 1.0]), attn_calls={"flash_attn_4": 56}) for s in (16384, 65536)]
    rows = usp + [
        _row("HF plain", 16384, [3.0, 2.0, 2.0]),
        {"system": "HF plain", "S": 32768, "stopped": gpu_train.STOP_OOM, "note": "out of memory", "sweep": "HF@1"},
        _row("Liger", 16384, [4.0, 3.0, 3.0]),
        {"system": "Liger", "S": 32768, "stopped": gpu_train.STOP_BUDGET, "note": "", "sweep": "Liger@1"},
        _row("ALST full offload", 65536, [9.0, 8.0, 8.0]),
        {"system": "ALST full offload", "S": 131072, "stopped": gpu_train.STOP_END, "note": "", "sweep": "A@1"},
    ]
    text = gpu_train.compare(rows)
    at16 = next(line for line in text.splitlines() if "S=16384: ds-usp 2.00 x" in line)
    assert "the fastest peer of those run (HF plain, Liger), HF plain" in at16 and "met against those run" in at16
    assert "attention: auto(flash_attn_4 > torch) (flash_attn_4 56 calls in a step)" in at16
    missing16 = next(line for line in text.splitlines() if "S=16384: peer configurations with no row" in line)
    assert "ALST full offload (not run at this S)" in missing16 and "Liger all (not run in these rows)" in missing16
    missing64 = next(line for line in text.splitlines() if "S=65536: peer configurations with no row" in line)
    assert "HF plain (out of memory at S=32768)" in missing64
    assert "Liger (its sweep stopped at S=32768: the time budget)" in missing64
    assert "S=65536: ds-usp 8.00 x the fastest peer of those run (ALST full offload)" in text
    # every peer with a row: no qualification
    full = gpu_train.compare([r for r in rows if r["S"] == 16384 and r["system"] in ("ds-usp", "HF plain")] + [
        _row(p, 16384, [5.0, 4.0, 4.0]) for p in gpu_train.PEERS if p != "HF plain"])
    assert "S=16384: ds-usp 2.00 x the fastest peer, HF plain (target >= 1.2: met)" in full
    assert "no row" not in full


def test_attention_calls_are_counted_by_the_kernel_that_ran(monkeypatch):
    """The worker's wrappers count each local attention call by kernel and pass it through unchanged; they are
    undone after the test (monkeypatch restores what it was given)."""
    from ds_usp import kernels
    from ds_usp.kernels import flash_attn4, torch_sdpa

    for module, attr in ((kernels, "_auto_kernels"), (torch_sdpa, "_cuda_use_cudnn"), (torch_sdpa, "_cpu_forward"),
                         (torch_sdpa, "_cpu_backward"), (flash_attn4, "disagreement")):
        monkeypatch.setattr(module, attr, getattr(module, attr))
    monkeypatch.setattr(gpu_train, "ATTENTION_BACKEND", {})
    gpu_train.count_attention_calls("ds-usp", "auto", torch.device("cpu"))
    assert gpu_train.ATTENTION_BACKEND["ds-usp"] == "torch" and gpu_train._attention_backend("ds-usp") == "torch"
    gpu_train.ATTENTION_CALLS.clear()
    q, k, v = (torch.randn(1, 32, h, 8) for h in (4, 2, 2))
    backend = kernels.get_backend("auto", "cpu", torch.float32)
    out, lse = backend.forward(q, k, v, True)
    backend.backward(torch.ones_like(out), q, k, v, out, lse, True, 8 ** -0.5)
    assert gpu_train._attention_calls("ds-usp") == {"cpu": 2}
    assert gpu_train._attention_calls("HF plain") is None  # a peer's rows carry none
    # "auto"'s per-call choice of a faster candidate counts under its name; its device check does not count
    fast = (kernels.AutoCandidate("stand_in", lambda dtype: None, lambda *a: True, torch_sdpa.attention_forward,
                                  torch_sdpa.attention_backward),)
    kernels._auto_forward(fast, q, k, v, True, 8 ** -0.5)
    assert gpu_train._attention_calls("ds-usp") == {"cpu": 3, "stand_in": 1}  # its kernel is the CPU op here


def _plan(*steps: str) -> str:
    done = subprocess.run(["bash", str(SESSION), "/tmp/gpu_session_plan", *steps], capture_output=True, text=True,
                          env=dict(os.environ, PLAN_ONLY="1"), cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_every_issue65_call_leaves_its_slack_and_the_docs_list_its_sums():
    """Each of issue 65's six device calls: its steps' limits plus the setup leave at least 60 s of the 600, and
    docs/benchmarks.md's table of the calls has the same steps and sums."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    for group in "abcdef":
        out = _plan(f"issue65{group}")
        m = re.search(r"steps: (.*) -- limits (\d+) s \+ setup (\d+) s; of a 600 s call that leaves (-?\d+) s", out)
        assert m and int(m[4]) >= 60 and "WARNING" not in out, out
        listed = re.search(rf"^\| `issue65{group}` \| (.*) \| (\d+) s \|$", docs, re.M)
        assert listed and int(listed[2]) == int(m[2]) + int(m[3]), (group, out, listed)
        assert re.findall(r"`(\w+)`", listed[1]) == m[1].split(), (group, m[1], listed[1])
    assert "usp1b" in _plan("issue65f") and "budget3b" in _plan("issue65e")
