"""One adapter per model kind, each with the same three steps over the same settings and topology: ``check`` (refuse
what ds-usp cannot shard, by name, before any group exists: the same answer on every rank), ``shard`` (attach the
sequence-parallel attention, from outside) and ``apply_memory`` (the training step's memory features). ``shape``
gives the cost model's view, read when the degrees are left to it.

* :class:`LanguageModelAdapter`: an HF causal LM, a VLM (its vision towers prepared in ``check``), a hybrid model
  (its linear-attention, Mamba and convolution layers wrapped in ``shard``), or no model at all.
* :class:`DiTAdapter`: a diffusers ``ModelMixin``, sharded by its family's plan.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from ds_usp.attention import AttentionRun
from ds_usp.cost import ModelShape
from ds_usp.integration.engine.settings import Settings
from ds_usp.integration.models.attention import USPContext, attach
from ds_usp.integration.models.checks import check_model
from ds_usp.integration.models.diffusion import check_diffusion_model, is_diffusers_model, shard_diffusion_model
from ds_usp.integration.models.diffusion.shape import dit_shape
from ds_usp.integration.models.hybrid import check_hybrid, is_wrapped_mixer, wrap_linear_layers
from ds_usp.integration.models.multimodal import refuse_cross_attention
from ds_usp.integration.models.shape import shape_of
from ds_usp.integration.models.vision import prepare_vision_towers
from ds_usp.integration.step.choices import MemoryContext
from ds_usp.integration.step.dit import apply_dit_memory
from ds_usp.integration.step.forward import apply as apply_memory_features
from ds_usp.topology import USPTopology


@dataclass
class LanguageModelAdapter:
    """An HF causal LM (text, VLM or hybrid), or ``model=None`` (nothing to adapt).

    Attributes:
        model: the model, or None.
    """

    model: Any

    kind = "causal LM"

    def shape(self) -> Optional[ModelShape]:
        """The cost model's view of the model (None without one)."""
        return None if self.model is None else shape_of(self.model)

    def check(self, settings: Settings) -> None:
        """Refuse what cannot be sharded (cross-attention VLMs, unshardable layers, head counts the Ulysses degree
        does not fit); a VLM's vision towers are set up for ``usp.vision_tower``.

        Args:
            settings: the resolved settings.

        Raises:
            ValueError: naming the model, the layer and why.
        """
        if self.model is None or not settings.sharded:
            return
        refuse_cross_attention(self.model)
        prepare_vision_towers(self.model, settings.usp.vision_tower)
        check_model(self.model, handled=is_wrapped_mixer)
        check_hybrid(self.model, settings.usp.ulysses_degree)

    def shard(self, settings: Settings, topo: USPTopology) -> None:
        """Give every attention layer the USP context, and wrap the linear-attention / scan / convolution layers.

        Args:
            settings: the resolved settings.
            topo: the topology.
        """
        if self.model is None:
            return
        usp = settings.usp
        attach(self.model, USPContext(topo=topo, layout=usp.layout, attn_backend=usp.attn_backend,
                                      native_op=usp.native_op, comm_dtype=usp.comm_dtype))
        wrap_linear_layers(self.model)

    def apply_memory(self, settings: Settings, topo: USPTopology) -> Optional[MemoryContext]:
        """The SP loss and the memory features (``"auto"``: the fastest that fit).

        Args:
            settings: the resolved settings.
            topo: the topology.

        Returns:
            The memory context, or None (no model, or not a causal LM).
        """
        if self.model is None:
            return None
        return apply_memory_features(self.model, settings.usp.settings, topo, settings.usp.layout,
                                     zero3=settings.zero_stage == 3, step=settings.step)


@dataclass
class DiTAdapter:
    """A diffusers transformer, sharded after its patch embedding and gathered before its final projection.

    Attributes:
        model: the diffusers ``ModelMixin``.
    """

    model: Any
    _dit: Any = None  # what shard() built, for apply_memory

    kind = "diffusion transformer"

    @functools.cached_property
    def plan(self) -> Any:
        """The family's sharding plan, found once (:func:`check_diffusion_model`: refused by name when none)."""
        return check_diffusion_model(self.model)

    def shape(self) -> ModelShape:
        """The cost model's view of the DiT."""
        return dit_shape(self.model, self.plan)

    def check(self, settings: Settings) -> None:
        """Refuse a family ds-usp has no plan for, and dynamic SP (a sample is one sequence).

        Args:
            settings: the resolved settings.

        Raises:
            ValueError: naming the family or the key.
        """
        self.plan  # noqa: B018 - refused by name here, before any group, when the family has no plan
        if settings.usp.dynamic_sp:
            raise ValueError("usp.dynamic_sp is for packed documents of language models; a diffusion transformer's "
                             "sample is one sequence: set it to false")

    def shard(self, settings: Settings, topo: USPTopology) -> None:
        """Shard the token sequence by the family's plan.

        Args:
            settings: the resolved settings.
            topo: the topology.
        """
        usp = settings.usp
        self._dit = shard_diffusion_model(self.model, topo, AttentionRun("contiguous", usp.attn_backend,
                                                                         usp.native_op, usp.comm_dtype))

    def apply_memory(self, settings: Settings, topo: USPTopology) -> MemoryContext:
        """Per-block checkpointing and tiled feed-forward blocks, chosen per forward.

        Args:
            settings: the resolved settings.
            topo: the topology.

        Returns:
            The memory context.
        """
        return apply_dit_memory(self.model, self.plan, self._dit, settings.usp.settings,
                                topo, zero3=settings.zero_stage == 3)


def adapter_for(model: Any, settings: Settings) -> Any:
    """The adapter of ``model``'s kind: a diffusers model sharded over more than one rank is a DiT; anything else
    (a causal LM, a VLM, a hybrid model, no model) the language-model adapter.

    Args:
        model: the model given to ``initialize`` (may be None).
        settings: the resolved settings.

    Returns:
        A :class:`DiTAdapter` or a :class:`LanguageModelAdapter`.
    """
    if model is not None and settings.sharded and is_diffusers_model(model):
        return DiTAdapter(model)
    return LanguageModelAdapter(model)
