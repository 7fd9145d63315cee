"""How many sequence-parallel layers have run in this process: the count the safety net reads.

Every entry point that runs a layer over a sharded sequence (:func:`ds_usp.attention.attention`, and the
linear-attention, selective-scan and sharded-convolution entry points of :mod:`ds_usp.linear`) adds one. The training
engine compares the count before and after a model's first training forward: a forward under sequence parallelism in
which none ran trained the whole sequence on every rank while DeepSpeed summed the gradients over the group
(:mod:`ds_usp.integration.models.safety`). A plain count (no process group, no tensor), so it costs nothing and
``torch.compile`` replays its increment as a side effect of the compiled graph.
"""
from __future__ import annotations


class LayerCount:
    """A running count of sequence-parallel layer calls (it only grows)."""

    def __init__(self) -> None:
        self.calls = 0

    def add(self) -> None:
        """One more layer ran."""
        self.calls += 1


SP_LAYERS = LayerCount()


def count_sp_layer() -> None:
    """Count one call of a sequence-parallel layer (every SP entry point calls it once per call)."""
    SP_LAYERS.add()


def sp_layers_run() -> int:
    """The sequence-parallel layer calls this process has made so far."""
    return SP_LAYERS.calls
