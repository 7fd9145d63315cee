"""Split rollouts (issue 51), the pieces in one process (no gloo world): the keyed sampler's draws do not depend on the
batch, the share or the order of the rows, and follow softmax(warped scores); the shares are contiguous, balanced and
concatenate in rank order; a tool turn's rows are keyed by their first-turn row; the ranks' rollout_func outputs are
joined key by key or refused by name; only a rollout_func that says so is split (issue 64); the patches of TRL's
generate call and of DeepSpeed's start-of-forward hook check TRL and restore what they change. The split runs
themselves (4 ranks against one process) are tests/test_rl.py's and tests/test_rollout_func.py's.
"""
from __future__ import annotations

import pytest
import torch

from test_rl import VOCAB, _config

pytest.importorskip("trl")


# ---- the pieces, in one process ------------------------------------------------------------------------------------

def _tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config("llama")).eval()


def test_keyed_draws_do_not_depend_on_the_batch_or_its_order():
    """A row's completion is the same whole, in any share of the rows, and in a shuffled batch; the draws follow
    softmax(warped scores)."""
    from transformers import GenerationConfig, LogitsProcessorList

    from ds_usp.integration.trainers.rollout import KeyedSampler, greedy, row_key, sampling_warpers

    model = _tiny_llama()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, VOCAB, (5 + 2 * (i % 6),), generator=g).tolist() for i in range(4)]
    rows = [p for p in prompts for _ in range(4)]  # TRL's num_generations copies, consecutive
    sampling = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=0.8, top_p=0.95, top_k=20,
                                pad_token_id=0, eos_token_id=1)
    keys = [row_key(0, 2, i, 0) for i in range(len(rows))]

    def generate(part: list, part_keys: list) -> list:
        width = max(len(r) for r in part)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in part])
        mask = (ids != 0).long()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy(sampling),
                                 logits_processor=LogitsProcessorList([KeyedSampler(part_keys,
                                                                                    sampling_warpers(sampling))]))
        return [c[:c.index(1) + 1] if 1 in c else c for c in out[:, width:].tolist()]

    whole = generate(rows, keys)
    for size in (2, 3, 4):
        bounds = [len(rows) * k // size for k in range(size + 1)]
        assert [c for k in range(size) for c in generate(rows[bounds[k]:bounds[k + 1]], keys[bounds[k]:bounds[k + 1]])
                ] == whole, size
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(3)).tolist()
    shuffled = generate([rows[i] for i in order], [keys[i] for i in order])
    assert [shuffled[order.index(i)] for i in range(len(rows))] == whole
    assert all(len({tuple(c) for c in whole[4 * p:4 * p + 4]}) > 1 for p in range(4))  # the copies differ
    # one step's draws over 20000 keys against softmax(warped scores)
    scores = torch.randn(1, VOCAB, generator=g)
    sampler = KeyedSampler(range(20000), sampling_warpers(sampling))
    drawn = sampler(torch.zeros(20000, 3, dtype=torch.long), scores.expand(20000, -1).clone()).argmax(-1)
    warped = scores
    for warper in sampling_warpers(sampling):
        warped = warper(None, warped)
    tv = 0.5 * (torch.bincount(drawn, minlength=VOCAB) / 20000 - warped.softmax(-1)[0]).abs().sum()
    assert tv < 0.03, tv  # sampling noise alone: ~0.01


def test_shares_are_contiguous_balanced_and_in_order():
    from ds_usp.integration.trainers.rollout import in_rank_order, share

    for n in range(0, 13):
        for size in (1, 2, 3, 4):
            for unit in (1, 2, 4):
                parts = [list(range(*share(n, size, r, unit))) for r in range(size)]
                assert in_rank_order(parts) == list(range(n))
                lengths = [len(p) for p in parts]
                step = unit if n % (unit * size) == 0 else 1
                assert max(lengths) - min(lengths) <= step and all(x % step == 0 for x in lengths), (n, size, unit)
    assert share(16, 2, 1, 4) == (8, 16) and share(8, 4, 1, 4) == (2, 4)  # whole prompt groups when they divide


def test_tool_turn_rows_are_keyed_by_their_first_turn_row():
    from ds_usp.integration.trainers.rollout import Rollout, row_key

    prompts = [[5, 6], [5, 6], [7], [7]]
    completions = [[9, 1], [9, 1], [8], [3, 1]]  # rows 0 and 1 alike
    rollout = Rollout(seed=1, round=4, offset=8, prompt_ids=prompts, completion_ids=completions, calls=1)
    rows = [prompts[1] + completions[1] + [40], prompts[2] + completions[2] + [41]]  # rows 1 and 2 called a tool
    keys = rollout.keys(rows)
    # the first row matches row 0 (alike: the same key order as in one process), the second row 2
    assert keys == [row_key(1, 4, 8, 1), row_key(1, 4, 10, 1)]
    assert rollout.keys([[99, 98]])[0] != rollout.keys([[99, 97]])[0]  # no first-turn row: keyed by content


def test_rollout_func_shares_are_joined_key_by_key_or_refused_by_name():
    from ds_usp.integration.trainers.rollout import merge_rollout_outputs

    parts = [{"prompt_ids": [[1], [2]], "completion_ids": [[3], [4]], "logprobs": [[0.0], [0.0]], "tag": "x"}, None,
             {"prompt_ids": [[5]], "completion_ids": [[6]], "logprobs": [[0.0]], "tag": "x"}]
    merged = merge_rollout_outputs(parts, [2, 0, 1])
    assert merged == {"prompt_ids": [[1], [2], [5]], "completion_ids": [[3], [4], [6]],
                      "logprobs": [[0.0], [0.0], [0.0]], "tag": "x"}
    for bad, words in (({"tag": "y"}, "'tag' is not a list and differs"),
                       ({"logprobs": [[0.0], [0.0]]}, "'logprobs' holds 2 values for a share of 1"),
                       ({"extra": 1}, "different keys")):
        with pytest.raises(ValueError, match=words):
            merge_rollout_outputs([parts[0], {**parts[2], **bad}], [2, 1])


