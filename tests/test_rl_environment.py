"""A GRPO ``environment_factory`` whose ``reset`` draws from Python's ``random``, NumPy's global state and torch's CPU
generator, under sequence parallelism (issue 64). TRL seeds each process differently (``set_seed(seed,
device_specific=True)``), and every rank of an SP group runs TRL's environment resets and tool loop over the group's
whole batch: before ds-usp gave the group its first rank's random states at the start of each rollout, the ranks of a
group drew different observations, rendered different prompts, and the split rollout refused them ("different
generation calls or hold different rows").

4 gloo ranks at (U, R) = 2x2 ZeRO-2 (one replica), 3 GRPO steps with tool turns (the environment's ``add``), against
TRL's trainer in one process with the keyed sampler: every rank of the group draws the same, and the same as one
process, since the group's first rank is process 0 as one process is (TRL's seed for it is the one process's); the
completions, every logged metric and the final parameters are one process's. At 2x1 with 2 replicas, each group's
ranks draw the same, and group ``k`` draws TRL's process ``k`` of a 2-process run's Python and NumPy streams (ds-usp
seeds each rank with its replica's index: seeded by rank, group 1 drew process 2's of a 4-process run).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from test_rl import STEPS, _chat_tokenizer, _common, _ds_config, _one_process, _reward_chat, _same, _summary, _train

pytest.importorskip("trl")
DRAWS: list = []  # on each rank: (python, numpy, torch) drawn by each environment reset, in order
LAYOUT = (2, 2, 2, "zigzag")  # ZeRO stage, U, R, layout: one replica of 4 ranks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with a byte-level tokenizer and Qwen3's chat template (tests/test_rl.py's tool model)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = str(tmp_path_factory.mktemp("tools"))
    torch.manual_seed(0)
    tokenizer = _chat_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Counter:
    """An environment whose reset draws a secret offset from the process's random states and shows it."""

    def __init__(self) -> None:
        self.offset = 0

    def reset(self, **kwargs) -> str:
        draw = (random.randint(0, 999), int(np.random.randint(0, 999)), int(torch.randint(0, 999, (1,))))
        DRAWS.append(draw)
        self.offset = draw[0] % 5 + draw[1] % 3 + draw[2] % 2
        return f" (offset {self.offset})"

    def add(self, a: int, b: int) -> int:
        """Add two integers and the environment's offset.

        Args:
            a: The first.
            b: The second.
        """
        return a + b + self.offset


def _trainer(model_dir: str, out: str, use_usp: bool, layout: tuple = LAYOUT):
    """ds-usp's GRPO trainer on every rank at ``layout``, or TRL's own with the keyed sampler in one process."""
    import ds_usp  # noqa: F401 - registers "usp" and the deepspeed.initialize hook
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ds_usp.integration.trainers.rl import KeyedRolloutMixin
    from test_hf_trainer import _fresh_accelerate

    stage, u, r, order = layout
    seen: list = []

    def keep(self, inputs):  # the completions of each rollout, as trained on, without the right padding
        batch = super(cls, self)._generate_and_score_completions(inputs)
        pad = self.processing_class.pad_token_id
        seen.append([row[:len(row) - next((i for i, t in enumerate(reversed(row)) if t != pad), len(row))]
                     for row in batch["completion_ids"].tolist()])
        return batch

    base = ds_usp.USPGRPOTrainer if use_usp else type("OneProcess", (KeyedRolloutMixin, GRPOTrainer), {})
    cls = type(base.__name__, (base,), {"_generate_and_score_completions": keep})
    _fresh_accelerate()
    replicas = 4 // (u * r) if use_usp else 1  # the same global batch of 8 rows (2 prompts) per step
    args = GRPOConfig(**_common(out, _ds_config(stage, u, r, order, {"timeout_seconds": 300}) if use_usp else None),
                      per_device_train_batch_size=8 // replicas, num_generations=4, temperature=0.8,
                      shuffle_dataset=False, max_completion_length=256, loss_type="grpo")
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"add {i} and {i * i % 9}"}]
                                            for i in range(16)]})
    trainer = cls(model=model_dir, reward_funcs=[_reward_chat], args=args, train_dataset=prompts,
                  processing_class=_chat_tokenizer(), environment_factory=Counter)
    return trainer, seen


