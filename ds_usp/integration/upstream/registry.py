"""The registry of every change ds-usp makes to third-party code: :class:`Patch` records, :data:`PATCHES`, and the
checks a patch runs before it applies (:func:`require_parameters`, :func:`refuse`).

Each patch first checks the exact upstream signature or behaviour it relies on. When that changed, it refuses with
:class:`UpstreamChanged`, naming the patched object, what it relied on, what was found and the upstream fix that would
make it unnecessary, instead of silently patching something else. :data:`PATCHES` is the table docs/architecture.md
shows ("Patches of third-party code"); the patches themselves live in this package's module of each upstream project.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


class UpstreamChanged(RuntimeError):
    """A third-party internal ds-usp patches is not what the patch was written for."""


@dataclass(frozen=True)
class Patch:
    """One patch of third-party code.

    Attributes:
        target: the patched object.
        relies_on: the upstream signature or behaviour checked before patching.
        why: what would go wrong without it.
        upstream_fix: the upstream change that would make it unnecessary.
    """

    target: str
    relies_on: str
    why: str
    upstream_fix: str


PATCHES: dict[str, Patch] = {
    "deepspeed_initialize": Patch(
        "deepspeed.initialize",
        "its keyword parameters (args, model, ..., mpu, config, config_params) and accelerate's "
        "Accelerator._prepare_deepspeed reading deepspeed.initialize when it runs",
        "DeepSpeed ignores the \"sequence_parallel\" key: a plain deepspeed.initialize (or the HF Trainer through "
        "accelerate) given a USP config would silently train plain data parallelism",
        "a DeepSpeed extension point for config keys it does not know (or DeepSpeed refusing unknown top-level keys)"),
    "zero3_sp_scaling": Patch(
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads",
        "the name-mangled method with parameters (params_to_reduce, communication_data_type), returning the "
        "averaged gradient partitions, and not already dividing by sequence_parallel_size",
        "under ZeRO-3 with sequence parallelism its reduce-scatter divides the gradients by sp x dp instead of dp: "
        "the gradients are sp times too small",
        "divide by _gradient_averaging_world_size(...) / self.sequence_parallel_size there, as "
        "__avg_scatter_contiguous_grads already does (docs/upstream/zero3_sequence_parallel_scaling.patch)"),
    "shm_buffer_name": Patch(
        "DeepSpeed's CPU shared-memory all-reduce buffer (deepspeed/ops/csrc/cpu/comm/shm.cpp)",
        "its POSIX name deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (SHM_BUFFER_NAME)",
        "DeepSpeed never unlinks the 66 MB buffer per rank: every CPU run leaves them in /dev/shm, which is memory",
        "shm.cpp unlinking the name once every rank has opened it"),
    "attn_implementation_check": Patch(
        "transformers.PreTrainedModel._check_and_adjust_attn_implementation",
        "the method taking (self, attn_implementation, ...) when a model is built",
        "a family that computes attention in its own code would fail with KeyError: 'usp' deep inside it, or for "
        "some families silently run its own attention on each shard",
        "transformers refusing a registered attention implementation for a class whose _can_set_attn_implementation() "
        "is false, naming the class"),
    "trainer_batch_size": Patch(
        "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process",
        "the method taking (self, args, auto_find_batch_size) and filling an \"auto\" train_batch_size as "
        "world x micro x accumulation",
        "with sequence parallelism DeepSpeed counts world / sequence_parallel_size replicas and refuses HF's value",
        "HF dividing the world size by sequence_parallel_size, as DeepSpeed's own config does"),
    "tolerant_recompute": Patch(
        "torch.utils.checkpoint._CachedTorchDispatchMode (selective checkpointing's recomputation)",
        "the private class existing with a __torch_dispatch__ that raises 'not found in storage' for an op the "
        "forward did not run",
        "ZeRO-3's parameter fetches inside a checkpointed layer may differ between its forward and its "
        "recomputation (a prefetch from an earlier step or an evaluation forward): torch refuses the recomputation",
        "a public option of create_selective_checkpoint_contexts to run ops the forward did not see"),
    "family_functions": Patch(
        "a transformers family module's functions (Mamba-1 families: causal_conv1d_fn, mamba_selective_scan, "
        "mamba_inner_fn)",
        "each function existing in the family's module with the parameters the replacement passes on",
        "the family's forward calls its module's functions directly: the only way to run them on the sharded "
        "sequence without copying the family's forward",
        "the family's kernels as a module attribute of the mixer (as its Mamba-2 kin take them), or a kernel hook"),
    "replicas_view": Patch(
        "accelerate's Accelerator (num_processes, process_index, gather, gather_for_metrics, reduce, "
        "pad_across_processes) and the gather / gather_object names TRL's GRPO and RLOO trainer modules import, while "
        "a ds-usp RL trainer's rollout, loss and logging code runs",
        "those attributes existing with accelerate's parameters, and the trainer modules importing gather and "
        "gather_object from accelerate.utils",
        "accelerate counts every rank as a process, but the ranks of a sequence-parallel group hold the same samples: "
        "TRL's reward gathers, advantage groups, per-process slices and metrics would count each sample "
        "sequence_parallel_size times (and the unbiased reward std would change)",
        "accelerate taking a data-parallel process group (its ParallelismConfig knows sp_size but TRL refuses it in "
        "GRPO and RLOO)"),
}


def refuse(key: str, found: str) -> None:
    patch = PATCHES[key]
    raise UpstreamChanged(f"ds-usp patches {patch.target}, relying on {patch.relies_on}; but {found}. It would "
                          f"otherwise go wrong as follows: {patch.why}. Use the versions setup.py's dev extra pins, or "
                          f"report it; the upstream fix that makes the patch unnecessary: {patch.upstream_fix}")


def innermost(fn: Any) -> Any:
    """``fn`` under its decorators: ``functools.wraps``' ``__wrapped__``, or the ``func`` a closure wraps (DeepSpeed's
    ``instrument_w_nvtx`` keeps no ``__wrapped__``)."""
    fn = getattr(fn, "__func__", fn)  # a bound method
    while True:
        inner = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        if inner is None and code is not None and "func" in code.co_freevars and fn.__closure__:
            inner = fn.__closure__[code.co_freevars.index("func")].cell_contents
        if not callable(inner):
            return fn
        fn = inner


def require_parameters(key: str, fn: Any, params: tuple[str, ...]) -> None:
    """Refuse (:func:`refuse`) unless ``fn`` is callable and takes every one of ``params`` (under its decorators)."""
    if not callable(fn):
        refuse(key, "it does not exist in the installed version")
    lacking = [p for p in params if p not in inspect.signature(innermost(fn)).parameters]
    if lacking:
        refuse(key, f"it takes no {', '.join(lacking)} in the installed version")
