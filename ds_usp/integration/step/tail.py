"""What an HF causal LM does after its decoder that the SP loss must reproduce, measured on the model itself.

* :func:`find_logits_tail`: what the model applies to ``lm_head``'s output before its loss (Granite divides by
  ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2/3 soft-cap with ``final_logit_softcapping``),
  *measured* on the model's own forward with a stand-in decoder: the first candidate from the config that
  reproduces it is the :class:`~ds_usp.integration.step.loss.LogitsTail` the SP loss applies; when none does, the SP
  loss refuses the model by name instead of computing another loss.
* :func:`find_router_aux`: the router's load-balancing loss of an MoE family (``output_router_logits=True``),
  accepted when the family's own ``load_balancing_loss_func`` is the Switch-Transformer formula ds-usp computes
  over the whole SP group (checked numerically on random router logits), refused otherwise.
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ds_usp.integration.step.loss import LogitsTail, gathered, load_balancing_loss
from ds_usp.upstream.torch import replace_forward, restore_forward

# ----------------------------------------------------------------------------------- the logits tail


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
            (:func:`ds_usp.integration.step.forward.decoder_of`).
        head: ``model.get_output_embeddings()``.

    Returns:
        The tail, or None when no candidate reproduces the model's logits (or its forward cannot be probed).
    """
    from transformers.modeling_outputs import MoeModelOutputWithPast


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

            replace_forward(decoder, stand_in)
            try:
                kwargs = {"output_router_logits": False} if "output_router_logits" in inspect.signature(
                    forward).parameters else {}
                out = forward(input_ids=torch.zeros(1, 4, dtype=torch.long, device=h.device), use_cache=False,
                              **kwargs)
            finally:
                restore_forward(decoder)
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