def train(model_dir: str, out: str, layout: tuple = LAYOUT) -> dict:
    """On every rank: the run at ``layout``; its logs, final parameters, completions and environment draws."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    DRAWS.clear()
    trainer, seen = _trainer(model_dir, out, True, layout)
    _train(trainer, "tools")  # TRL's generation call made to call the environment's add (tests/test_rl.py)
    return {**_summary(trainer, layout[0]), "completions": seen, "draws": list(DRAWS)}


def _reference(model_dir: str, out: str) -> dict:
    DRAWS.clear()
    with _one_process():
        trainer, seen = _trainer(model_dir, out, False)
        _train(trainer, "tools")
        return {**_summary(trainer, 0), "completions": seen, "draws": list(DRAWS)}


def _streams(seed: int, n: int) -> list:
    """The first ``n`` of :class:`Counter`'s Python and NumPy draws after ``set_seed(seed)``."""
    python, numpy = random.Random(seed), np.random.RandomState(seed)
    return [(python.randint(0, 999), int(numpy.randint(0, 999))) for _ in range(n)]


def test_environment_draws_are_the_groups_first_ranks(world4, model_dir, tmp_path_factory):
    results = world4.run(train, model_dir, str(tmp_path_factory.mktemp("usp")))
    want = _reference(model_dir, str(tmp_path_factory.mktemp("ref")))
    assert len(want["draws"]) == 8 * STEPS and len(set(want["draws"])) > 1  # one reset per row, each rollout
    assert [d[:2] for d in want["draws"]] == _streams(0, len(want["draws"]))  # only the environment draws from them
    for k, res in enumerate(results):  # every rank of the group drew what one process draws
        assert res["draws"] == want["draws"], (k, res["draws"], want["draws"])
        assert res["completions"] == want["completions"], k
    assert any(len({tuple(c) for c in rows}) > 1 for rows in want["completions"])
    tokenizer = _chat_tokenizer()  # the environment's tool ran, with its offset in the conversation
    assert any("<tool_response>" in tokenizer.decode(c) for rows in want["completions"] for c in rows)
    _same(results[0], want)


def test_with_two_replicas_each_group_draws_what_trls_process_of_its_replica_draws(world4, model_dir,
                                                                                   tmp_path_factory):
    """2 replicas of an SP group of 2 (2x1 ZeRO-2): each group's ranks draw the same, and group k draws what TRL's
    process k of a 2-process data-parallel run draws: TRL seeds that process with ``seed + k`` (ds-usp seeds each
    rank with its replica's index, not its rank), and nothing but the environment draws from Python's or NumPy's
    global state here (one process's draws are the streams of ``seed``: the test above), so group k's are the
    streams of ``seed + k``. TRL also draws from torch's generator between resets (its batch shuffle): the torch
    draws are checked within the group only. (Seeded by rank, group 1 drew the streams of ``seed + 2``.)"""
    results = world4.run(train, model_dir, str(tmp_path_factory.mktemp("usp")), (2, 2, 1, "zigzag"))
    for k, res in enumerate(results):  # group-consistent: the first rank's draws, completions and logs
        first = results[k - k % 2]
        assert (res["draws"], res["completions"], res["logs"]) == (first["draws"], first["completions"],
                                                                    first["logs"]), k
    for replica in range(2):  # the seed is 0 (test_rl._common)
        draws = results[2 * replica]["draws"]
        assert len(draws) == 4 * STEPS  # one reset per row of the replica's 4, each rollout
        assert [d[:2] for d in draws] == _streams(replica, len(draws)), replica
    assert results[0]["draws"] != results[2]["draws"]