def test_only_a_rollout_func_that_says_so_is_split():
    """A rollout_func is called once per SP group (as TRL calls it) unless it opts in to split calls: an attribute
    ``takes_rollout_rows = True`` on the function, on the object it is a method of, or on what a partial wraps."""
    import functools

    from ds_usp.integration.trainers.rl import takes_rollout_rows

    def plain(prompts, trainer):
        return {}

    def split(prompts, trainer):
        return {}

    split.takes_rollout_rows = True

    class Server:
        takes_rollout_rows = True

        def __call__(self, prompts, trainer):
            return {}

        def rollout(self, prompts, trainer):
            return {}

    assert not takes_rollout_rows(plain) and not takes_rollout_rows(functools.partial(plain))
    assert takes_rollout_rows(split) and takes_rollout_rows(functools.partial(split))
    assert takes_rollout_rows(Server()) and takes_rollout_rows(Server().rollout)
    plain.takes_rollout_rows = "yes"  # only True opts in
    assert not takes_rollout_rows(plain)


def test_generation_patches_check_trl_and_restore_what_they_change(monkeypatch):
    """The generate arguments are bound for the block only (an enclosing block's come back); a TRL whose generation
    call changed is refused by name; DeepSpeed's start-of-forward hook goes back to its place."""
    import trl

    from ds_usp.upstream import trl as trl_patches
    from ds_usp.upstream.deepspeed import start_of_forward_hook_off
    from ds_usp.upstream.registry import UpstreamChanged

    model = _tiny_llama()
    with trl_patches.generate_arguments(model, trl.GRPOTrainer, synced_gpus=False):
        outer = model.generate
        with trl_patches.generate_arguments(model, trl.RLOOTrainer, synced_gpus=False, logits_processor=[]):
            assert model.generate.keywords == {"synced_gpus": False, "logits_processor": []}
        assert model.generate is outer and outer.keywords == {"synced_gpus": False}
    assert "generate" not in model.__dict__
    with pytest.raises(UpstreamChanged, match="takes no no_such_argument"):
        with trl_patches.generate_arguments(model, trl.GRPOTrainer, no_such_argument=1):
            pass
    changed = type("Changed", (trl.GRPOTrainer,), {"_generate_single_turn": lambda self, *a: None})
    changed.__module__ = "trl.changed"
    with pytest.raises(UpstreamChanged, match="does not call unwrapped_model.generate"):
        with trl_patches.generate_arguments(model, changed, synced_gpus=False):
            pass

    module = torch.nn.Linear(2, 2)
    first = module.register_forward_pre_hook(lambda m, a: None)
    handle = module.register_forward_pre_hook(lambda m, a: None)
    last = module.register_forward_pre_hook(lambda m, a: None)
    engine = type("Engine", (), {})()
    engine.optimizer = type("Stage3", (), {})()
    engine.optimizer.parameter_offload = type("Offload", (), {"fwd_pre_hook": handle, "module": module})()
    with start_of_forward_hook_off(engine):
        assert list(module._forward_pre_hooks) == [first.id, last.id]
    assert list(module._forward_pre_hooks) == [first.id, handle.id, last.id]
    engine.optimizer.parameter_offload.fwd_pre_hook = None
    with pytest.raises(UpstreamChanged, match="keeps no fwd_pre_hook"):
        with start_of_forward_hook_off(engine):
            pass


def test_accelerate_operations_and_trls_seed_see_the_replicas_and_come_back(monkeypatch):
    """Inside the replicas view, accelerate's operations module counts the replicas (its other state and the rest of
    torch are the real ones) and TRL's ``set_seed(seed, device_specific=True)`` adds the replica's index, not the
    rank; both come back after the block; a trainer module whose ``set_seed`` is not accelerate's is refused."""
    import random
    import types

    import accelerate.state
    import accelerate.utils.operations as operations
    import trl.trainer.grpo_trainer as grpo

    from ds_usp.upstream.accelerate import operations_over_replicas
    from ds_usp.upstream.registry import UpstreamChanged
    from ds_usp.upstream.trl import seed_per_replica

    state = type("State", (), {"num_processes": 8, "process_index": 5, "backend": "gloo"})
    monkeypatch.setattr(operations, "PartialState", state)
    with operations_over_replicas(None, 2, 1):
        seen = operations.PartialState()
        assert (seen.num_processes, seen.process_index, seen.backend) == (2, 1, "gloo")
        assert operations.torch.cat is torch.cat and operations.torch.distributed.get_rank is \
            torch.distributed.get_rank
    assert operations.PartialState is state and operations.torch is torch

    monkeypatch.setattr(accelerate.state, "AcceleratorState", state)  # rank 5 of 8: replica 2 of an SP size of 2
    set_seed = grpo.set_seed
    with seed_per_replica((grpo,), 2):
        grpo.set_seed(10, device_specific=True)
        assert random.random() == random.Random(12).random()
        grpo.set_seed(10)
        assert random.random() == random.Random(10).random()
    assert grpo.set_seed is set_seed
    with pytest.raises(UpstreamChanged, match="set_seed is not accelerate's"):
        with seed_per_replica((types.ModuleType("planted"),), 2):
            pass
