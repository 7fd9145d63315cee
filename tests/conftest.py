"""Shared fixtures: one gloo world per test module (see dist_harness.py).

The same suite runs on CPU machines and on GPU hosts:

* ds-usp's Triton kernels run on CPU tensors in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here, before
  any test imports triton (ds-usp still compiles the kernels for CUDA tensors, see ``triton_attn._kernels``);
* on a GPU host this process keeps the GPU for the ``gpu`` tests, and every process it starts (gloo worlds,
  launchers, jobs) sees none: the multi-rank tests are CPU tests over gloo wherever they run.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
if torch.cuda.is_available():
    torch.cuda.init()  # this process's devices are fixed from here on
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # children: CPU ranks

sys.path.insert(0, os.path.dirname(__file__))
# the measuring instruments (benchmarks/meters.py) are shared with the benchmarks (spawned ranks get this sys.path)
_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, _BENCHMARKS)
from dist_harness import World  # noqa: E402


def _world(request, size: int):
    """A world of ``size`` ranks; a module may set ``WORLD_TIMEOUT`` (seconds a case may take, default 180)."""
    w = World(size, timeout=getattr(request.module, "WORLD_TIMEOUT", 180.0))
    yield w
    w.close()


@pytest.fixture(scope="module")
def world2(request):
    """A 2-rank gloo world shared by every test of the module."""
    yield from _world(request, 2)


@pytest.fixture(scope="module")
def world4(request):
    """A 4-rank gloo world shared by every test of the module."""
    yield from _world(request, 4)


@pytest.fixture(scope="module")
def world8(request):
    """An 8-rank gloo world shared by every test of the module."""
    yield from _world(request, 8)
