"""ds-usp's changes to TRL's objects: a GRPO / RLOO config's generation batch counted per sequence-parallel group, and
the settings of TRL's fused LM head kept on the model (accelerate's processes seen as the replicas while TRL's code
runs are :mod:`.accelerate`'s)."""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ds_usp.integration.upstream.registry import Patch, refuse, register, require_parameters
from ds_usp.integration.upstream.torch import set_module_attribute

register("generation_batch_per_group", Patch(
    "TRL's GRPOConfig / RLOOConfig.generation_batch_size (a ds-usp RL trainer's args: divided once by the "
    "sequence-parallel size)",
    "the config's __post_init__ counting every rank as a process: generation_batch_size = "
    "per_device_train_batch_size * num_processes * steps_per_generation, num_processes the world size",
    "the ranks of a sequence-parallel group share their prompts: TRL's sampler and rollout would take "
    "sequence_parallel_size times too many prompts per generation",
    "TRL's configs counting the data-parallel replicas (a sequence-parallel size TRL accepts in GRPO and RLOO)"))


register("fused_head_settings", Patch(
    "the model a TRL trainer gives add_fused_lm_head (an attribute of ds-usp's holding the head's settings, set as "
    "the module_attributes record says)",
    "trl.trainer.utils.add_fused_lm_head taking (model, temperature, cast_lm_head_to_fp32) and keeping them only in "
    "the closure of the forward it installs",
    "ds-usp's sharded forward answers TRL's model(..., fused_lm_head=True) on the sequence shards and must apply the "
    "same temperature and float32 cast, which TRL records nowhere ds-usp can read",
    "add_fused_lm_head recording its settings on the model (a fused-head config attribute)"))


_PER_GROUP = "_ds_usp_per_group"  # set on a config whose generation batch was divided (a second trainer: not again)


@functools.cache
def _counts_every_rank(config_class: type) -> bool:
    source = inspect.getsource(config_class.__post_init__)
    return "per_device_train_batch_size * num_processes * self.steps_per_generation" in source


def generation_batch_per_group(args: Any, sp_size: int) -> None:
    """Divide a GRPO / RLOO config's ``generation_batch_size`` by ``sp_size`` (once per config; configs without one,
    such as DPO's, are left alone).

    Args:
        args: the TRL trainer's config.
        sp_size: the sequence-parallel size.

    Raises:
        UpstreamChanged: the config's ``__post_init__`` no longer counts every rank.
    """
    if sp_size <= 1 or not getattr(args, "generation_batch_size", None) or getattr(args, _PER_GROUP, False):
        return
    if not _counts_every_rank(type(args)):
        refuse("generation_batch_per_group", f"{type(args).__name__}.__post_init__ computes generation_batch_size "
                                             f"otherwise")
    args.generation_batch_size //= sp_size  # TRL counted every rank; a batch is per SP group
    setattr(args, _PER_GROUP, True)


def record_fused_head(model: Any, attr: str, settings: Any) -> None:
    """Keep ``settings`` (the temperature and float32 cast TRL gave ``add_fused_lm_head``) as ``model.<attr>``
    (:func:`ds_usp.integration.upstream.torch.set_module_attribute`).

    Raises:
        UpstreamChanged: ``add_fused_lm_head`` takes other parameters.
    """
    from trl.trainer.utils import add_fused_lm_head

    require_parameters("fused_head_settings", add_fused_lm_head, ("model", "temperature", "cast_lm_head_to_fp32"))
    set_module_attribute(model, attr, settings)
