"""The safety net: a model under sequence parallelism whose training forward ran no sequence-parallel layer is refused
at its first step, on every rank, by name.

Such a model would run the whole sequence on every rank of the group while DeepSpeed sums the gradients over it:
the loss looks right and the gradients are ``sequence_parallel_size`` times one process's (a diffusers transformer
given to ``ds_usp.initialize`` before ds-usp knew its kind was trained that way). ds-usp's layers count their calls
(:mod:`ds_usp.attention.counter`); a forward hook compares the count before and after the model's first training
forward (grad enabled, ``model.training``), whatever the model's library. A user's own module calling
:func:`ds_usp.usp_attention` counts like ds-usp's integrations do. Every rank runs the same model, so every rank
raises the same error without a collective.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ds_usp.attention.counter import sp_layers_run
from ds_usp.integration.models.attention import context_of


class FirstTrainingForward:
    """The hooks' shared state: the count when the forward began, and whether a training forward was checked."""

    def __init__(self) -> None:
        self.before = 0
        self.done = False

    def begin(self) -> None:
        """A forward of the model starts."""
        self.before = sp_layers_run()

    def checked(self) -> None:
        """A training forward ran sequence-parallel layers: nothing more to check."""
        self.done = True


def install_safety_net(model: nn.Module, sp_size: int) -> None:
    """Refuse, at the model's first training forward, a forward in which no sequence-parallel layer ran.

    Args:
        model: the model given to ``ds_usp.initialize``.
        sp_size: the sequence-parallel size (nothing is installed at 1).
    """
    if sp_size <= 1 or not isinstance(model, nn.Module):
        return
    state = FirstTrainingForward()
    model.register_forward_pre_hook(_before(state))
    model.register_forward_hook(_after(state, sp_size), always_call=False)


def _before(state: FirstTrainingForward) -> Callable:
    def hook(module: nn.Module, args: Any) -> None:
        if not state.done:
            state.begin()
    return hook


def _after(state: FirstTrainingForward, sp_size: int) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if state.done or not (module.training and torch.is_grad_enabled()):
            return
        context = context_of(module)
        if context is not None and context.unsharded:  # ds_usp.hf.unsharded: whole sequences on purpose
            return
        if sp_layers_run() > state.before:
            state.checked()
            return
        raise ValueError(
            f"{type(module).__name__} ran a training forward under sequence parallelism (sequence_parallel_size "
            f"{sp_size}) in which no ds-usp sequence-parallel layer ran: every rank computed its whole sequence while "
            f"DeepSpeed sums the gradients over the group, so they would be {sp_size} times one process's. ds-usp "
            f"expected its attention (or linear-attention) layers to run on each rank's shard. Fix: build a "
            f"transformers model with attn_implementation='usp' after ds_usp.hf.register_usp_attention(); a diffusers "
            f"transformer of a family docs/models.md lists shards itself; in your own modules call "
            f"ds_usp.usp_attention on the shards ds_usp.shard_sequence gives; or train this model without "
            f"sequence parallelism")
    return hook
