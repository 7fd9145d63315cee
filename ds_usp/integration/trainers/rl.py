"""TRL's GRPO, RLOO and DPO trainers with USP: an import and a class name.

    from ds_usp import USPGRPOTrainer        # instead of: from trl import GRPOTrainer (same for RLOO, DPO)
    trainer = USPGRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(..., deepspeed="ds.json"), ...)

The model is built with ``attn_implementation="usp"`` and the DeepSpeed JSON sets ``"sequence_parallel": "usp"``, as
for :class:`ds_usp.USPTrainer`; without ``"sequence_parallel"`` these are TRL's trainers. What sequence parallelism
changes, in one place for the three trainers (:class:`USPRLMixin`); each TRL trainer keeps its own losses:

* **the same samples on every rank of an SP group**: the loaders split prompts (and preference pairs) over replicas
  only; every rank of a group runs the rollout (generation, ``rollout_func``, tools, environments: under ZeRO-3 every
  rank must take part in the parameter gathers), on whole sequences without USP (:func:`ds_usp.hf.unsharded`), and
  the group's first rank's rollouts are kept by all; after scoring, the group checks that its ranks hold the same
  batch (prompts, completions, rewards, advantages) and refuses otherwise, naming what differs;
* **log-probs at length**: TRL's fused LM head call ``model(..., labels=..., fused_lm_head=True)`` (policy, old policy,
  reference model) runs each rank on its shard of the sequence, through ``lm_head`` chunk by chunk with TRL's
  temperature, and gathers the per-token results over the group
  (:func:`ds_usp.integration.step.logprobs.fused_forward`), left-padded prompts and right-padded completions exact;
* **losses and metrics**: TRL's own code on those whole per-token tensors, identical on the ranks of a group, with
  accelerate's processes seen as the data-parallel replicas while it runs
  (:func:`ds_usp.integration.upstream.accelerate.replicas_view`), so rewards, advantages, every ``loss_type``
  normalisation and every logged metric count each sample once; DeepSpeed sums the group's gradient shares.

Refused by name before any step: vLLM generation, paged generation, Liger kernels, ``compute_loss_func``, DPO's
``padding_free`` and ``precompute_ref_log_probs``, and hybrid (linear-attention / SSM) models.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ds_usp.comm import all_gather_objects, disagreements
from ds_usp.integration.engine.preflight import installed_version
from ds_usp.integration.models.attention import unsharded
from ds_usp.integration.models.hybrid import is_wrapped_mixer
from ds_usp.integration.step.logprobs import FUSED_HEAD_ATTR, FusedHead
from ds_usp.integration.trainers.trainer import USPTrainerBase
from ds_usp.integration.upstream.accelerate import replicas_view
from ds_usp.integration.upstream.trl import generation_batch_per_group, record_fused_head


def _refusals(trainer_name: str, args: Any, kwargs: dict) -> list[str]:
    """What this trainer's arguments ask for that sequence parallelism does not do (each named)."""
    found = []
    if getattr(args, "use_vllm", False):
        found.append(f"use_vllm=True (vLLM {getattr(args, 'vllm_mode', '')} mode: its engine generates and scores "
                     f"whole sequences outside ds-usp's groups; generate with the model instead, or give a "
                     f"rollout_func)")
    if getattr(args, "use_transformers_paged", False):
        found.append("use_transformers_paged=True (paged generation replaces the attention implementation)")
    if getattr(args, "use_liger_kernel", False) or getattr(args, "liger_kernel_config", None):
        found.append("Liger kernels (use_liger_kernel / liger_kernel_config replace the model's forward and loss)")
    if kwargs.get("compute_loss_func") is not None:
        found.append("compute_loss_func (it would read whole logits, which the sharded forward never builds)")
    if getattr(args, "padding_free", False):
        found.append("padding_free=True (rows packed without their documents; pad them as TRL does by default)")
    if getattr(args, "precompute_ref_log_probs", False):
        found.append("precompute_ref_log_probs=True (its loader is split over every rank before ds-usp's groups "
                     "exist; keep a live reference model)")
    return [f"{trainer_name}: {what} is not supported with \"sequence_parallel\"" for what in found]


