"""What each HF model family needs beyond its attention layers, found from the model itself, not from a list.

* :func:`check_model`: refuse, by name and before any collective of a step, a model that sequence parallelism
  would train silently wrong: a family whose attention does not go through transformers' attention interface,
  a model built with another attention implementation than ``"usp"``, one with sequence-mixing layers
  ds-usp does not shard (recurrent / state-space / convolution layers it has no path for), or one whose forward
  takes no ``position_ids`` (it would number each rank's shard from 0).
* :func:`find_logits_tail`: what the model applies to ``lm_head``'s output before its loss (Granite divides by
  ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2/3 soft-cap with ``final_logit_softcapping``),
  *measured* on the model's own forward with a stand-in decoder: the first candidate from the config that
  reproduces it is the :class:`LogitsTail` the SP loss applies; when none does, the SP loss refuses the model
  by name instead of computing another loss.
* :func:`find_router_aux`: the router's load-balancing loss of an MoE family (``output_router_logits=True``),
  accepted when the family's own ``load_balancing_loss_func`` is the Switch-Transformer formula ds-usp computes
  over the whole SP group (checked numerically on random router logits), refused otherwise.
* :func:`feed_forward_blocks`: each decoder layer's MLP or MoE block, whatever its attribute name, for tiling.
* :func:`model_shape`: the cost model's view of a model (``ds_usp.cost.ModelShape``), counted on the meta device.
"""
from __future__ import annotations

import inspect
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ds_usp.config import kv_heads_compatible
from ds_usp.cost import ModelShape

ATTN_NAME = "usp"
# class names of recurrent / state-space / linear-attention layers (those without a sequence convolution, which
# nn.Conv1d catches: Mamba, Gated DeltaNet, short convolutions, RG-LRU blocks)
_MIXER_NAMES = re.compile(r"Mamba|Rwkv|RWKV|Lightning|[Ll]stm|LSTM|Hyena|RetNet|Rglru|RGLRU|DeltaNet|LinearAttention|"
                          r"RecurrentBlock|ShortConv")
# attribute names of a decoder layer's feed-forward block: dense MLPs and MoE blocks (Mixtral, Qwen3-MoE, GPT-OSS,
# DeepSeek-V3: mlp; Granite-MoE: block_sparse_moe; Jamba: feed_forward; DBRX: ffn)
FEED_FORWARD_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn", "moe")


# ----------------------------------------------------------------------------------------- the model


def _attn_implementations(config: Any) -> dict[str, Optional[str]]:
    """``config name -> attention implementation`` of a config and its sub-configs that have one."""
    found = {"config": getattr(config, "_attn_implementation", None)}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found[name] = sub._attn_implementation
    return found


def sequence_mixers(model: nn.Module, handled: Callable[[nn.Module], bool]) -> list[str]:
    """Modules that mix tokens along the sequence other than attention, which ds-usp does not shard.

    A causal convolution over the sequence (``nn.Conv1d``) or a module whose class says it is a recurrence or a
    state-space / linear-attention layer (Mamba, DeltaNet, RWKV, lightning / linear attention, RG-LRU...), unless
    ``handled`` says ds-usp wraps it.

    Args:
        model: the model.
        handled: whether a module is wrapped by ds-usp (its linear-attention layers).

    Returns:
        ``"name (Class)"`` of each unhandled one, at most the first few.
    """
    def looks_like(module: nn.Module) -> bool:
        # named like a mixer but not one: transformers' attention modules, which reach the interface (Kimi Linear's
        # MLA layer is KimiLinearAttention), and norms, which are token by token (Mamba2RMSNorm)
        named = _MIXER_NAMES.search(type(module).__name__) and "Norm" not in type(module).__name__ and \
            not (hasattr(module, "is_causal") and hasattr(module, "scaling"))
        return isinstance(module, nn.Conv1d) or bool(named)

    found = []
    skip: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in skip:
            continue
        if handled(module):
            skip.update(id(m) for m in module.modules())
            continue
        if looks_like(module):
            inside = list(module.modules())[1:]
            if any(handled(m) or looks_like(m) for m in inside):
                continue  # a container named after what it holds (xLSTMForCausalLM, OLMo Hybrid's decoder layers)
            found.append(f"{name} ({type(module).__name__})")
            skip.update(id(m) for m in module.modules())
    return found


