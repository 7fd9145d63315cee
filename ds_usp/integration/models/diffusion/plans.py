"""How each diffusers family is sharded, as data: its token streams, where each tensor is cut into this rank's part,
which attention modules attend over which streams, and what is refused.

A diffusion transformer's blocks see one or two token *streams*: the image / video tokens (``"image"``) and, in the
joint-attention families, the text tokens (``"text"``). Each stream is cut on its own, contiguously, padded at its
end to a multiple of the sequence-parallel size, so every rank holds the same number of tokens of each stream (the
Ulysses all-to-all needs equal shards) and every per-token operation (norms, modulation, feed-forward, QK-norm,
RoPE) runs on the rank's part unchanged. A joint attention module concatenates the rank's parts in the family's
order (``[text, image]`` or ``[image, text]``), so the sequence the USP attention sees is the ranks' local
concatenations one after the other; its padded tokens, and the text a mask leaves out, are keys no query sees
(:func:`ds_usp.usp_attention`'s ``keys``). Non-causal attention does not depend on the order of its keys once RoPE
is inside q and k, so this is exactly the family's attention. Cross-attention to the text (Wan, LTX-Video) is left
alone: the rank's queries meet the whole text, on every rank.

The plans are read from diffusers 0.42's sources (``docs/models.md``'s diffusion section lists them); every parameter
a plan names is checked on the installed classes before a hook is registered
(:func:`ds_usp.upstream.diffusers.check_forward_parameters`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

IMAGE, TEXT = "image", "text"


@dataclass(frozen=True)
class Cut:
    """A tensor (or a tuple of tensors) of which each rank keeps its part of one stream.

    Attributes:
        stream: ``"image"`` or ``"text"``.
        dim: the token dimension.
        ndim: cut only tensors of this many dimensions (others are left whole: Wan's timestep is one per sample,
            or one per token in Wan 2.2 TI2V); None: any.
    """

    stream: str
    dim: int
    ndim: Optional[int] = None


@dataclass(frozen=True)
class RootMask:
    """The model's parameter its blocks' key mask is made from, read once per forward in the model's own forward
    (outside every block: the valid keys of every attention are worked out from it on the host, and each block's mask
    is compared with it on its device, :meth:`~ds_usp.integration.models.diffusion.state.DiTCall.expect_mask`).

    Attributes:
        parameter: the model's ``(b, tokens)`` mask parameter.
        stream: the stream it masks (a block mask's other streams are kept whole).
        form: how the model's forward makes the blocks' mask of it: ``"kept"``, the nonzero entries (QwenImage passes
            it on as bool); ``"prefix"``, a row's first ``sum(row)`` tokens (HunyuanVideo's right padding).
    """

    parameter: str
    stream: str
    form: str


@dataclass(frozen=True)
class Role:
    """An attention module that attends over the rank's part of its streams.

    Attributes:
        order: the streams its processor concatenates, in that order (one stream: self-attention).
        processor: the class name of the family's processor that ds-usp knows (any other is refused).
        usp_processor: ds-usp's processor for it (:mod:`.processors`), for families whose processor calls torch's
            SDPA itself; None: the family's processor, routed
            (:func:`~ds_usp.upstream.diffusers.give_route`).
    """

    order: tuple[str, ...]
    processor: str
    usp_processor: Optional[str] = None


@dataclass(frozen=True)
class FamilyPlan:
    """How one diffusers model class is sharded.

    Module paths are ``""`` (the model), a dotted path (``"rope"``, ``"blocks.0"``) or a block list with ``*``
    (``"transformer_blocks.*"``: every block of it).

    Attributes:
        name: the diffusers class.
        forms: the attention forms, in words (docs and messages).
        inputs: ``path -> {parameter: Cut}``: inputs cut before the module runs.
        outputs: ``path -> (Cut or None per output)``: a module's outputs cut after it ran (RoPE tables).
        key_masks: ``path -> (parameter, streams)``: a boolean key mask the module is given over these streams (in
            this order), its valid keys recorded for the attention and the rank's part handed on.
        mask_root: the model parameter the ``key_masks`` are made from (None: each mask is read where a block is
            first given it).
        prefix_counts: ``path -> (parameter, stream)``: a count of the stream's first tokens (HunyuanVideo's
            first-frame tokens under token_replace) turned into the count among this rank's tokens, where the module
            takes that parameter.
        roles: ``path of attention modules -> Role``.
        blocks: the block lists, in call order (per-block checkpointing wraps their members).
        gather: the module whose output (``(b, tokens, channels)`` of the image stream) is gathered.
        refused: root parameters that must be None, and why.
        lora_kwargs: the root parameter of attention keyword arguments (only its ``"scale"`` is taken).
        refused_config: ``config key -> (refused values, why)``.
    """

    name: str
    forms: str
    inputs: Mapping[str, Mapping[str, Cut]]
    outputs: Mapping[str, tuple[Optional[Cut], ...]] = field(default_factory=dict)
    key_masks: Mapping[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    mask_root: Optional[RootMask] = None
    prefix_counts: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    roles: Mapping[str, Role] = field(default_factory=dict)
    blocks: tuple[str, ...] = ("transformer_blocks",)
    gather: str = "proj_out"
    refused: Mapping[str, str] = field(default_factory=dict)
    lora_kwargs: Optional[str] = None
    refused_config: Mapping[str, tuple[tuple[Any, ...], str]] = field(default_factory=dict)


CONTROLNET = "ControlNet residuals are full-sequence tensors ds-usp does not cut yet; train without them"

FAMILIES: dict[str, FamilyPlan] = {p.name: p for p in (
    FamilyPlan(
        "WanTransformer3DModel", "self-attention over the video (3-D RoPE), cross-attention to the whole text "
        "(and the I2V image tokens); Wan 2.2 TI2V's per-token timestep",
        inputs={"": {"timestep": Cut(IMAGE, 1, ndim=2)}, "blocks.0": {"hidden_states": Cut(IMAGE, 1)}},
        outputs={"rope": (Cut(IMAGE, 1), Cut(IMAGE, 1))},
        roles={"blocks.*.attn1": Role((IMAGE,), "WanAttnProcessor")},
        blocks=("blocks",), lora_kwargs="attention_kwargs"),
    FamilyPlan(
        "FluxTransformer2DModel", "joint attention over [text, image] (3-axis RoPE over both), dual- then "
        "single-stream blocks",
        inputs={"": {"hidden_states": Cut(IMAGE, 1), "encoder_hidden_states": Cut(TEXT, 1),
                     "img_ids": Cut(IMAGE, -2), "txt_ids": Cut(TEXT, -2)}},  # (tokens, 3), or (1, tokens, 3)
        roles={"transformer_blocks.*.attn": Role((TEXT, IMAGE), "FluxAttnProcessor"),
               "single_transformer_blocks.*.attn": Role((TEXT, IMAGE), "FluxAttnProcessor")},
        blocks=("transformer_blocks", "single_transformer_blocks"),
        refused={"controlnet_block_samples": CONTROLNET, "controlnet_single_block_samples": CONTROLNET},
        lora_kwargs="joint_attention_kwargs"),
    FamilyPlan(
        "HunyuanVideoTransformer3DModel", "joint attention over [video, text] with the text's key-padding mask "
        "(3-D RoPE on the video), dual- then single-stream blocks; I2V's token_replace (first-frame tokens)",
        inputs={"transformer_blocks.0": {"hidden_states": Cut(IMAGE, 1), "encoder_hidden_states": Cut(TEXT, 1)}},
        outputs={"rope": (Cut(IMAGE, 0), Cut(IMAGE, 0))},
        key_masks={"transformer_blocks.*": ("attention_mask", (IMAGE, TEXT)),
                   "single_transformer_blocks.*": ("attention_mask", (IMAGE, TEXT))},
        mask_root=RootMask("encoder_attention_mask", TEXT, "prefix"),
        prefix_counts={"transformer_blocks.*": ("num_tokens", IMAGE),
                       "single_transformer_blocks.*": ("num_tokens", IMAGE)},
        roles={"transformer_blocks.*.attn": Role((IMAGE, TEXT), "HunyuanVideoAttnProcessor2_0"),
               "single_transformer_blocks.*.attn": Role((IMAGE, TEXT), "HunyuanVideoAttnProcessor2_0")},
        blocks=("transformer_blocks", "single_transformer_blocks"), lora_kwargs="attention_kwargs"),
    FamilyPlan(
        "LTXVideoTransformer3DModel", "self-attention over the video (fractional 3-D RoPE), cross-attention to "
        "the whole text with its mask; per-token timesteps",
        inputs={"": {"hidden_states": Cut(IMAGE, 1), "timestep": Cut(IMAGE, 1, ndim=2)}},
        outputs={"rope": (Cut(IMAGE, 1), Cut(IMAGE, 1))},
        roles={"transformer_blocks.*.attn1": Role((IMAGE,), "LTXVideoAttnProcessor")},
        lora_kwargs="attention_kwargs"),
    FamilyPlan(
        "CogVideoXTransformer3DModel", "joint attention over [text, video] (3-D RoPE on the video, or sin-cos "
        "positions added before the blocks), through ds-usp's processor",
        inputs={"": {"image_rotary_emb": Cut(IMAGE, 0)},
                "transformer_blocks.0": {"hidden_states": Cut(IMAGE, 1), "encoder_hidden_states": Cut(TEXT, 1)}},
        roles={"transformer_blocks.*.attn1": Role((TEXT, IMAGE), "CogVideoXAttnProcessor2_0", "cogvideox")},
        lora_kwargs="attention_kwargs"),
    FamilyPlan(
        "SD3Transformer2DModel", "joint attention over [image, text] (sin-cos positions before the blocks), "
        "SD3.5's QK-norm and dual image self-attention, through ds-usp's processor",
        inputs={"transformer_blocks.0": {"hidden_states": Cut(IMAGE, 1), "encoder_hidden_states": Cut(TEXT, 1)}},
        roles={"transformer_blocks.*.attn": Role((IMAGE, TEXT), "JointAttnProcessor2_0", "joint"),
               "transformer_blocks.*.attn2": Role((IMAGE,), "JointAttnProcessor2_0", "joint")},
        refused={"block_controlnet_hidden_states": CONTROLNET,
                 "skip_layers": "skipped blocks (a guidance trick of sampling) are not supported under sequence "
                                "parallelism: the first block is where the tokens are cut"},
        lora_kwargs="joint_attention_kwargs"),
    FamilyPlan(
        "QwenImageTransformer2DModel", "joint attention over [text, image] with the text mask (RoPE per stream), "
        "per-token modulation (zero_cond_t)",
        inputs={"transformer_blocks.0": {"hidden_states": Cut(IMAGE, 1), "encoder_hidden_states": Cut(TEXT, 1)},
                "transformer_blocks.*": {"modulate_index": Cut(IMAGE, 1)}},
        outputs={"pos_embed": (Cut(IMAGE, 0), Cut(TEXT, 0))},
        key_masks={"transformer_blocks.*": ("encoder_hidden_states_mask", (TEXT,))},
        mask_root=RootMask("encoder_hidden_states_mask", TEXT, "kept"),
        roles={"transformer_blocks.*.attn": Role((TEXT, IMAGE), "QwenDoubleStreamAttnProcessor2_0")},
        refused={"controlnet_block_samples": CONTROLNET}, lora_kwargs="attention_kwargs"),
)}


def is_diffusers_model(model: Any) -> bool:
    """Whether ``model`` is a diffusers ``ModelMixin`` (without importing diffusers when it is not loaded)."""
    import sys

    mixin = getattr(sys.modules.get("diffusers.models.modeling_utils"), "ModelMixin", None)
    return mixin is not None and isinstance(model, mixin)


def plan_of(model: Any) -> FamilyPlan:
    """The plan of a diffusers model's class.

    Raises:
        ValueError: a class ds-usp has no plan for, or a configuration its plan refuses, naming what to do.
    """
    name = type(model).__name__
    plan = FAMILIES.get(name)
    if plan is None:
        raise ValueError(f"{name} is a diffusers model ds-usp has no sharding plan for: under sequence parallelism "
                         f"every rank would run its whole token sequence while DeepSpeed sums the gradients over the "
                         f"group. ds-usp shards {', '.join(sorted(FAMILIES))} (docs/models.md, Diffusion "
                         f"transformers); train this one without sequence parallelism")
    config = getattr(model, "config", {})
    for key, (values, why) in plan.refused_config.items():
        if config.get(key) in values:
            raise ValueError(f"{name} with {key}={config.get(key)!r}: {why}")
    return plan
