"""ds-usp's changes to TRL's objects: a GRPO / RLOO config's generation batch counted per sequence-parallel group, the
settings of TRL's fused LM head kept on the model, TRL's per-process seed counting the replicas, the arguments TRL's
generate call gets during a rollout (the keyed sampler, ``synced_gpus``) and, under ZeRO-3, the parameters gathered
once per rollout instead of per generation call (accelerate's processes seen as the replicas while TRL's code runs
are :mod:`.accelerate`'s)."""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator

from ds_usp.upstream.registry import Patch, innermost, refuse, register, require_parameters
from ds_usp.upstream.torch import set_module_attribute

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


def require_fused_head(who: str) -> None:
    """Refuse a TRL without its fused LM head (``trl.trainer.utils.add_fused_lm_head`` and ``FusedCausalLMOutput``,
    TRL 1.x), through which ds-usp answers TRL's losses and metrics on the sequence shards.

    Args:
        who: what needs it, named in the error.

    Raises:
        ImportError: naming what the installed TRL lacks and the version tested.
    """
    import trl
    import trl.trainer.utils as utils

    lacking = [name for name in ("add_fused_lm_head", "FusedCausalLMOutput") if not hasattr(utils, name)]
    if lacking:
        raise ImportError(f"{who} under \"sequence_parallel\" runs TRL's losses through its fused LM head, which TRL "
                          f"{trl.__version__} does not have (trl.trainer.utils lacks {', '.join(lacking)}; it computes "
                          f"them from the whole logits, which no rank holds under sequence parallelism); tested with "
                          f"TRL 1.16. ds-usp's HF Trainer path (Trainer, Seq2SeqTrainer and their subclasses) does not "
                          f"need TRL")


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
    (:func:`ds_usp.upstream.torch.set_module_attribute`).

    Raises:
        UpstreamChanged: ``add_fused_lm_head`` takes other parameters.
    """
    from trl.trainer.utils import add_fused_lm_head

    require_parameters("fused_head_settings", add_fused_lm_head, ("model", "temperature", "cast_lm_head_to_fp32"))
    set_module_attribute(model, attr, settings)


register("seed_per_replica", Patch(
    "the set_seed TRL's GRPO / RLOO trainer modules import, while a ds-usp RL trainer's __init__ runs (TRL calls "
    "set_seed(args.seed, device_specific=True) there)",
    "accelerate's set_seed(seed, device_specific, deterministic) adding AcceleratorState().process_index (the global "
    "rank) to the seed when device_specific, and the trainer modules importing it from accelerate",
    "TRL seeds each process differently: the ranks of a sequence-parallel group would start from different random "
    "states, and replica k's first rank (whose states its group shares each rollout) from the seed of process "
    "k * sequence_parallel_size of a run of every rank, so that environments and tools drawing from them would draw "
    "what no data-parallel run of the replicas draws, and differently at each SP size",
    "TRL seeding by the data-parallel index (the replicas), or accelerate's process_index counting them"))


@functools.cache
def _adds_process_index(set_seed: Any) -> bool:
    return "seed += AcceleratorState().process_index" in inspect.getsource(set_seed)


@contextlib.contextmanager
def seed_per_replica(modules: tuple, sp_size: int) -> Iterator[None]:
    """While the block runs, ``set_seed(seed, device_specific=True)`` in ``modules`` (TRL trainer modules) seeds each
    rank with ``seed + its replica's index`` (SP groups are contiguous ranks: ``rank // sp_size``), as TRL seeds the
    processes of a data-parallel run of the replicas; without ``device_specific`` it is accelerate's.

    Raises:
        UpstreamChanged: a module's ``set_seed`` is not accelerate's, or accelerate's does not add the process index.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    require_parameters("seed_per_replica", set_seed, ("seed", "device_specific", "deterministic"))
    if not _adds_process_index(set_seed):
        refuse("seed_per_replica", "accelerate's set_seed does not add AcceleratorState().process_index")
    for module in modules:
        if getattr(module, "set_seed", None) is not set_seed:
            refuse("seed_per_replica", f"{module.__name__}.set_seed is not accelerate's")

    def per_replica(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
        if device_specific:
            seed += AcceleratorState().process_index // sp_size
        set_seed(seed, deterministic=deterministic)

    for module in modules:
        module.set_seed = per_replica
    try:
        yield
    finally:
        for module in modules:
            module.set_seed = set_seed


register("generate_arguments", Patch(
    "the model TRL's _generate_single_turn generates with (an instance attribute generate: the class's generate "
    "with ds-usp's arguments bound, for the duration of a rollout or of one generation call)",
    "TRL's GRPO / RLOO _generate_single_turn calling unwrapped_model.generate(**inputs, "
    "generation_config=self.generation_config) on the model accelerate unwraps, and GenerationMixin.generate taking "
    "logits_processor and synced_gpus",
    "TRL passes generate no logits processor and no synced_gpus: the keyed sampler (a row's completion the same "
    "whichever rank generates it) could not be given, and under ZeRO-3 HF's default synced_gpus would all-reduce "
    "over every rank at each decoding step, waiting forever for ranks whose share is shorter or empty",
    "TRL taking logits processors and generate keyword arguments in its configs (it takes generation_kwargs, which "
    "become a GenerationConfig that holds neither)"))


register("rollout_gathered_once", Patch(
    "a ZeRO-3 TRL trainer's args.ds3_gather_for_generation (False while a ds-usp rollout runs with the parameters "
    "gathered once, TRL's remove_hooks / add_hooks around it)",
    "TRL's unwrap_model_for_generation entering deepspeed.zero.GatheredParameters per generation call when "
    "gather_deepspeed3_params is true (so that a gather around the whole rollout must turn it off: nested gathers "
    "raise), and trl.models.utils.remove_hooks / add_hooks",
    "TRL gathers the parameters over every rank in each generation call: ranks of a sequence-parallel group that "
    "generate different shares (or run a different number of tool turns, replicas of different prompts) would wait "
    "on each other forever",
    "TRL gathering once per rollout (or per _generate) instead of per generation call"))


_GENERATE_CALL = ("unwrapped_model.generate(", "generation_config=self.generation_config")


def _calls_generate(trainer_class: type) -> bool:
    return _source_calls_generate(innermost(trainer_class._generate_single_turn))


@functools.cache
def _source_calls_generate(fn: Any) -> bool:
    return all(part in inspect.getsource(fn) for part in _GENERATE_CALL)


@contextlib.contextmanager
def generate_arguments(model: Any, trainer_class: type, **arguments: Any) -> Iterator[None]:
    """While the block runs, ``model.generate(...)`` (TRL's call in ``trainer_class._generate_single_turn``) gets
    ``arguments`` too (``logits_processor``, ``synced_gpus``); the instance's previous ``generate`` (an enclosing
    block's) comes back after.

    Args:
        model: the model TRL generates with (``accelerator.unwrap_model(model_wrapped)``).
        trainer_class: the TRL trainer class whose ``_generate_single_turn`` calls it.
        **arguments: keyword arguments of ``GenerationMixin.generate``.

    Raises:
        UpstreamChanged: ``generate`` takes none of these, or TRL calls it otherwise.
    """
    from transformers import GenerationMixin

    require_parameters("generate_arguments", GenerationMixin.generate, tuple(arguments))
    if not _calls_generate(trainer_class):
        refuse("generate_arguments", f"{trainer_class.__name__}._generate_single_turn does not call "
                                     f"{' ... '.join(_GENERATE_CALL)}")
    previous = model.__dict__.get("generate")
    model.generate = functools.partial(type(model).generate, model, **arguments)
    try:
        yield
    finally:
        if previous is None:
            del model.generate
        else:
            model.generate = previous


@contextlib.contextmanager
def rollout_gathered_once(engine: Any, args: Any) -> Iterator[None]:
    """While the block runs, a ZeRO-3 engine's parameters are whole on every rank (one gather over the partition
    group on entry, as TRL's per-call gather does), its hooks off (TRL's ``remove_hooks``, and DeepSpeed's
    start-of-forward hook: :func:`ds_usp.upstream.deepspeed.start_of_forward_hook_off`) and TRL's own
    per-call gather off (``args.ds3_gather_for_generation``): nothing in generation is collective.

    Args:
        engine: the trainer's ``model_wrapped`` (a ZeRO-3 DeepSpeed engine).
        args: the trainer's config.

    Raises:
        UpstreamChanged: TRL does not gather per call, or has no ``remove_hooks`` / ``add_hooks``.
    """
    import deepspeed
    import trl.models.utils as trl_models

    from ds_usp.upstream.deepspeed import start_of_forward_hook_off

    unwrap = getattr(trl_models, "_unwrap_model_for_generation", None)
    if not hasattr(args, "ds3_gather_for_generation") or unwrap is None or \
            "GatheredParameters" not in inspect.getsource(unwrap):
        refuse("rollout_gathered_once", "TRL's unwrap_model_for_generation does not gather the parameters per call "
                                        "under ds3_gather_for_generation")
    for name in ("remove_hooks", "add_hooks"):
        if not callable(getattr(trl_models, name, None)):
            refuse("rollout_gathered_once", f"trl.models.utils has no {name}")
    with deepspeed.zero.GatheredParameters(list(engine.parameters())):
        trl_models.remove_hooks(engine)
        saved = args.ds3_gather_for_generation
        args.ds3_gather_for_generation = False
        try:
            with start_of_forward_hook_off(engine):
                yield
        finally:
            args.ds3_gather_for_generation = saved
            trl_models.add_hooks(engine)