def check_model(model: nn.Module, handled: Callable[[nn.Module], bool] = lambda m: False) -> None:
    """Refuse an HF model that sequence parallelism would train wrongly (see the module doc).

    Args:
        model: the model given to ``ds_usp.initialize`` with sequence parallelism on.
        handled: whether a module is a sequence mixer ds-usp wraps (its linear-attention layers).

    Raises:
        ValueError: naming the model, what is wrong and what to do.
    """
    from ds_usp.integration.hf import refuse_non_interface_family

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return  # not a transformers model: its attention is the user's (usp_attention / USPAttention)
    name = type(model).__name__
    refuse_non_interface_family(type(model))
    others = {k: v for k, v in _attn_implementations(config).items() if v not in (ATTN_NAME, None)}
    if others and ATTN_NAME not in _attn_implementations(config).values():
        impl = next(iter(others.values()))
        raise ValueError(f"{name} was built with attn_implementation={impl!r}: under sequence parallelism each rank "
                         f"holds a shard of the sequence, and that attention would only see its own shard. Build it "
                         f"with attn_implementation='usp' after ds_usp.hf.register_usp_attention()")
    mixers = sequence_mixers(model, handled)
    if mixers:
        raise ValueError(f"{name} mixes tokens along the sequence outside attention in {', '.join(mixers[:3])}"
                         f"{' ...' if len(mixers) > 3 else ''}, which ds-usp does not shard: each rank would run it "
                         f"on its own shard, restarted at zero. docs/models.md lists the hybrid families ds-usp "
                         f"shards (Gated DeltaNet, Kimi Delta Attention, Mamba-1 and Mamba-2, LFM2's short convolutions, "
                         f"RecurrentGemma's RG-LRU); "
                         f"train this one without sequence parallelism")
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    forward = getattr(getattr(inner, "_orig_mod", inner), "forward", None)  # torch.compile's wrapper
    positional = any("position" in n or "rotary" in n for n, _ in inner.named_modules())  # no positions: Mamba-2
    if callable(forward) and positional and "position_ids" not in inspect.signature(forward).parameters:
        raise ValueError(f"{name}.forward takes no position_ids: the model numbers the tokens it is given from 0 "
                         f"(BART-style decoders), so under sequence parallelism every rank would restart the positions "
                         f"on its shard. Train it without sequence parallelism")


def default_positions(model: Optional[nn.Module]) -> Optional[Callable[[Tensor], Tensor]]:
    """How ``model`` numbers the tokens of a full sequence when it is given no ``position_ids``, or None for ``0..S-1``.

    RoBERTa-style embeddings (an embedding module with ``padding_idx`` and ``create_position_ids_from_input_ids``:
    RoBERTa, XLM-R, CamemBERT, Data2Vec-Text, ...) number real tokens from ``padding_idx + 1`` and give padding
    tokens ``padding_idx``. Every rank holds only a shard, so the positions are computed on the full sequence by
    :func:`ds_usp.shard_batch` with this rule and travel as ``position_ids`` (which the model then uses as given).
    """
    for module in (model.modules() if isinstance(model, nn.Module) else ()):
        make, pad = getattr(module, "create_position_ids_from_input_ids", None), getattr(module, "padding_idx", None)
        if callable(make) and isinstance(pad, int) and hasattr(module, "position_embeddings"):
            return lambda ids: make(ids, pad)
    return None


def feed_forward_blocks(layer: nn.Module) -> list[nn.Module]:
    """The feed-forward blocks (dense MLP or MoE) of a decoder layer, by the attribute names families use.

    Args:
        layer: one decoder layer.

    Returns:
        The blocks found (none for a layer without one).
    """
    return [block for name in FEED_FORWARD_NAMES if isinstance(block := getattr(layer, name, None), nn.Module)]


