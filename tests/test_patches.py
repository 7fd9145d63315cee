"""Every patch of third-party code (ds_usp/upstream/) checks what it relies on and refuses by name.

Single process, no world: each patch is given a stand-in whose upstream piece changed (gone, other parameters,
already fixed) and must refuse with UpstreamChanged naming the target and the upstream fix, or stand aside; on the
installed versions every check passes (the patches ds-usp applies at import are in place).
"""
from __future__ import annotations

import types

import pytest
import torch

from ds_usp.upstream import accelerate, registry, transformers
from ds_usp.upstream import deepspeed as deepspeed_patches
from ds_usp.upstream import torch as torch_patches
from ds_usp.upstream.catalog import PATCHES
from ds_usp.upstream.registry import UpstreamChanged


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


# ---- the patches that moved here from the engine, the trainers, comm and the Triton kernels ----------------------

def test_group_lookup_refuses_a_changed_torch(monkeypatch):
    import torch.distributed as dist

    from ds_usp.upstream import c10d

    assert callable(c10d._resolver())  # the installed torch has it (a pybind builtin: checked by its docstring)
    for changed in (None, lambda name: name):
        c10d._resolver.cache_clear()
        monkeypatch.setattr(dist.distributed_c10d, "_resolve_process_group", changed, raising=False)
        with pytest.raises(UpstreamChanged, match="_resolve_process_group"):
            c10d.process_group_named("0")
    monkeypatch.undo()
    c10d._resolver.cache_clear()


def test_triton_interpreter_switch_is_restored_and_checked(monkeypatch):
    pytest.importorskip("triton")
    from triton import knobs

    from ds_usp.upstream import triton as triton_patches

    before = knobs.runtime.interpret
    with triton_patches.interpreted(not before):
        assert knobs.runtime.interpret == (not before)
    assert knobs.runtime.interpret == before
    monkeypatch.setattr(knobs, "runtime", types.SimpleNamespace(interpret=False))  # no scope(): not restorable
    with pytest.raises(UpstreamChanged, match="no interpret knob or no scope"):
        with triton_patches.interpreted(True):
            pass


def test_engine_patches_check_the_engine_first():
    class Engine:
        global_steps = 3

        def forward(self, x):
            raise RuntimeError("boom")

        def backward(self, loss):
            return loss

        def step(self):
            return "stepped"

        def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
            return "deepspeed's save"

        def load_checkpoint(self, load_dir, tag=None):
            return "deepspeed's load"

    engine = Engine()
    deepspeed_patches.attach_state(engine, "state")
    assert engine.usp == "state"
    with pytest.raises(UpstreamChanged, match="has an attribute usp of its own"):
        deepspeed_patches.attach_state(type("Own", (), {"usp": None})(), "state")

    deepspeed_patches.note_failures(engine, rank=5)
    assert engine.step() == "stepped" and engine.backward(2) == 2
    with pytest.raises(RuntimeError, match="boom") as caught:
        engine.forward(1)
    assert "ds_usp: raised on rank 5 in engine.forward() during training step 4" in caught.value.__notes__
    with pytest.raises(UpstreamChanged, match="keeps no global_steps"):
        deepspeed_patches.note_failures(types.SimpleNamespace(forward=print), rank=0)

    mine = types.SimpleNamespace(save_checkpoint=lambda *a, **k: "ours", load_checkpoint=lambda *a, **k: "ours",
                                 wait_for_checkpoint=lambda: None)
    deepspeed_patches.replace_checkpointing(engine, mine)
    assert engine.save_checkpoint("d") == "ours" and engine.load_checkpoint("d") == "ours"
    assert engine.wait_for_checkpoint is mine.wait_for_checkpoint

    class Renamed(Engine):
        def save_checkpoint(self, directory, tag=None):  # other parameters
            return None
    with pytest.raises(UpstreamChanged, match="takes no save_dir, client_state, save_latest"):
        deepspeed_patches.replace_checkpointing(Renamed(), mine)


