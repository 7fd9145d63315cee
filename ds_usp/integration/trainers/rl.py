"""TRL's GRPO, RLOO and DPO trainers with USP: an import and a class name.

    from ds_usp import USPGRPOTrainer        # instead of: from trl import GRPOTrainer (same for RLOO, DPO)
    trainer = USPGRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(..., deepspeed="ds.json"), ...)

The model is built with ``attn_implementation="usp"`` and the DeepSpeed JSON sets ``"sequence_parallel": "usp"``, as
for :class:`ds_usp.USPTrainer`; without ``"sequence_parallel"`` these are TRL's trainers. What sequence parallelism
changes, in one place for the three trainers (:class:`USPRLMixin`); each TRL trainer keeps its own losses:

* **rollouts at 1 / SP of the cost**: the loaders split prompts (and preference pairs) over replicas only; the rows of
  each generation call of a GRPO / RLOO rollout (TRL's ``num_generations`` copies included; whole prompt groups when
  they divide evenly) are divided among the ranks of the SP group, each generates its contiguous share on whole
  sequences without USP (:func:`ds_usp.hf.unsharded`; hybrid layers run their own forward with the cache) and the
  shares are gathered in group-rank order, the order one process has them (:class:`USPRolloutMixin`). A
  ``rollout_func`` is called as TRL calls it in one process of a data-parallel run of the replicas: once per group,
  on its first rank, with the replica's prompts (``process_index`` the replica's), its output shared with the group;
  only one that says it takes ``trainer.rollout_rows`` (:func:`takes_rollout_rows`) is called on each rank's share of
  the prompts. TRL's metrics run on every rank on the gathered
  completions, and TRL's tool loop too (each rank runs every row's tools; the tool turns' generation calls are split
  again, row by row); each rollout starts with the group's first rank's Python, NumPy and torch CPU random states on
  every rank of the group, so environments and tools that draw from them draw the same on every rank, and TRL seeds
  each rank with its replica's index (:func:`~ds_usp.upstream.trl.seed_per_replica`), so they draw what TRL's process
  of that replica draws in a data-parallel run of the replicas. Each row is
  sampled with noise keyed by its row (:class:`~ds_usp.integration.trainers.rollout.KeyedSampler`): a completion
  does not depend on the rank that made it. Under ZeRO-3 the parameters are gathered once per rollout with the hooks
  off and ``synced_gpus`` off, so that no generation step waits on another rank (equal, unequal or empty shares, any
  number of tool turns); with ``ds3_gather_for_generation=False`` every rank takes part in each call (an empty share
  generates one row, discarded). After scoring, the group checks that its ranks hold the same batch (prompts,
  completions, rewards, advantages) and refuses otherwise, naming what differs;
* **log-probs at length**: TRL's fused LM head call ``model(..., labels=..., fused_lm_head=True)`` (policy, old policy,
  reference model) runs each rank on its shard of the sequence, through ``lm_head`` chunk by chunk with TRL's
  temperature, and gathers the per-token results over the group
  (:func:`ds_usp.integration.step.logprobs.fused_forward`), left-padded prompts and right-padded completions exact;
* **losses and metrics**: TRL's own code on those whole per-token tensors, identical on the ranks of a group, with
  accelerate's processes (the accelerator's and accelerate's free operations) seen as the data-parallel replicas
  while it runs (:func:`ds_usp.upstream.accelerate.replicas_view`), so rewards, advantages, every ``loss_type``
  normalisation and every logged metric count each sample once; DeepSpeed sums the group's gradient shares.

Refused by name before any step: vLLM generation, paged or continuous-batching generation, Liger kernels,
``compute_loss_func``, DPO's ``padding_free`` and ``precompute_ref_log_probs``, ``ds3_gather_for_generation=False``
with tools, environments or a ``rollout_func`` under ZeRO-3, sampling settings the keyed sampler does not reproduce
(beam search, watermarking), and the hybrid families :data:`_RL_HYBRID_REFUSED` names.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import random
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from transformers import LogitsProcessorList

from ds_usp.comm import all_gather_objects, disagreements
from ds_usp.integration.engine.preflight import installed_version
from ds_usp.integration.models.attention import unsharded
from ds_usp.integration.models.hybrid import mixer_family
from ds_usp.integration.step.logprobs import FUSED_HEAD_ATTR, FusedHead
from ds_usp.integration.trainers import rollout as rollouts
from ds_usp.integration.trainers.rollout import Rollout
from ds_usp.integration.trainers.trainer import USPTrainerBase
from ds_usp.upstream.deepspeed import torch_linear
from ds_usp.upstream.trl import (generate_arguments, generation_batch_per_group, record_fused_head,
                                 require_fused_head, rollout_gathered_once, seed_per_replica)


def _refusals(trainer_name: str, args: Any, kwargs: dict, zero_stage: Any = None) -> list[str]:
    """What this trainer's arguments ask for that sequence parallelism does not do (each named)."""
    found = []
    if getattr(args, "use_vllm", False):
        found.append(f"use_vllm=True (vLLM {getattr(args, 'vllm_mode', '')} mode: its engine generates and scores "
                     f"whole sequences outside ds-usp's groups; generate with the model instead, or give a "
                     f"rollout_func)")
    if getattr(args, "use_transformers_paged", False):
        found.append("use_transformers_paged=True (paged generation replaces the attention implementation)")
    elif getattr(args, "use_transformers_continuous_batching", False):
        found.append("use_transformers_continuous_batching=True (continuous batching replaces the attention "
                     "implementation with its paged one and schedules the rows itself)")
    if zero_stage == 3 and not getattr(args, "ds3_gather_for_generation", True):
        users = [name for name in ("tools", "environment_factory", "rollout_func") if kwargs.get(name)]
        if users:
            found.append(f"ds3_gather_for_generation=False with {', '.join(users)} under ZeRO-3 (each generation "
                         f"forward then gathers the parameters over every rank, so every rank would have to make the "
                         f"same generation calls, and the ranks' shares of tool turns and rollout_func calls differ; "
                         f"keep ds3_gather_for_generation=True, with which the parameters are gathered once per "
                         f"rollout)")
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