# ----------------------------------------------------------------------------------- the logits tail


@dataclass(frozen=True)
class LogitsTail:
    """What a causal LM applies to ``lm_head``'s output ``z`` before its loss: ``softcap * tanh(scale z / softcap)``.

    Attributes:
        scale: multiplies the logits (Cohere's ``logit_scale``; ``1 / logits_scaling`` for Granite).
        softcap: the final logit soft-cap (Gemma 2/3's ``final_logit_softcapping``); 0: none.
    """

    scale: float = 1.0
    softcap: float = 0.0

    @property
    def identity(self) -> bool:
        """Nothing is applied."""
        return self.scale == 1.0 and not self.softcap

    def apply(self, z: Tensor) -> Tensor:
        """The model's logits from ``lm_head``'s output (differentiable)."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def _tail_candidates(config: Any) -> list[LogitsTail]:
    """Every tail the config's fields could mean, the identity first."""
    scales = [1.0]
    for key in ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier", "logits_mup_width_multiplier"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value and math.isfinite(value):
            scales += [float(value), 1.0 / float(value)]
    caps = [0.0]
    for key in ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value and value > 0:
            caps.append(float(value))
    return [LogitsTail(scale, cap) for cap in caps for scale in dict.fromkeys(scales)]


def find_logits_tail(model: nn.Module, forward: Callable, decoder: nn.Module, head: nn.Module) -> Optional[LogitsTail]:
    """Measure what ``forward`` (the model's own) applies after ``lm_head``, with ``decoder`` stood in for.

    The stand-in decoder returns hidden states whose logits span magnitudes from 0.01 to 1e4, so that a scale
    and a soft-cap both show; the model's logits are compared with each :func:`_tail_candidates` entry.

    Args:
        model: the causal LM.
        forward: its original ``forward`` (before ds-usp wraps it).
        decoder: the module holding the decoder layers, which ``forward`` calls
            (:func:`ds_usp.integration.memory.decoder_of`).
        head: ``model.get_output_embeddings()``.

    Returns:
        The tail, or None when no candidate reproduces the model's logits (or its forward cannot be probed).
    """
    from transformers.modeling_outputs import MoeModelOutputWithPast

    from ds_usp.integration.loss import gathered

    weight = head.weight
    hidden_size = getattr(model.config, "hidden_size", None) or weight.shape[-1]
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 4, hidden_size, generator=g).to(device=weight.device, dtype=dtype)
    try:
        with gathered([head.weight, getattr(head, "bias", None)]), torch.no_grad():
            base = head(h).float()
            rows = torch.tensor([0.01, 1.0, 100.0, 10000.0], device=h.device)[None, :, None]
            # each row's largest logit: 1, then x 10^k (in the head's dtype: a bf16 model is probed in bf16)
            h = (h * rows / base.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)).to(dtype)
            z = head(h).float()

            def stand_in(*args: Any, **kwargs: Any) -> Any:
                return MoeModelOutputWithPast(last_hidden_state=h)  # a superset of the dense output

            decoder.forward = stand_in
            try:
                kwargs = {"output_router_logits": False} if "output_router_logits" in inspect.signature(
                    forward).parameters else {}
                out = forward(input_ids=torch.zeros(1, 4, dtype=torch.long, device=h.device), use_cache=False,
                              **kwargs)
            finally:
                del decoder.forward
        logits = getattr(out, "logits", None)
    except Exception:  # noqa: BLE001 - a forward we cannot drive this way: the tail is unknown
        return None
    if logits is None or logits.shape != z.shape:
        return None
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for tail in _tail_candidates(model.config):
        want = tail.apply(z)
        if torch.allclose(logits.float(), want, rtol=tol, atol=tol * float(want.abs().max().clamp_min(1e-3))):
            return tail
    return None


# ------------------------------------------------------------------------------- MoE router aux loss


