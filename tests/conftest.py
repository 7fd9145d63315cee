"""Shared fixtures: one gloo world per test module (see dist_harness.py).

Without a GPU, ds-usp's Triton kernels run on CPU tensors in Triton's interpreter: ``TRITON_INTERPRET=1``
is set here, before any test imports triton, for this process and the worlds it starts.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
