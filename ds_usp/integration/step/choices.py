"""What one forward call of a long-sequence step does: the ``usp`` memory keys and the choices made from them.

:class:`MemoryContext` is shared by a wrapped model's top-level forward and its layers
(:mod:`ds_usp.integration.step.forward`); :meth:`MemoryContext.make_choices` turns the settings and the tokens a rank
holds into a :class:`StepChoices`: "auto" features turn on when sequence parallelism is on and the sequence is long
enough to need them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ds_usp.comm import all_reduce_max_int
from ds_usp.config import USPSettings
from ds_usp.cost import loss_chunk_rows
from ds_usp.topology import USPTopology

MIB = 2 ** 20
CHECKPOINT_MIN_TOKENS = 2048  # "auto" checkpoints the layers when a rank holds at least this many tokens
OFFLOAD_SHARE = 0.1  # "auto" offloads when the checkpointed hidden states would take this share of the GPU
MLP_LIVE = 6  # tokens x intermediate tensors a tile's backward holds at once (gate, up, act, product, 2 grads)


MemorySettings = USPSettings  # the memory stack reads the "usp" keys of the same names


@dataclass(frozen=True)
class StepChoices:
    """What one forward call does, decided from the tokens per rank (the same on every rank).

    Attributes:
        tokens: tokens this rank holds (batch x local length); the largest over the ranks under ZeRO-3.
        loss_chunk: tokens per logits chunk (0: the loss is not chunked).
        loss_grad_in_forward: take the loss's gradients in its forward (no recompute; holds one
            ``vocab x hidden`` fp32 weight gradient until the backward) instead of recomputing each
            chunk's logits in the backward.
        mlp_tiles: tiles of the MLP (0: not tiled).
        checkpoint: ``"selective"``, ``"full"`` or ``""`` (off).
        offload: move each checkpointed layer input to host memory.
    """

    tokens: int
    loss_chunk: int = 0
    loss_grad_in_forward: bool = False
    mlp_tiles: int = 0
    checkpoint: str = ""
    offload: bool = False


@dataclass
class MemoryContext:
    """What the wrapped model shares between its top-level forward and its layers.

    The topology is the model's current call's (:attr:`topo`: under dynamic SP the degree the batch runs at);
    :attr:`choices` are the features of the current forward call, set by :meth:`choose` when a call starts and by
    :meth:`use` when a checkpointed layer is recomputed with the choices of the call that ran it.
    """

    settings: MemorySettings
    fallback_topo: Optional[USPTopology]
    layout: str
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    zero3: bool
    usp: Any = None  # the model's USPContext (ds_usp.integration.models.attention), whose call state gives the topology
    choices: Optional[StepChoices] = field(default=None)

    @property
    def topo(self) -> Optional[USPTopology]:
        """The topology of the model's current call."""
        return self.usp.topo if self.usp is not None else self.fallback_topo

    def use(self, choices: StepChoices) -> None:
        """Run with ``choices`` (a recomputation: those of the call that ran the layer)."""
        self.choices = choices

    def choose(self, tokens: int, device: torch.device, dtype: torch.dtype) -> StepChoices:
        """Decide and use the features of a forward call over ``tokens`` tokens per rank (:meth:`make_choices`)."""
        self.choices = self.make_choices(tokens, device, dtype)
        return self.choices

    def make_choices(self, tokens: int, device: torch.device, dtype: torch.dtype) -> StepChoices:
        """Decide the features for a forward call over ``tokens`` tokens per rank.

        Args:
            tokens: batch x local sequence length of this rank.
            device: the activations' device.
            dtype: the activations' dtype.

        Returns:
            The choices.
        """
        if self.zero3 and dist.get_world_size() > 1:  # tile counts decide how often ZeRO-3 gathers: agree on them
            tokens = all_reduce_max_int(tokens, self.topo.sp_dp_group, "the tokens per rank of a step",
                                        _group_device(device))
        s, tile = self.settings, self.settings.tile_mib * MIB
        elem = torch.empty(0, dtype=dtype).element_size()
        logits_bytes = tokens * self.vocab * 4
        chunked = s.chunked_loss is True or (s.chunked_loss == "auto" and logits_bytes > tile)
        loss_chunk = loss_chunk_rows(tokens, self.hidden, self.vocab, s.tile_mib) if chunked else 0
        ckpt = s.activation_checkpointing
        if ckpt == "auto":
            ckpt = "selective" if tokens >= CHECKPOINT_MIN_TOKENS else ""
        ckpt = ckpt or ""
        mlp_bytes = tokens * self.intermediate * elem * MLP_LIVE
        tiled = s.tiled_mlp is True or (s.tiled_mlp == "auto" and (bool(ckpt) or mlp_bytes > tile))
        offload = s.offload_activations is True
        if s.offload_activations == "auto" and ckpt and device.type == "cuda":
            held = self.layers * tokens * self.hidden * elem
            offload = held > OFFLOAD_SHARE * torch.cuda.get_device_properties(device).total_memory
        return StepChoices(tokens=tokens, loss_chunk=loss_chunk,
                        loss_grad_in_forward=chunked and self.vocab * self.hidden * 4 <= tile,
                        mlp_tiles=max(1, math.ceil(mlp_bytes / tile)) if tiled else 0, checkpoint=ckpt,
                        offload=bool(offload and ckpt))


def _group_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")
