"""The cost model's view of an HF model (:class:`ds_usp.cost.ModelShape`), counted on the meta device, and which
(Ulysses, ring) splits of it the planner and the ``"auto"`` degrees may consider."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from ds_usp.cost import ModelShape
from ds_usp.integration.models.attention import refuse_non_interface_family
from ds_usp.integration.models.checks import sequence_mixers
from ds_usp.integration.models.hybrid import is_linear_attention, is_wrapped_mixer, linear_dims
from ds_usp.splits import kv_heads_compatible, linear_heads_fit, query_heads_fit

# ---------------------------------------------------------------------------------- the model's shape


def model_shape(config: Any, model: Optional[nn.Module] = None) -> ModelShape:
    """The cost model's view of an HF causal LM config, counted on the meta device (or on ``model`` when given:
    its parameters as they are, ZeRO-3 partitioned ones by their full size).

    Raises:
        ValueError: a family ds-usp cannot shard (its attention bypasses the interface, or sequence-mixing layers
            other than attention, Gated DeltaNet, KDA, Mamba-1/2 and short convolutions, or no attention heads at all),
            naming it.
    """
    from transformers import AutoModelForCausalLM


    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if model is None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    refuse_non_interface_family(type(model))
    mixers = sequence_mixers(model, is_wrapped_mixer)
    if mixers:
        raise ValueError(f"{type(model).__name__} has sequence-mixing layers ds-usp does not shard ({mixers[0]}); "
                         f"see docs/models.md")

    def numel(p: Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 partitioned: the full size

    total = sum(numel(p) for p in model.parameters())
    embed = numel(model.get_input_embeddings().weight)
    experts = sum(numel(p) for n, p in model.named_parameters() if ".experts." in n)
    n_experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or \
        getattr(text, "n_routed_experts", None) or 0
    top_k = getattr(text, "num_experts_per_tok", 0) or 0
    active = total - embed - (experts * (1 - top_k / n_experts) if n_experts and experts else 0)
    linear = [m for m in model.modules() if is_linear_attention(m)]
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"{type(model).__name__} has no attention heads (a state-space model): the cost model prices "
                         f"attention layers and cannot plan it; set ulysses_degree and ring_degree yourself")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if getattr(text, "qk_nope_head_dim", None):  # MLA
        head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
    v_dim = getattr(text, "v_head_dim", None) or head_dim
    moe_width = (getattr(text, "moe_intermediate_size", 0) or 0) * top_k
    shared = (getattr(text, "shared_expert_intermediate_size", 0) or 0) + \
        (getattr(text, "n_shared_experts", 0) or 0) * (getattr(text, "moe_intermediate_size", 0) or 0)
    layers = text.num_hidden_layers
    nk, nv, dk, dv = linear_dims(linear[0]) if linear else (0, 0, 0, 0)
    return ModelShape(
        name=type(model).__name__, hidden=text.hidden_size, heads=heads,
        attention_layers=layers - sum(is_wrapped_mixer(m) for m in model.modules()),  # linear ones: linear_layers
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim, v_head_dim=v_dim,
        vocab=text.vocab_size, mlp_width=(moe_width + shared) if moe_width else text.intermediate_size,
        params=total, active_params=int(active), linear_layers=len(linear),
        linear_k_heads=nk, linear_v_heads=nv, linear_k_dim=dk, linear_v_dim=dv,
        conv_kernel=linear[0].conv1d.kernel_size[0] if linear else 4)


def split_refusal(shape: ModelShape, u: int, r: int, seq: int) -> Optional[str]:
    """Why ds-usp would refuse the split ``u x r`` for this model and length (None: it would not); the head rules
    are :mod:`ds_usp.splits`'.

    Args:
        shape: the model.
        u: the Ulysses degree.
        r: the ring degree.
        seq: the sequence length.

    Returns:
        The reason, or None.
    """
    if shape.attention_layers and not query_heads_fit(shape.heads, u):
        return f"{shape.heads} heads not divisible by U={u}"
    if shape.attention_layers and not kv_heads_compatible(shape.kv_heads, u):
        return f"{shape.kv_heads} kv heads incompatible with U={u}"
    if shape.linear_layers and not linear_heads_fit(shape.linear_k_heads, shape.linear_v_heads, u):
        return f"linear heads ({shape.linear_k_heads} key, {shape.linear_v_heads} value) incompatible with U={u}"
    if seq < 2 * u * r:
        return f"S={seq} shorter than 2 x U x R = {2 * u * r}"
    return None


def shape_of(model: Any) -> Optional[ModelShape]:
    """The cost model's view of an HF causal LM (None for another model, or one it cannot describe)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return None
    try:
        return model_shape(config, model)
    except Exception:  # noqa: BLE001 - the cost model is advice: a model it cannot read just goes without
        return None
