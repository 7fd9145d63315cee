"""The cost model's view of a diffusion transformer (:class:`ds_usp.cost.ModelShape`) and its token count.

A DiT block is priced as one softmax-attention layer of the model's heads and hidden size with the feed-forward
width of its (image) feed-forward block; there is no vocabulary (``vocab`` 1: the loss is the user's, on the whole
output). Tokens per sample: the latent grid divided by the patch size (``frames x height x width`` of the latent
the transformer is given), plus the text tokens of the joint-attention families.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ds_usp.cost import ModelShape
from ds_usp.integration.models.diffusion.plans import FAMILIES, TEXT, FamilyPlan, plan_of


def feed_forward_modules(block: nn.Module) -> list[nn.Module]:
    """The diffusers ``FeedForward`` blocks inside one transformer block (image and text ones)."""
    from diffusers.models.attention import FeedForward

    return [m for m in block.modules() if isinstance(m, FeedForward)]


def dit_shape(model: nn.Module, plan: Optional[FamilyPlan] = None) -> ModelShape:
    """The cost model's view of a diffusers model (its parameters as they are; ZeRO-3 partitioned ones by their full
    size).

    Raises:
        ValueError: a class ds-usp has no plan for.
    """
    plan = plan or plan_of(model)
    config = model.config
    heads = int(config["num_attention_heads"])
    head_dim = int(config["attention_head_dim"])
    blocks = sum(len(getattr(model, name)) for name in plan.blocks)
    width = 4 * heads * head_dim
    for name in plan.blocks:
        for block in getattr(model, name):
            ffs = feed_forward_modules(block)
            linears = [m for m in (ffs[0].modules() if ffs else ()) if isinstance(m, nn.Linear)]
            if linears:
                width = linears[-1].in_features  # the projection back from the feed-forward width
                break
        else:
            continue
        break
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    return ModelShape(name=type(model).__name__, hidden=heads * head_dim, attention_layers=blocks, heads=heads,
                      kv_heads=heads, head_dim=head_dim, v_head_dim=head_dim, vocab=1, mlp_width=width, params=params,
                      active_params=params, causal=False)


def is_diffusers_config(raw: Mapping[str, Any]) -> bool:
    """Whether a config JSON is a diffusers model's (``_class_name``) rather than a transformers one."""
    return "_class_name" in raw and "model_type" not in raw


def read_diffusers_config(path: str) -> Optional[dict]:
    """A diffusers config from a JSON file or a folder holding ``config.json`` (None: not a diffusers config)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        raw = json.load(f)
    return raw if isinstance(raw, dict) and is_diffusers_config(raw) else None


def model_on_meta(raw: Mapping[str, Any]) -> nn.Module:
    """The diffusers model a config describes, built on the meta device (no memory).

    Raises:
        ValueError: a class diffusers does not have, or one ds-usp has no plan for.
    """
    import diffusers

    name = raw.get("_class_name")
    if name not in FAMILIES:
        raise ValueError(f"{name} is not a diffusion transformer ds-usp shards ({', '.join(sorted(FAMILIES))})")
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ValueError(f"the installed diffusers has no {name}")
    with torch.device("meta"):
        return cls.from_config({k: v for k, v in raw.items() if not k.startswith("_")})


def dit_tokens(raw: Mapping[str, Any], frames: int, height: int, width: int, text: int = 0) -> int:
    """Tokens one sample puts through the blocks: the latent grid ``frames x height x width`` (as the transformer's
    ``hidden_states`` has it; 1 frame for an image model) over the patch size, plus ``text`` tokens in the
    joint-attention families (whose attention sees them; Wan and LTX-Video only cross-attend to the text).

    Raises:
        ValueError: a class ds-usp has no plan for, or a grid smaller than one patch.
    """
    plan = FAMILIES.get(raw.get("_class_name"))
    if plan is None:
        raise ValueError(f"{raw.get('_class_name')} is not a diffusion transformer ds-usp shards "
                         f"({', '.join(sorted(FAMILIES))}): it has no sharding plan")
    patch = raw.get("patch_size", 1) or 1
    patch_t = raw.get("patch_size_t", 1) or 1
    if isinstance(patch, (list, tuple)):  # Wan: (t, h, w)
        patch_t, ph, pw = patch
    else:
        ph = pw = patch
    grid = math.ceil(frames / patch_t) * (height // ph) * (width // pw)
    if grid < 1:
        raise ValueError(f"a latent of {frames} x {height} x {width} is smaller than one patch "
                         f"({patch_t} x {ph} x {pw})")
    joint = any(TEXT in role.order for role in plan.roles.values())
    return grid + (text if joint else 0)
