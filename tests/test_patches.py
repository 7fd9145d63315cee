"""Every patch of third-party code (ds_usp/integration/upstream/) checks what it relies on and refuses by name.

Single process, no world: each patch is given a stand-in whose upstream piece changed (gone, other parameters,
already fixed) and must refuse with UpstreamChanged naming the target and the upstream fix, or stand aside; on the
installed versions every check passes (the patches ds-usp applies at import are in place).
"""
from __future__ import annotations

import types

import pytest
import torch

from ds_usp.integration.upstream import accelerate, registry, transformers
from ds_usp.integration.upstream import deepspeed as deepspeed_patches
from ds_usp.integration.upstream import torch as torch_patches
from ds_usp.integration.upstream.registry import PATCHES, UpstreamChanged


def test_every_patch_names_its_target_and_upstream_fix():
    for key, patch in PATCHES.items():
        assert patch.target and patch.relies_on and patch.why and patch.upstream_fix, key
        with pytest.raises(UpstreamChanged, match="upstream fix") as caught:
            registry.refuse(key, "it is gone")
        assert patch.target in str(caught.value)


def test_zero3_scaling_refuses_a_changed_method_and_stands_aside_when_fixed():
    with pytest.raises(UpstreamChanged, match="__avg_scatter_grads"):
        deepspeed_patches.fix_zero3_sequence_parallel_scaling(types.SimpleNamespace(), 2)

    class Renamed:
        def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params, dtype):  # other parameter names
            return params
    with pytest.raises(UpstreamChanged, match="takes no params_to_reduce"):
        deepspeed_patches.fix_zero3_sequence_parallel_scaling(Renamed(), 2)

    class Fixed:
        def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
            return [p / self.sequence_parallel_size for p in params_to_reduce]
    fixed = Fixed()
    before = fixed._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads
    deepspeed_patches.fix_zero3_sequence_parallel_scaling(fixed, 2)
    assert fixed._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads == before  # not corrected twice

    class Upstream:
        def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
            return [p / 4 for p in params_to_reduce]  # averaged over sp x dp = 4
    upstream = Upstream()
    deepspeed_patches.fix_zero3_sequence_parallel_scaling(upstream, 2)
    out = upstream._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads([torch.ones(3)], torch.float32)
    torch.testing.assert_close(out[0], torch.full((3,), 0.5))  # averaged over dp = 2 only


def test_the_installed_deepspeed_has_what_the_patches_rely_on():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    method = getattr(DeepSpeedZeroOptimizer_Stage3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads")
    registry.require_parameters("zero3_sp_scaling", method, ("params_to_reduce", "communication_data_type"))
    assert deepspeed_patches._shm_buffer_prefix() == "deepspeed_allreduce_buffer"
    import deepspeed

    assert getattr(deepspeed.initialize, "_ds_usp", False)  # import ds_usp installed the hook
    accelerate.check_accelerate_reads_deepspeed_initialize()


def test_the_installed_transformers_and_torch_have_what_the_patches_rely_on():
    import ds_usp
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    ds_usp.hf.register_usp_attention()
    import ds_usp.integration.trainers.trainer  # noqa: F401 - installs the batch-size fix

    assert getattr(PreTrainedModel._check_and_adjust_attn_implementation, "_ds_usp", False)
    assert getattr(HfTrainerDeepSpeedConfig.trainer_config_process, "_ds_usp", False)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    _, recompute = create_selective_checkpoint_contexts(lambda *a, **k: None)
    assert type(torch_patches.tolerant_recompute(recompute)).__name__ == "_TolerantRecompute"
    with pytest.raises(UpstreamChanged, match="_CachedTorchDispatchMode"):
        torch_patches.tolerant_recompute(object())


def test_family_functions_checked_before_they_are_replaced():
    def scan(hidden_states, dt, A):
        return "family"
    family = types.SimpleNamespace(scan=scan)
    with pytest.raises(UpstreamChanged, match="takes no B"):
        transformers.replace_family_functions(family, {"scan": lambda f: f}, {"scan": ("dt", "A", "B")})
    with pytest.raises(UpstreamChanged, match="does not exist"):
        transformers.replace_family_functions(types.SimpleNamespace(), {"conv": lambda f: f}, {})
    family = types.SimpleNamespace(scan=scan)
    transformers.replace_family_functions(family, {"scan": lambda f: lambda *a: "sharded " + f(*a), "inner": lambda f: f},
                                     {"scan": ("dt", "A")}, optional=("inner",))
    assert family.scan(1, 2, 3) == "sharded family" and not hasattr(family, "inner")
    transformers.replace_family_functions(family, {"scan": lambda f: lambda *a: "twice"}, {})  # idempotent per module
    assert family.scan(1, 2, 3) == "sharded family"


def test_replicas_view_swaps_and_restores_and_refuses_a_changed_accelerate():
    import torch.distributed as dist
    from accelerate import Accelerator

    class Module(types.ModuleType):
        pass

    trl_like = Module("trl_like")
    from accelerate.utils import gather, gather_object

    trl_like.gather, trl_like.gather_object = gather, gather_object
    accelerator = Accelerator.__new__(Accelerator)  # no state needed: the view's size is 1 (no collective)
    cls = type(accelerator)
    assert not dist.is_initialized()
    with accelerate.replicas_view(accelerator, (trl_like,), group=None, size=1, index=0):
        assert accelerator.num_processes == 1 and accelerator.process_index == 0
        assert accelerator.gather(torch.tensor(3.0)).tolist() == [3.0]  # 0-d tensors become one row, as accelerate
        assert trl_like.gather({"a": torch.ones(2)})["a"].tolist() == [1.0, 1.0]
        assert accelerator.reduce(torch.tensor([2.0]), "mean").tolist() == [2.0]
        assert trl_like.gather is not gather
    assert type(accelerator) is cls and trl_like.gather is gather and trl_like.gather_object is gather_object

    trl_like.gather = lambda tensor: tensor  # a TRL that no longer uses accelerate's gather
    with pytest.raises(UpstreamChanged, match="trl_like.gather is not accelerate's"):
        with accelerate.replicas_view(accelerator, (trl_like,), group=None, size=1, index=0):
            pass
    assert type(accelerator) is cls
