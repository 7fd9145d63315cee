"""Whether an HF model can be trained under sequence parallelism, found from the model itself, not from a list.

:func:`check_model` refuses, by name and before any collective of a step, a model that sequence parallelism would
train silently wrong: a family whose attention does not go through transformers' attention interface, a model built
with another attention implementation than ``"usp"``, one with sequence-mixing layers ds-usp does not shard
(recurrent / state-space / convolution layers it has no path for), or one whose forward takes no ``position_ids``
(it would number each rank's shard from 0). :func:`default_positions` is how a model numbers a full sequence when
it is given no positions (RoBERTa's rule), which :func:`ds_usp.shard_batch` applies before sharding.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Optional

from torch import Tensor, nn

from ds_usp.integration.models.attention import ATTN_NAME, refuse_non_interface_family

# class names of recurrent / state-space / linear-attention layers (those without a sequence convolution, which
# nn.Conv1d catches: Mamba, Gated DeltaNet, short convolutions, RG-LRU blocks)
_MIXER_NAMES = re.compile(r"Mamba|Rwkv|RWKV|Lightning|[Ll]stm|LSTM|Hyena|RetNet|Rglru|RGLRU|DeltaNet|LinearAttention|"
                          r"RecurrentBlock|ShortConv")


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