@dataclass(frozen=True)
class RouterAux:
    """An MoE family's load-balancing loss: ``coef * num_experts * sum_e f_e P_e`` over the router logits.

    Attributes:
        num_experts: experts per MoE layer.
        top_k: experts per token.
        coef: the weight it is added to the loss with (``router_aux_loss_coef``).
        default_on: the config's ``output_router_logits`` (the family computes it unless told otherwise).
    """

    num_experts: int
    top_k: int
    coef: float
    default_on: bool


def _first(objects: tuple, names: tuple[str, ...]) -> Any:
    for obj in objects:
        for name in names:
            value = getattr(obj, name, None)
            if value is not None:
                return value
    return None


def find_router_aux(model: nn.Module) -> tuple[Optional[RouterAux], Optional[str]]:
    """The MoE load-balancing loss a causal LM adds with ``output_router_logits=True``, if ds-usp can compute it.

    Args:
        model: the causal LM.

    Returns:
        ``(aux, None)`` when the family has the Switch-Transformer loss ds-usp computes over the SP group (checked
        against the family's own function on random router logits); ``(None, None)`` when the family has no such
        loss; ``(None, reason)`` when it has one ds-usp cannot reproduce.
    """
    if "output_router_logits" not in inspect.signature(type(model).forward).parameters:
        return None, None
    family = sys.modules.get(type(model).__module__)
    reference = getattr(family, "load_balancing_loss_func", None)
    cfg = model.config
    experts = _first((model, cfg), ("num_experts", "num_local_experts", "moe_num_experts"))
    top_k = _first((model, cfg), ("num_experts_per_tok", "top_k", "moe_top_k"))
    coef = _first((model, cfg), ("router_aux_loss_coef", "aux_loss_coef"))
    if reference is None or not isinstance(experts, int) or not isinstance(top_k, int) or coef is None:
        return None, (f"{type(model).__name__} adds a router loss that ds-usp does not recognise (no "
                      f"load_balancing_loss_func with num_experts, num_experts_per_tok and router_aux_loss_coef)")
    from ds_usp.integration.loss import load_balancing_loss

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, experts, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    try:
        same = all(torch.allclose(torch.as_tensor(reference(logits, experts, top_k, m), dtype=torch.float32),
                                  load_balancing_loss(logits, experts, top_k, None if m is None else
                                                      m.reshape(-1).bool(), None), rtol=1e-5, atol=1e-7)
                   for m in (None, mask))
    except Exception:  # noqa: BLE001 - another signature: not the loss ds-usp computes
        same = False
    if not same:
        return None, (f"{type(model).__name__}'s load_balancing_loss_func is not the Switch-Transformer loss "
                      f"ds-usp computes over the sequence-parallel group")
    return RouterAux(experts, top_k, float(coef), bool(getattr(cfg, "output_router_logits", False))), None


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

    from ds_usp.integration.hf import refuse_non_interface_family
    from ds_usp.integration.hybrid import is_linear_attention, is_wrapped_mixer, linear_dims

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


def plan_refusal(shape: ModelShape, u: int, r: int, seq: int) -> Optional[str]:
    """Why ds-usp would refuse the split ``u x r`` for this model and length (None: it would not).

    Args:
        shape: the model.
        u: the Ulysses degree.
        r: the ring degree.
        seq: the sequence length.

    Returns:
        The reason, or None.
    """
    if shape.attention_layers and shape.heads % u:
        return f"{shape.heads} heads not divisible by U={u}"
    if shape.attention_layers and not kv_heads_compatible(shape.kv_heads, u):
        return f"{shape.kv_heads} kv heads incompatible with U={u}"
    if shape.linear_layers and (shape.linear_v_heads % u or (shape.linear_k_heads % u and u % shape.linear_k_heads)):
        return f"linear heads ({shape.linear_k_heads} key, {shape.linear_v_heads} value) incompatible with U={u}"
    if seq < 2 * u * r:
        return f"S={seq} shorter than 2 x U x R = {2 * u * r}"
    return None