def test_async_save_state_swaps_the_checkpoint_engine_and_stands_aside_without_the_builders():
    class Writer:
        def save(self, state_dict, path):
            return path

    engine = types.SimpleNamespace(checkpoint_engine=Writer())
    inner = engine.checkpoint_engine
    with deepspeed_patches.checkpoint_engine_as(engine, lambda own: ("copying", own)) as writer:
        assert engine.checkpoint_engine is writer and writer == ("copying", inner)
    assert engine.checkpoint_engine is inner
    with pytest.raises(UpstreamChanged, match="takes no state_dict"):
        with deepspeed_patches.checkpoint_engine_as(types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(
                save=lambda obj, where: None)), lambda own: own):
            pass
    # a DeepSpeed whose private builders are gone or changed: DeepSpeed's whole save runs instead (False)
    assert deepspeed_patches.state_only_save(types.SimpleNamespace(), "d", "t", {}) is False
    changed = types.SimpleNamespace(**{name: (lambda *a: None) for name in deepspeed_patches._BUILDERS})
    assert deepspeed_patches.state_only_save(changed, "d", "t", {}) is False


def test_the_installed_deepspeed_has_the_checkpoint_builders():
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name, params in deepspeed_patches._BUILDERS.items():
        registry.require_parameters("async_save_state", getattr(DeepSpeedEngine, name), params)
    registry.require_parameters("atomic_checkpoints", DeepSpeedEngine.save_checkpoint,
                                ("save_dir", "tag", "client_state", "save_latest"))
    assert not hasattr(DeepSpeedEngine, "usp") and not hasattr(DeepSpeedEngine, "wait_for_checkpoint")


def test_loaders_are_split_over_replicas_by_accelerates_sampler():
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    data = list(range(16))
    shard = BatchSamplerShard(BatchSampler(SequentialSampler(data), 2, False), num_processes=4, process_index=3)
    loader = DataLoader(data, batch_sampler=shard)
    assert accelerate.shard_over_replicas(loader, 2, 1) is loader
    assert [b.tolist() for b in loader] == [[2, 3], [6, 7], [10, 11], [14, 15]]  # replica 1 of 2
    with pytest.raises(ValueError, match="no accelerate batch sampler"):
        accelerate.shard_over_replicas(DataLoader(data, batch_size=2), 2, 1)


def test_the_trainer_route_and_the_gradient_boundary_go_through_accelerates_public_names():
    from accelerate import Accelerator
    from accelerate.state import GradientState

    from ds_usp.upstream.deepspeed import TRAINER_ROUTE

    accelerator = Accelerator.__new__(Accelerator)  # no state needed beyond the gradient state
    seen = []
    accelerator.prepare = lambda *models: seen.append(TRAINER_ROUTE.get()) or models
    accelerate.route_prepare(accelerator)
    assert accelerator.prepare("model") == ("model",) and seen == [True] and not TRAINER_ROUTE.get()

    accelerator.gradient_state = GradientState()
    accelerate.set_sync_gradients(accelerator, False)
    assert accelerator.gradient_state.sync_gradients is False
    accelerate.set_sync_gradients(accelerator, True)
    assert accelerator.gradient_state.sync_gradients is True

    class NoSetter:
        sync_gradients = property(lambda self: True)
    with pytest.raises(UpstreamChanged, match="not a property with a setter"):
        accelerate.set_sync_gradients(NoSetter(), False)


def test_checkpoint_rotation_is_held_back_and_restored(monkeypatch):
    import transformers

    from ds_usp.upstream import transformers_trainer

    args = types.SimpleNamespace(save_total_limit=2)
    with transformers_trainer.rotation_held_back(args) as limit:
        assert limit == 2 and args.save_total_limit is None
    assert args.save_total_limit == 2
    transformers_trainer._rotates_inside_save.cache_clear()
    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", lambda self, model, trial: None)
    with pytest.raises(UpstreamChanged, match="does not rotate with self.args.save_total_limit"):
        with transformers_trainer.rotation_held_back(args):
            pass
    assert args.save_total_limit == 2
    monkeypatch.undo()
    transformers_trainer._rotates_inside_save.cache_clear()


def test_trl_generation_batch_is_divided_once_and_checked(monkeypatch):
    pytest.importorskip("trl")
    from ds_usp.upstream import trl as trl_patches

    class Config:
        def __init__(self):
            self.per_device_train_batch_size, self.steps_per_generation, num_processes = 2, 2, 4
            self.generation_batch_size = self.per_device_train_batch_size * num_processes * self.steps_per_generation

        __post_init__ = __init__

    config = Config()
    trl_patches.generation_batch_per_group(config, 2)
    trl_patches.generation_batch_per_group(config, 2)  # the same config given to a second trainer
    assert config.generation_batch_size == 8
    trl_patches.generation_batch_per_group(types.SimpleNamespace(), 2)  # DPO's config has none: left alone

    class Other:
        generation_batch_size = 16

        def __post_init__(self):
            self.generation_batch_size = 16
    with pytest.raises(UpstreamChanged, match="computes generation_batch_size otherwise"):
        trl_patches.generation_batch_per_group(Other(), 2)

    model = torch.nn.Linear(1, 1)
    trl_patches.record_fused_head(model, "_ds_usp_fused_head", (0.7, True))
    assert model._ds_usp_fused_head == (0.7, True)
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "add_fused_lm_head", lambda model, temperature: None)
    with pytest.raises(UpstreamChanged, match="takes no cast_lm_head_to_fp32"):
        trl_patches.record_fused_head(model, "_ds_usp_fused_head", (0.7, True))


