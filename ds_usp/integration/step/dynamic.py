"""Dynamic sequence parallelism's training step: the micro batches of one optimizer step's plan, run in one loop.

:mod:`ds_usp.integration.data.dynamic` plans a step's documents (:func:`~ds_usp.integration.data.dynamic.plan_step`)
and gives each rank its shard of every micro batch; this module runs them. :func:`run_micro_batches` is the one loop
over a plan's micro batches, for :func:`dynamic_sp_step` (a DeepSpeed engine of :func:`ds_usp.initialize`) and for
the HF Trainer's training step alike. What differs between the two is passed in: the micro batch's loss, and a
:data:`MicroBackward`, the callback that runs a loss's backward and is told whether this micro batch ends the
gradient accumulation (DeepSpeed's boundary: the gradients are reduced there, and the optimizer steps after it).
:func:`engine_backward` sets that boundary on the engine itself (``set_gradient_accumulation_boundary``);
:func:`accelerator_backward` through accelerate's ``sync_gradients``, which its ``backward`` hands to DeepSpeed (and
on the boundary steps the engine).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ds_usp.integration.data.dynamic import micro_batch_shards, step_targets

# A micro batch's backward: (its loss, whether it ends the gradient accumulation) -> None.
MicroBackward = Callable[[Tensor, bool], None]


def engine_backward(engine: Any) -> MicroBackward:
    """The :data:`MicroBackward` of a DeepSpeed engine: the accumulation boundary set on it, then its backward of the
    loss as it is (already divided by the whole step's targets: not divided again by the accumulation steps).

    Args:
        engine: a DeepSpeed engine (from :func:`ds_usp.initialize` or ``deepspeed.initialize``).

    Returns:
        The callback; the optimizer step is the caller's (``engine.step()`` after the last micro batch).
    """
    def backward(loss: Tensor, last: bool) -> None:
        engine.set_gradient_accumulation_boundary(last)
        engine.backward(loss, scale_wrt_gas=False)

    return backward


def accelerator_backward(accelerator: Any) -> MicroBackward:
    """The :data:`MicroBackward` of an accelerate ``Accelerator`` over DeepSpeed (the HF Trainer's): its
    ``sync_gradients`` set to the boundary, then its ``backward``, which passes that to DeepSpeed and steps the engine
    on the boundary. The caller sets ``sync_gradients`` back to ``True`` after the loop (also when it fails).

    Args:
        accelerator: the Trainer's ``Accelerator``.

    Returns:
        The callback.

    Raises:
        UpstreamChanged: (when called) ``Accelerator.sync_gradients`` has no setter, or its ``backward`` does not pass
            it to DeepSpeed.
    """
    from ds_usp.upstream.accelerate import set_sync_gradients  # its patches register on import: only when used

    def backward(loss: Tensor, last: bool) -> None:
        set_sync_gradients(accelerator, last)
        accelerator.backward(loss)

    return backward


def run_micro_batches(shards: Sequence[Mapping[str, Any]], loss_of: Callable[[Mapping[str, Any]], Tensor],
                      backward: MicroBackward) -> list[Tensor]:
    """Every micro batch of a dynamic-SP step in order: its loss, then its backward, the last one marked as the end of
    the gradient accumulation.

    Args:
        shards: this rank's shard of every micro batch of the plan
            (:func:`~ds_usp.integration.data.dynamic.micro_batch_shards`).
        loss_of: a shard's loss (the model's forward on it, normalized by the whole step's targets).
        backward: runs a loss's backward; its second argument is ``True`` for the last micro batch only.

    Returns:
        The micro batches' losses, detached, in order.
    """
    losses = []
    for k, shard in enumerate(shards):
        loss = loss_of(shard)
        backward(loss, k == len(shards) - 1)
        losses.append(loss.detach())
    return losses


def dynamic_sp_step(engine: Any, documents: Sequence[Mapping[str, Tensor]], tokens_per_rank: int,
                    degrees: Optional[Sequence[int]] = None) -> float:
    """One optimizer step of ``engine`` over ``documents`` with dynamic SP.

    Every rank of the SP group passes the same documents (as the SP group's ranks share a batch); each runs its
    sub-group's row of every micro batch of :func:`~ds_usp.integration.data.dynamic.plan_step`. The loss of each micro
    batch is the sum of its targets' losses over the whole SP group divided by the targets of the whole step; the
    gradients accumulate over the micro batches (DeepSpeed's accumulation boundary on the last) and the engine takes
    one optimizer step: the same update as one process on all the documents.

    Args:
        engine: an engine from :func:`ds_usp.initialize` with ``usp.dynamic_sp`` on.
        documents: the step's documents, each ``input_ids`` and optional ``labels``.
        tokens_per_rank: the most tokens a rank holds of a row.
        degrees: the degrees rows may run at (see :func:`~ds_usp.integration.data.dynamic.plan_step`; ``[sp]``: static
            SP through the same path).

    Returns:
        The step's loss: the token-weighted mean over all documents (the same on every rank).

    Raises:
        ValueError: the engine has no dynamic-SP degrees, or a document does not fit (``plan_step``).
    """
    usp = engine.usp
    shards = micro_batch_shards(usp.topo, usp.layout, documents, tokens_per_rank, degrees)
    targets = torch.tensor(float(max(step_targets(documents), 1)))
    losses = run_micro_batches(shards, lambda shard: engine(**shard, num_items_in_batch=targets).loss,
                               engine_backward(engine))
    engine.step()
    return sum(float(loss) for loss in losses)
