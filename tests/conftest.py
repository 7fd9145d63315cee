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
from dist_harness import World  # noqa: E402


@pytest.fixture(scope="module")
def world4():
    """A 4-rank gloo world shared by every test of the module."""
    w = World(4)
    yield w
    w.close()


@pytest.fixture(scope="module")
def world8():
    """An 8-rank gloo world shared by every test of the module."""
    w = World(8)
    yield w
    w.close()