def test_zero_optimizer_check_looks_in_the_list_before_importing_muon(monkeypatch):
    """DeepSpeed's check imports Muon (torch.compile: torch's inductor, seconds a rank) before it looks in its list:
    after the patch a listed optimizer is answered from the list, an unlisted one by DeepSpeed's own check; a check
    that is not DeepSpeed's is refused."""
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import utils

    asked = []

    def original(optimizer):
        asked.append(type(optimizer).__name__)
        return False

    monkeypatch.setattr(utils, "is_zero_supported_optimizer", original)
    monkeypatch.setattr(engine_module, "is_zero_supported_optimizer", original)
    deepspeed_patches.check_zero_optimizers_first()
    deepspeed_patches.check_zero_optimizers_first()  # idempotent
    check = engine_module.is_zero_supported_optimizer
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    assert type(adamw) in utils.ZERO_SUPPORTED_OPTIMIZERS and check(adamw) and asked == []
    assert not check(types.SimpleNamespace()) and asked == ["SimpleNamespace"]
    monkeypatch.setattr(engine_module, "is_zero_supported_optimizer", lambda optimizer: True)  # not DeepSpeed's
    with pytest.raises(UpstreamChanged, match="is_zero_supported_optimizer"):
        deepspeed_patches.check_zero_optimizers_first()


def test_rollouts_under_zero3_use_torchs_linear_and_put_deepspeeds_back(monkeypatch):
    """Where ZeRO-3 left DeepSpeed's zero3_linear_wrap as torch.nn.functional.linear, a rollout's block runs torch's
    (kept by DeepSpeed as linear_bk) and DeepSpeed's is back after it, also after an error; without the wrapper
    nothing changes; a wrapper without the kept original is refused."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero import linear as zero_linear
    from deepspeed.runtime.zero import partition_parameters

    hooks = partition_parameters.InsertPostInitMethodToModuleSubClasses
    torchs = getattr(hooks, "linear_bk", F.linear)
    monkeypatch.setattr(F, "linear", torchs)
    with deepspeed_patches.torch_linear():  # no ZeRO-3 wrapper: as it was
        assert F.linear is torchs
    monkeypatch.setattr(hooks, "linear_bk", torchs, raising=False)
    monkeypatch.setattr(F, "linear", zero_linear.zero3_linear_wrap)
    with pytest.raises(RuntimeError, match="inside"):
        with deepspeed_patches.torch_linear():
            assert F.linear is torchs
            x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
            assert torch.equal(F.linear(x, w), zero_linear.zero3_linear_wrap(x, w))  # the same product
            raise RuntimeError("inside")
    assert F.linear is zero_linear.zero3_linear_wrap
    monkeypatch.delattr(hooks, "linear_bk")
    with pytest.raises(UpstreamChanged, match="linear_bk"):
        with deepspeed_patches.torch_linear():
            pass


def test_module_attributes_are_only_the_recorded_ones():
    """``set_module_attribute`` sets ds-usp's own names and the two model attributes its record lists, and nothing
    else: an unlisted name is a programming error, a class that defines one of ds-usp's names is refused by name."""
    from torch import nn

    layer = nn.Linear(2, 2)
    torch_patches.set_module_attribute(layer, "_usp_context", "ctx")
    assert layer._usp_context == "ctx"
    with pytest.raises(ValueError, match="'weight' is not an attribute the module_attributes record lists"):
        torch_patches.set_module_attribute(layer, "weight", None)

    class Owns(nn.Module):
        _ds_usp_fused_head = "the class's own"

    with pytest.raises(UpstreamChanged, match="Owns defines _ds_usp_fused_head itself"):
        torch_patches.set_module_attribute(Owns(), "_ds_usp_fused_head", 1)
    with pytest.raises(UpstreamChanged, match="Linear has no recurrent_states of its own"):
        torch_patches.set_module_attribute(layer, "recurrent_states", None)