# Hybrid families in the RL trainers: generation runs each mixer's own forward on whole sequences with the cache's
# state (ds_usp.hf.unsharded), the update its sharded forward with the fused head's documents. The families not
# refused here are tested equal to one process in both (tests/test_rl_split.py); these are refused, with the reason.
_RL_HYBRID_REFUSED: dict[str, str] = {
    "rglru": "TRL left-pads the prompts, and RecurrentGemma's recurrence and convolution run over the padding in one "
             "process (the model does not mask it), while ds-usp's fused call starts each row's real tokens from a "
             "fresh state: the update's log-probs would differ (by 1e-3 on a tiny model)"}
_HYBRID_PER_FORWARD_GATHERS = (
    "with ds3_gather_for_generation=False under ZeRO-3, a generation forward gathers each submodule's parameters as "
    "the submodule is called, and the mixers' own decoding step reads their convolution weight without calling the "
    "convolution module, so it would read a partitioned placeholder; keep ds3_gather_for_generation=True")


class USPRLMixin(USPTrainerBase):
    """What turns TRL's GRPO / RLOO / DPO trainer into a USP one; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        trl_args = bound.get("args")
        config = getattr(getattr(trl_args, "hf_deepspeed_config", None), "config", None) or {}
        usp_config = self._read_usp_config(config, trl_args.world_size if trl_args is not None else 1)
        if usp_config.enabled:
            problems = _refusals(type(self).__name__, trl_args, bound, config.get("zero_optimization", {}).get("stage"))
            if problems:
                raise ValueError("; ".join(problems))
            generation_batch_per_group(trl_args, usp_config.sequence_parallel_size)
        with seed_per_replica(self._trl_modules, usp_config.sequence_parallel_size) if usp_config.enabled else \
                contextlib.nullcontext():  # TRL's per-process seed: the replica's, as one process of the replicas
            super().__init__(*args, **kwargs)
        if not usp_config.enabled:
            return
        models = [m for m in (self.model, getattr(self, "ref_model", None)) if m is not None]
        for model in models:
            module = getattr(model, "module", model)  # a reference model TRL already wrapped in an engine
            base = module.get_base_model() if hasattr(module, "get_base_model") else module  # PEFT
            refused = sorted({f"{type(m).__name__} ({_RL_HYBRID_REFUSED[family]})" for m in base.modules()
                              for family in (mixer_family(m),) if family in _RL_HYBRID_REFUSED})
            per_forward_gathers = (config.get("zero_optimization", {}).get("stage") == 3
                                   and not getattr(trl_args, "ds3_gather_for_generation", True))
            if per_forward_gathers:
                refused += sorted({f"{type(m).__name__} ({_HYBRID_PER_FORWARD_GATHERS})" for m in base.modules()
                                   if mixer_family(m) is not None})
            if refused:
                raise ValueError(f"{type(self).__name__}: {type(base).__name__} mixes tokens with "
                                 f"{'; '.join(refused)}: not supported in the RL trainers under "
                                 f"\"sequence_parallel\"; train it with ds_usp.USPSFTTrainer, or this trainer "
                                 f"without sequence parallelism")
            record_fused_head(base, FUSED_HEAD_ATTR, FusedHead(float(getattr(self, "temperature", 1.0)),
                                                               bool(getattr(self.args, "cast_lm_head_to_fp32", False))))

    # ---- accelerate's processes are the replicas while TRL's own code runs ---------------------------------------
    def _seeing_replicas(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """TRL's method ``name``, run while accelerate's processes are the data-parallel replicas
        (:meth:`~ds_usp.integration.trainers.trainer.USPTrainerBase._replicas`)."""
        with self._replicas():
            return getattr(super(), name)(*args, **kwargs)

    # TRL's rollouts and scoring (GRPO / RLOO), its losses on the whole per-token tensors, evaluation and logging
    _prepare_inputs = functools.partialmethod(_seeing_replicas, "_prepare_inputs")
    compute_loss = functools.partialmethod(_seeing_replicas, "compute_loss")
    prediction_step = functools.partialmethod(_seeing_replicas, "prediction_step")
    log = functools.partialmethod(_seeing_replicas, "log")


class KeyedRolloutMixin:
    """TRL's GRPO / RLOO rollout (``_generate``) with each row sampled by :class:`~.rollout.KeyedSampler`: a row's
    completion is a function of its prompt, the model, the seed, the rollout and the row's index in the batch one
    process would generate, whatever rank or batch generates it. :class:`USPRolloutMixin` splits the rows over the
    ranks of a sequence-parallel group on top of it; on TRL's own trainer it gives one process the same rollouts::

        OneProcess = type("OneProcess", (KeyedRolloutMixin, trl.GRPOTrainer), {})

    :attr:`rollout_rows` says which rows of the current generation call (or ``rollout_func`` call) this rank makes,
    as positions in the call's whole list (all of them in one process).
    """

    _usp_rollout: Optional[Rollout] = None
    _usp_eval_rollouts: int = 0
    _usp_generate_arguments: dict = {}  # what every generate call of the current rollout gets (synced_gpus)
    _turn_pairs: bool = True  # TRL's _generate_single_turn returns (completion_ids, logprobs) (GRPO); RLOO: the ids

    @property
    def rollout_rows(self) -> range:
        """The rows of the current generation or ``rollout_func`` call that this rank generates (positions in the
        call's list of prompts); empty outside a rollout."""
        return self._usp_rollout.rows if self._usp_rollout is not None else range(0)

    # ---- what the mixin above says about this rank (USPRolloutMixin: the SP group) -------------------------------
    def _rollout_group(self) -> tuple[int, int, Any]:
        """``(ranks sharing the rollout, this rank among them, their process group)``: alone here."""
        return 1, 0, None

    def _rollout_func_group(self) -> tuple[int, int, Any]:
        """``(ranks sharing a rollout_func's output, this rank among them, their group)``: its first rank calls it."""
        return self._rollout_group()

    def _rollout_context(self, rollout: Rollout) -> Any:
        """What the rollout runs inside (USPRolloutMixin: whole sequences, ZeRO-3's gather once)."""
        return contextlib.nullcontext()

    # ---- the rollout ---------------------------------------------------------------------------------------------
    def _rollout_round(self) -> int:
        if self.model.training:
            return 2 * int(self._step)  # TRL's micro-step counter: one rollout per generation round
        self._usp_eval_rollouts += 1
        return 2 * self._usp_eval_rollouts - 1

    def _generate(self, prompts: list) -> Any:
        """TRL's ``_generate`` on this rank's share of the rows (see the class docstring)."""
        size, rank, group = self._rollout_group()
        unit = self.num_generations if self.model.training else getattr(self, "num_generations_eval", 1)
        rollout = Rollout(seed=int(self.args.seed), round=self._rollout_round(),
                          offset=self.accelerator.process_index * len(prompts), size=size, rank=rank,
                          unit=int(unit or 1))
        self._usp_rollout = rollout
        user = getattr(self, "rollout_func", None)
        try:
            with self._rollout_context(rollout):
                if user is not None and takes_rollout_rows(user):
                    self.rollout_func = functools.partial(self._rollout_func_share, user, rollout, group)
                elif user is not None:  # once per SP group, whether the rollout is split or not
                    self.rollout_func = functools.partial(self._rollout_func_once, user, rollout,
                                                          *self._rollout_func_group())
                try:
                    result = super()._generate(prompts)
                finally:
                    if user is not None:
                        self.rollout_func = user
            if size > 1:  # every rank made the same calls (a rank that made more meets the others' end here)
                self._agree(group, ("end of the rollout", rollout.calls))
        finally:
            self._usp_rollout = None
        return result

    def _agree(self, group: Any, tag: tuple, payload: Any = None) -> list:
        """``payload`` of every rank of ``group`` (group-rank order), after checking that each is at the same point
        of the rollout with the same rows (``tag``).

        Raises:
            ValueError: the ranks are at different generation calls, or hold different rows (named).
        """
        if group is None:
            return [payload]
        parts = all_gather_objects((tag, payload), group, "split rollouts of the SP group")
        tags = [t for t, _ in parts]
        if any(t != tag for t in tags):
            raise ValueError(f"split rollouts: the ranks of a sequence-parallel group are at different generation "
                             f"calls or hold different rows (rank {dist.get_rank()}: {tag}; the group's, in rank "
                             f"order: {tags}). Every rank of a group runs the rollout on the same rows, from the "
                             f"group's first rank's Python, NumPy and torch CPU random states: a tool, environment or "
                             f"rollout_func that is not deterministic given the completions and those states (its own "
                             f"per-rank seed, the clock) makes them diverge")
        return [p for _, p in parts]

    def _rollout_func_once(self, user: Callable, rollout: Rollout, size: int, rank: int, group: Any, prompts: list,
                           trainer: Any) -> dict:
        """The user's ``rollout_func`` called as TRL calls it in one process of a data-parallel run of the replicas:
        once per SP group (``size`` ranks, this one ``rank``), on the group's first rank, with the replica's whole
        ``prompts`` (``process_index`` is the replica's index); its output shared with the group's other ranks.

        Raises:
            RuntimeError: on the group's other ranks, when the call failed on its first rank (which raises its own).
        """
        n = len(prompts)
        outcome: tuple = ("not called", None)
        if rank == 0:
            with rollout.in_user_share(0, n):
                try:
                    outcome = ("returned", user(prompts, trainer))
                except Exception as error:  # the group's other ranks wait for the output: tell them, then raise
                    if size > 1:
                        self._agree(group, ("rollout_func", rollouts.digest(prompts)), ("failed", repr(error)))
                    raise
        if size > 1:
            outcome = self._agree(group, ("rollout_func", rollouts.digest(prompts)), outcome)[0]
            if outcome[0] == "failed":
                raise RuntimeError(f"rollout_func failed on the first rank of this sequence-parallel group: "
                                   f"{outcome[1]}")
        output = outcome[1]
        if isinstance(output, dict):
            rollout.first_turn_done(output.get("prompt_ids"), output.get("completion_ids"))  # tool turns follow
        return output

    def _rollout_func_share(self, user: Callable, rollout: Rollout, group: Any, prompts: list, trainer: Any) -> dict:
        """The user's ``rollout_func`` that says it takes ``trainer.rollout_rows`` (:func:`takes_rollout_rows`) on
        this rank's share of ``prompts``; the shares' outputs joined in order."""
        n = len(prompts)
        lo, hi = rollout.share(n, True)
        with rollout.in_user_share(lo, hi):
            mine = user(prompts[lo:hi], trainer) if hi > lo else None
        parts = self._agree(group, ("rollout_func", rollouts.digest(prompts)), mine)
        sizes = [b - a for a, b in (rollouts.share(n, rollout.size, r, rollout.unit) for r in range(rollout.size))]
        merged = rollouts.merge_rollout_outputs(parts, sizes) if rollout.size > 1 else mine
        rollout.first_turn_done(merged.get("prompt_ids"), merged.get("completion_ids"))  # tool turns follow
        return merged

    def _generate_single_turn(self, prompt_ids: list, images: Any = None, multimodal_fields: Any = None,
                              *args: Any, **kwargs: Any) -> Any:
        """TRL's generation call on this rank's share of the rows, keyed sampling; the shares gathered in order."""
        rollout = self._usp_rollout
        if rollout is None or rollout.in_user_code:  # outside a rollout, or a rollout_func's own call: TRL's
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        first, keys = rollout.call(prompt_ids)
        size, _, group = self._rollout_group()
        pairs = self._turn_pairs
        if size == 1:
            rollout.generating(0, len(prompt_ids))
            out = self._keyed_turn(keys, prompt_ids, images, multimodal_fields, *args, **kwargs)
            pairs = isinstance(out, tuple)
        else:
            if images is not None or multimodal_fields:
                raise ValueError("split rollouts take text prompts: images and multimodal fields are not supported "
                                 "(RL of VLMs under \"sequence_parallel\" is not supported)")
            lo, hi = rollout.share(len(prompt_ids), first)
            rollout.generating(lo, hi)
            mine: Any = ([], None) if pairs else []
            if hi > lo:
                mine = self._keyed_turn(keys[lo:hi], prompt_ids[lo:hi], images, multimodal_fields, *args, **kwargs)
            elif self._generates_in_lockstep():  # ZeRO-3 with TRL's per-call gather: every rank takes part
                self._keyed_turn(keys[:1], prompt_ids[:1], images, multimodal_fields, *args, **kwargs)
            parts = self._agree(group, ("generation call", rollout.calls, rollouts.digest(prompt_ids)), mine)
            if not pairs:
                out = rollouts.in_rank_order(parts)
            else:
                logprobs = [p[1] for p in parts if p[0]]
                out = (rollouts.in_rank_order([p[0] for p in parts]),
                       None if all(x is None for x in logprobs) else rollouts.in_rank_order(logprobs))
        if first:
            rollout.first_turn_done(prompt_ids, out[0] if pairs else out)  # the list TRL's tool loop updates in place
        return out

    def _generates_in_lockstep(self) -> bool:
        """Whether every rank must take part in each generation call (ZeRO-3 with TRL's per-call parameter gathers)."""
        return False

    def _keyed_turn(self, keys: list, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        """TRL's generation call on ``prompt_ids``, row ``i`` sampled with ``keys[i]`` (when the config samples)."""
        config = self.generation_config
        arguments = dict(self._usp_generate_arguments)
        if getattr(config, "do_sample", False):
            arguments["logits_processor"] = LogitsProcessorList(
                [rollouts.KeyedSampler(keys, rollouts.sampling_warpers(config))])
            self.generation_config = rollouts.greedy(config)
        try:
            with self._generate_arguments(arguments):
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        finally:
            self.generation_config = config

    def _generate_arguments(self, arguments: dict) -> Any:
        if not arguments:
            return contextlib.nullcontext()
        return generate_arguments(self.accelerator.unwrap_model(self.model_wrapped), _trl_trainer_class(type(self)),
                                  **arguments)


def takes_rollout_rows(rollout_func: Callable) -> bool:
    """Whether a GRPO ``rollout_func`` says that it may be called on a share of a replica's prompts and reads which
    rows it has from ``trainer.rollout_rows`` (an attribute ``takes_rollout_rows = True`` on the function, or on the
    object it is a method of or wraps): then each rank of a sequence-parallel group calls it on its share. Any other
    ``rollout_func`` is called as TRL calls it, once per group with the replica's whole prompts.

    Args:
        rollout_func: the trainer's ``rollout_func``.

    Returns:
        True when it opts in to split calls.
    """
    for holder in (rollout_func, getattr(rollout_func, "__self__", None), getattr(rollout_func, "func", None)):
        if holder is not None and getattr(holder, "takes_rollout_rows", False) is True:
            return True
    return False


def _trl_trainer_class(cls: type) -> type:
    """The TRL trainer class (GRPOTrainer, RLOOTrainer) whose generation call a trainer class runs."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("trl.") and "_generate_single_turn" in vars(c))


class USPRolloutMixin(USPRLMixin, KeyedRolloutMixin):
    """Rollouts for trainers that generate (GRPO, RLOO): each rank of an SP group generates its share of the group's
    rows on whole sequences (:class:`KeyedRolloutMixin`); the group checks that its ranks hold the same batch.

    ``split_rollouts = False`` (on the class or the trainer) makes every rank of a group generate the group's whole
    batch and keep its first rank's rollouts, as before split rollouts existed (``benchmarks/rl_step.py`` compares
    the two); a ``rollout_func`` is still called once per group (on its first rank) unless it takes
    ``trainer.rollout_rows``, and under ZeRO-3 the parameters are still gathered once per rollout.
    """

    split_rollouts: bool = True
    _usp_gathered_once: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = getattr(self, "generation_config", None)
        if self._usp_config is not None and self._usp_config.enabled and getattr(config, "do_sample", False):
            rollouts.sampling_warpers(config)  # refuses, by name, what the keyed sampler does not reproduce

    def _rollout_group(self) -> tuple[int, int, Any]:
        return self._rollout_func_group() if self.split_rollouts else (1, 0, None)

    def _rollout_func_group(self) -> tuple[int, int, Any]:
        usp = self._usp  # the SP group, whether the rollout is split or not
        if usp is None or self._usp_sp == 1:
            return 1, 0, None
        return usp.topo.sp_size, usp.topo.sp_rank, usp.topo.sp_group

    def _gathers_once(self) -> bool:
        """ZeRO-3 with TRL's parameter gather for generation (its default) under SP: gathered once per rollout, split
        or not (the replicas' rollouts, and with a rollout_func the ranks of a group, make different calls)."""
        return (self._usp is not None and self._usp_sp > 1 and self._dist.is_zero3
                and self.args.ds3_gather_for_generation)

    def _generates_in_lockstep(self) -> bool:  # (not while the rollout runs with the parameters gathered once)
        return self._dist.is_zero3 and not self.args.ds3_gather_for_generation and not self._usp_gathered_once

    @contextlib.contextmanager
    def _rollout_context(self, rollout: Rollout) -> Iterator[None]:
        """Whole sequences without USP (:func:`ds_usp.hf.unsharded`) and torch's own linear
        (:func:`~ds_usp.upstream.deepspeed.torch_linear`); under ZeRO-3 (split or not) the parameters gathered
        once for the rollout, no hook, and ``synced_gpus`` off: nothing in generation is collective."""
        if self._usp is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(unsharded(self.model))
            stack.enter_context(torch_linear())  # no gradient in generation: torch's linear where ZeRO-3 left its own
            if self._gathers_once():
                stack.enter_context(rollout_gathered_once(self.model_wrapped, self.args))
                self._usp_gathered_once = True  # (TRL's ds3_gather_for_generation is off meanwhile)
                self._usp_generate_arguments = {"synced_gpus": False}
                stack.enter_context(self._generate_arguments(self._usp_generate_arguments))  # a rollout_func's too
            try:
                yield
            finally:
                self._usp_generate_arguments = {}
                self._usp_gathered_once = False

    def _generate(self, prompts: list) -> Any:
        """:class:`KeyedRolloutMixin`'s; with ``split_rollouts`` off, every rank of the group generates the whole
        batch and keeps its first rank's."""
        result = super()._generate(prompts)
        usp = self._usp
        if usp is None or self._usp_sp == 1 or self.split_rollouts:
            return result
        return all_gather_objects(result, usp.topo.sp_group, "rollouts of the SP group's first rank")[0]

    def _generate_and_score_completions(self, inputs: Any) -> dict:
        """TRL's, started with the group's first rank's Python, NumPy and torch CPU random states on every rank of the
        SP group (:func:`share_random_states`: TRL seeds each process differently, and every rank runs the rollout's
        environment resets and tool calls over the group's whole batch); then the check that every rank
        of the group holds the same batch, and the group's first rank's CPU random state on every rank of the group
        (TRL shuffles the batch with it next)."""
        usp = self._usp
        if usp is not None and self._usp_sp > 1:
            share_random_states(usp.topo.sp_group)
        batch = super()._generate_and_score_completions(inputs)
        if usp is not None and self._usp_sp > 1:
            check_group_holds_same(batch, usp.topo.sp_group)
            torch.set_rng_state(all_gather_objects(torch.get_rng_state(), usp.topo.sp_group,
                                                   "random state of the SP group's first rank")[0])
        return batch


def share_random_states(group: Any) -> None:
    """Give every rank of ``group`` its first rank's Python ``random`` state, NumPy's global state and torch's CPU
    generator state (one all-gather of Python objects), so that environments (``environment_factory``) and tools that
    draw from them draw the same on every rank of the group, as the group's first rank would alone.

    Args:
        group: the sequence-parallel process group.
    """
    try:
        import numpy
    except ImportError:  # (NumPy is optional: nothing to share then)
        numpy = None
    mine = (random.getstate(), numpy.random.get_state() if numpy is not None else None, torch.get_rng_state())
    python, numpy_state, torch_state = all_gather_objects(mine, group, "random states of the SP group's first rank")[0]
    random.setstate(python)
    if numpy is not None:
        numpy.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)


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


def _trainer(base: type, mixin: type, name: str, modules: tuple, turn_pairs: bool = True) -> type:
    doc = (f"``trl.{base.__name__}`` with USP when the DeepSpeed JSON sets ``\"sequence_parallel\"`` (see "
           f":mod:`ds_usp.integration.trainers.rl`).")
    return type(name, (mixin, base), {"_trl_modules": modules, "_turn_pairs": turn_pairs, "__module__": __name__,
                                      "__doc__": doc})


if installed_version("trl") is not None:
    require_fused_head("ds-usp's RL trainers (USPGRPOTrainer, USPRLOOTrainer, USPDPOTrainer)")
    import trl.trainer.dpo_trainer as _dpo
    import trl.trainer.grpo_trainer as _grpo
    import trl.trainer.rloo_trainer as _rloo

    USPGRPOTrainer = _trainer(_grpo.GRPOTrainer, USPRolloutMixin, "USPGRPOTrainer", (_grpo,))
    USPRLOOTrainer = _trainer(_rloo.RLOOTrainer, USPRolloutMixin, "USPRLOOTrainer", (_rloo,), turn_pairs=False)
    USPDPOTrainer = _trainer(_dpo.DPOTrainer, USPRLMixin, "USPDPOTrainer", ())
