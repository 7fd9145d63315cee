"""ds-usp's changes to transformers: the attention-implementation check, HF's DeepSpeed batch size, family module
functions."""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

from ds_usp.upstream.registry import Patch, refuse, register, require_parameters

register("attn_implementation_check", Patch(
    "transformers.PreTrainedModel._check_and_adjust_attn_implementation",
    "the method taking (self, attn_implementation, ...) when a model is built",
    "a family that computes attention in its own code would fail with KeyError: 'usp' deep inside it, or for "
    "some families silently run its own attention on each shard",
    "transformers refusing a registered attention implementation for a class whose _can_set_attn_implementation() "
    "is false, naming the class"))


register("trainer_batch_size", Patch(
    "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process (wrapped once, by the gate "
    "_ds_usp_auto installs when that module is imported; ds-usp's part runs when the config sets "
    "\"sequence_parallel\")",
    "the method taking (self, args, auto_find_batch_size) and filling an \"auto\" train_batch_size as "
    "world x micro x accumulation",
    "with sequence parallelism DeepSpeed counts world / sequence_parallel_size replicas and refuses HF's value",
    "HF dividing the world size by sequence_parallel_size, as DeepSpeed's own config does"))


register("family_functions", Patch(
    "a transformers family module's functions (Mamba-1 families: causal_conv1d_fn, mamba_selective_scan, "
    "mamba_inner_fn)",
    "each function existing in the family's module with the parameters the replacement passes on",
    "the family's forward calls its module's functions directly: the only way to run them on the sharded "
    "sequence without copying the family's forward",
    "the family's kernels as a module attribute of the mixer (as its Mamba-2 kin take them), or a kernel hook"))


def wrap_attn_implementation_check(refuse: Callable[[type], None], name: str) -> None:
    """Make building a model with ``attn_implementation=name`` call ``refuse(model_class)`` first (idempotent).

    Args:
        refuse: raises for a class ds-usp cannot shard.
        name: the attention implementation's name (``"usp"``).

    Raises:
        UpstreamChanged: transformers has no such method, or it takes no ``attn_implementation``.
    """
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if getattr(check, "_ds_usp", False):
        return
    require_parameters("attn_implementation_check", check, ("attn_implementation",))

    @functools.wraps(check)
    def check_usp_is_possible(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        if attn_implementation == name:
            refuse(type(self))
        return check(self, attn_implementation, *args, **kwargs)

    check_usp_is_possible._ds_usp = True
    PreTrainedModel._check_and_adjust_attn_implementation = check_usp_is_possible


def process_with_replicas_batch(original: Callable[..., Any], hf_config: Any, args: tuple, kwargs: Mapping[str, Any],
                                replicas_batch: Callable[[Mapping[str, Any], Any], Optional[int]]) -> None:
    """HF's ``trainer_config_process`` (``original``) on ``hf_config``, then an ``"auto"`` ``train_batch_size`` it
    filled becomes ``replicas_batch(config, training_args)`` when that is not None. It runs when ``TrainingArguments``
    is created, before any trainer exists (the gate of ``_ds_usp_auto`` calls it for a config with the key).

    Args:
        original: HF's method.
        hf_config: the ``HfTrainerDeepSpeedConfig``.
        args: the call's positional arguments after ``self``.
        kwargs: its keyword arguments.
        replicas_batch: the batch size over replicas (None: keep HF's).

    Raises:
        UpstreamChanged: the method is gone or takes other parameters.
    """
    import inspect

    require_parameters("trainer_batch_size", original, ("args", "auto_find_batch_size"))
    was_auto = hf_config.config.get("train_batch_size") == "auto"
    original(hf_config, *args, **kwargs)
    training_args = inspect.signature(original).bind(hf_config, *args, **kwargs).arguments["args"]
    fixed = replicas_batch(hf_config.config, training_args) if was_auto else None
    if fixed is not None:
        hf_config.config["train_batch_size"] = fixed


def replace_family_functions(family: Any, replacements: Mapping[str, Callable[[Callable], Callable]],
                             params: Mapping[str, tuple[str, ...]], optional: tuple[str, ...] = ()) -> None:
    """Swap functions of a transformers family module for ``replacements[name](original)`` (idempotent per module).

    Args:
        family: the module that defines the family's classes.
        replacements: ``name -> factory`` of the replacement from the family's own function.
        params: ``name -> parameters`` the replacement passes on, checked on the family's function.
        optional: names the family may lack (left alone then).

    Raises:
        UpstreamChanged: a function is missing or takes other parameters.
    """
    if getattr(family, "_ds_usp_sharded", False):
        return
    for name, make in replacements.items():
        original = getattr(family, name, None)
        if original is None and name in optional:
            continue
        require_parameters("family_functions", original, params.get(name, ()))
        setattr(family, name, functools.wraps(original)(make(original)))
    family._ds_usp_sharded = True


register("attn_implementation_switch", Patch(
    "a transformers config's _attn_implementation (the vision tower's, and every config of a model while it "
    "generates without USP)",
    "the config property _attn_implementation with a setter, read by the model's layers on every call to pick the "
    "attention function",
    "a VLM's vision tower runs replicated (sdpa) or sharded (ds-usp's flash-like name) while its language model runs "
    "'usp'; generation runs whole sequences without USP",
    "a public per-config setter (PreTrainedModel.set_attn_implementation exists but checks and re-dispatches the "
    "whole model tree)"))
register("private_scan", Patch(
    "a transformers module's private scan method (RecurrentGemma's RG-LRU _rnn_scan)",
    "the bound method existing with the parameters the replacement passes on",
    "the RG-LRU's gates are per token but its recurrence runs over the sequence: the scan is the one place to pass "
    "its state over the SP group without copying the family's forward",
    "the scan as a replaceable kernel of the module (as the Mamba-2 families take theirs)"))


def attention_implementation(config: Any) -> Optional[str]:
    """The attention implementation a transformers config asks for (None: not a model config)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: Any, name: str) -> None:
    """Make the layers that read ``config`` use attention implementation ``name`` from their next call.

    Raises:
        UpstreamChanged: the config has no ``_attn_implementation`` property with a setter.
    """
    prop = getattr(type(config), "_attn_implementation", None)
    if not isinstance(prop, property) or prop.fset is None:
        refuse("attn_implementation_switch", f"{type(config).__name__}._attn_implementation is not a property "
                                             f"with a setter")
    config._attn_implementation = name


def replace_private_method(obj: Any, name: str, make: Callable[[Callable], Callable], params: tuple[str, ...]) -> None:
    """``obj.name = make(obj.name)`` on the instance, after checking the method takes ``params``.

    Raises:
        UpstreamChanged: the method is gone or takes other parameters.
    """
    original = getattr(obj, name, None)
    require_parameters("private_scan", original, params)
    setattr(obj, name, make(original))