class USPRLMixin(USPTrainerBase):
    """What turns TRL's GRPO / RLOO / DPO trainer into a USP one; see the module docstring."""

    _trl_modules: tuple = ()  # TRL modules whose imported gather / gather_object the replicas view replaces

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        trl_args = bound.get("args")
        config = getattr(getattr(trl_args, "hf_deepspeed_config", None), "config", None) or {}
        usp_config = self._read_usp_config(config, trl_args.world_size if trl_args is not None else 1)
        if usp_config.enabled:
            problems = _refusals(type(self).__name__, trl_args, bound)
            if problems:
                raise ValueError("; ".join(problems))
            generation_batch_per_group(trl_args, usp_config.sequence_parallel_size)
        super().__init__(*args, **kwargs)
        if not usp_config.enabled:
            return
        models = [m for m in (self.model, getattr(self, "ref_model", None)) if m is not None]
        for model in models:
            module = getattr(model, "module", model)  # a reference model TRL already wrapped in an engine
            base = module.get_base_model() if hasattr(module, "get_base_model") else module  # PEFT
            hybrid = sorted({type(m).__name__ for m in base.modules() if is_wrapped_mixer(m)})
            if hybrid:
                raise ValueError(f"{type(self).__name__}: {type(base).__name__} mixes tokens with {', '.join(hybrid)} "
                                 f"(linear attention / state-space layers): generating with it while its layers are "
                                 f"sharded is not supported under \"sequence_parallel\"; train it with "
                                 f"ds_usp.USPSFTTrainer, or this trainer without sequence parallelism")
            record_fused_head(base, FUSED_HEAD_ATTR, FusedHead(float(getattr(self, "temperature", 1.0)),
                                                               bool(getattr(self.args, "cast_lm_head_to_fp32", False))))

    # ---- accelerate's processes are the replicas while TRL's own code runs ---------------------------------------
    @contextlib.contextmanager
    def _replicas(self) -> Iterator[None]:
        usp = self._usp
        if usp is None or self._usp_sp == 1 or getattr(self, "_usp_in_view", False):
            yield
            return
        topo = usp.topo
        self._usp_in_view = True
        try:
            with replicas_view(self.accelerator, self._trl_modules, topo.dp_group, topo.dp_size, topo.dp_rank):
                yield
        finally:
            self._usp_in_view = False

    def _seeing_replicas(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """TRL's method ``name``, run while accelerate's processes are the data-parallel replicas."""
        with self._replicas():
            return getattr(super(), name)(*args, **kwargs)

    # TRL's rollouts and scoring (GRPO / RLOO), its losses on the whole per-token tensors, evaluation and logging
    _prepare_inputs = functools.partialmethod(_seeing_replicas, "_prepare_inputs")
    compute_loss = functools.partialmethod(_seeing_replicas, "compute_loss")
    prediction_step = functools.partialmethod(_seeing_replicas, "prediction_step")
    log = functools.partialmethod(_seeing_replicas, "log")


class USPRolloutMixin(USPRLMixin):
    """Rollouts for trainers that generate (GRPO, RLOO): once per SP group's data, the same on its ranks."""

    def _generate(self, prompts: list) -> Any:
        """TRL's rollout on whole sequences without USP; every rank of the group keeps its first rank's."""
        usp = self._usp
        if usp is None or self._usp_sp == 1:
            return super()._generate(prompts)
        with unsharded(self.model):
            result = super()._generate(prompts)
        return all_gather_objects(result, usp.topo.sp_group, "rollouts of the SP group's first rank")[0]

    def _generate_and_score_completions(self, inputs: Any) -> dict:
        """TRL's, then the check that every rank of the SP group holds the same batch, and the group's first rank's
        CPU random state on every rank of the group (TRL shuffles the batch with it next)."""
        batch = super()._generate_and_score_completions(inputs)
        usp = self._usp
        if usp is not None and self._usp_sp > 1:
            check_group_holds_same(batch, usp.topo.sp_group)
            torch.set_rng_state(all_gather_objects(torch.get_rng_state(), usp.topo.sp_group,
                                                   "random state of the SP group's first rank")[0])
        return batch


def check_group_holds_same(batch: dict, group: Any) -> None:
    """Refuse a batch whose tensors differ between the ranks of ``group`` (one small all-gather of checksums).

    Raises:
        ValueError: naming the keys that differ (a reward function that is not deterministic, most often).
    """
    tensors = {key: value for key, value in sorted(batch.items()) if isinstance(value, torch.Tensor)}
    differ = sorted(disagreements(tensors, group, "checksums of the rollout batch"))
    if differ:
        raise ValueError(f"the ranks of a sequence-parallel group hold different {', '.join(differ)} after the rollout "
                         f"(rank {dist.get_rank()}): every rank of a group must train on the same samples. ds-usp "
                         f"shares the group's completions; a reward function that is not deterministic given them "
                         f"(sampling, a rank-dependent seed) gives different rewards: make it deterministic")


def _trainer(base: type, mixin: type, name: str, modules: tuple) -> type:
    doc = (f"``trl.{base.__name__}`` with USP when the DeepSpeed JSON sets ``\"sequence_parallel\"`` (see "
           f":mod:`ds_usp.integration.trainers.rl`).")
    return type(name, (mixin, base), {"_trl_modules": modules, "__module__": __name__, "__doc__": doc})


if installed_version("trl") is not None:
    import trl.trainer.dpo_trainer as _dpo
    import trl.trainer.grpo_trainer as _grpo
    import trl.trainer.rloo_trainer as _rloo

    USPGRPOTrainer = _trainer(_grpo.GRPOTrainer, USPRolloutMixin, "USPGRPOTrainer", (_grpo,))
    USPRLOOTrainer = _trainer(_rloo.RLOOTrainer, USPRolloutMixin, "USPRLOOTrainer", (_rloo,))
    USPDPOTrainer = _trainer(_dpo.DPOTrainer, USPRLMixin, "USPDPOTrainer", ())
