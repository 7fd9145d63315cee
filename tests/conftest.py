"""Shared fixtures: one gloo world per test module (see dist_harness.py)."""
from __future__ import annotations

import os
import sys

import pytest

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
