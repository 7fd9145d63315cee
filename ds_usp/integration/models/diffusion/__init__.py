"""Diffusion transformers (diffusers ``ModelMixin``) under USP: the user's loop stays the single-process one.

Every rank of a sequence-parallel group calls the model with the same whole inputs and gets the same whole output;
ds-usp cuts the token streams after the patch embedding (:mod:`.plans`, :mod:`.hooks`), runs each self or joint
attention module as the USP attention over the group (:mod:`.routing`, :mod:`.processors`) and gathers the image
tokens before the final projection, whose backward keeps each rank's part of the gradient: every rank computes the
same loss, and DeepSpeed's sum over the group gives one process's gradient. Modules:

* :mod:`.plans`: each family's plan as data (streams, cuts, attention roles, refusals);
* :mod:`.state`: one forward's streams and key masks, the sequence the attention sees;
* :mod:`.hooks`: the plan applied to a model (its forward, the hooks, the routing);
* :mod:`.routing`: the USP attention of one module;
* :mod:`.processors`: ds-usp's processors for CogVideoX and SD3 / SD3.5.
"""
from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ds_usp.attention import AttentionRun
from ds_usp.integration.models.diffusion.hooks import DiTForward, install
from ds_usp.integration.models.diffusion.plans import FAMILIES, FamilyPlan, is_diffusers_model, plan_of
from ds_usp.integration.models.diffusion.state import DiTCall, DiTContext
from ds_usp.upstream.diffusers import route_attention_backends
from ds_usp.upstream.torch import replace_forward
from ds_usp.topology import USPTopology

__all__ = ["FAMILIES", "DiTCall", "DiTContext", "FamilyPlan", "check_diffusion_model", "is_diffusers_model",
           "plan_of", "shard_diffusion_model"]


def check_diffusion_model(model: Any) -> FamilyPlan:
    """Refuse a diffusers model ds-usp cannot shard, before anything is built (the same answer on every rank).

    Args:
        model: a diffusers ``ModelMixin``.

    Returns:
        Its family's plan.

    Raises:
        ValueError: a class without a plan, a configuration the plan refuses, or a model already under diffusers'
            own context or tensor parallelism, naming it and what to do.
    """
    plan = plan_of(model)
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(f"{type(model).__name__} is already under diffusers' own parallelism (enable_parallelism or "
                         f"a parallel_config at load): use ds-usp's sequence parallelism or diffusers', not both")
    return plan


def shard_diffusion_model(model: nn.Module, topo: USPTopology, run: AttentionRun) -> DiTContext:
    """Shard a diffusers model's token sequence over ``topo``'s sequence-parallel group, from outside.

    Args:
        model: the diffusers model (checked by :func:`check_diffusion_model`).
        topo: the topology.
        run: how the attention runs (``usp.attn_backend``, ``native_op``, ``comm_dtype``); its layout is replaced by
            ``"contiguous"``.

    Returns:
        The model's context (its current forward's streams, for the memory stack).

    Raises:
        ValueError: see :func:`check_diffusion_model`, and a module, parameter or processor the plan names that the
            model lacks.
    """
    plan = check_diffusion_model(model)
    dit = DiTContext(topo, AttentionRun("contiguous", run.attn_backend, run.native_op, run.comm_dtype),
                     type(model).__name__)
    route_attention_backends()
    install(model, plan, dit)
    replace_forward(model, functools.wraps(model.forward)(DiTForward(model, model.forward, plan, dit)))
    return dit
