"""TRL's GRPO, RLOO and DPO with USP on 4 CPU ranks, against the plain TRL trainer in one process.

A tiny Llama (saved once, loaded by path as TRL builds its reference model from the policy's path) trains 3 optimizer
steps with SGD; (U, R) = (2, 2) zigzag and (1, 4) contiguous, ZeRO-2 and ZeRO-3, and SP groups of 2 with 2 data-parallel
replicas (the same global batch split over them). GRPO and RLOO take deterministic
rollouts from a ``rollout_func`` (prompts of odd lengths, left-padded by TRL; completions of 3..15 tokens, some ended by
EOS, right-padded), so the single process sees the same samples: every logged metric (loss, rewards, advantages' std,
KL, clip ratios, entropy, completion lengths, tokens seen) and every final parameter equal it (rtol 1e-4). GRPO with
real sampling (``model.generate``) runs under the same check that the ranks of the group hold the same batch. What
sequence parallelism does not do is refused by name before any step.
"""
from __future__ import annotations

import math

import pytest
import torch

from test_hf_trainer import _fresh_accelerate

pytest.importorskip("trl")
WORLD_TIMEOUT = 900
VOCAB, STEPS, LR = 64, 3, 0.1
TOL = dict(rtol=1e-4, atol=1e-6)
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch",
          "total_flos", "train_loss")


def _config(family: str):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2)
    return LlamaConfig(**common) if family == "llama" else Qwen3Config(**common, head_dim=8)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny random Llama and Qwen3, saved with the tokenizer (TRL loads the reference model from the path)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for family in ("llama", "qwen3"):
        path = str(tmp_path_factory.mktemp(family))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).save_pretrained(path)
        _tokenizer().save_pretrained(path)
        dirs[family] = path
    return dirs


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2",
                                   unk_token="t3")


def _prompts(n: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    lens = [5 + 2 * (i % 6) for i in range(n)]  # odd lengths, 5..15
    return Dataset.from_dict({"prompt": [" ".join(f"t{t}" for t in torch.randint(4, VOCAB, (m,), generator=g).tolist())
                                         for m in lens]})


def _completions(prompt_ids: list) -> list:
    """Deterministic completions: a function of the prompt and its place in the batch."""
    completion_ids = []
    for i, ids in enumerate(prompt_ids):
        i %= 4  # the generation's index among the prompt's num_generations: the same however prompts are split
        g = torch.Generator().manual_seed(sum(ids) * 31 + i)
        completion = torch.randint(4, VOCAB, (3 + (sum(ids) + 5 * i) % 13,), generator=g).tolist()
        if i % 3:
            completion[-1] = 1  # EOS: two thirds terminate, the others are truncated
        completion_ids.append(completion)
    return completion_ids


def _rollout(prompts: list, trainer) -> dict:
    """GRPO's rollout_func: the prompts tokenized, :func:`_completions`."""
    prompt_ids = [trainer.processing_class(prompt)["input_ids"] for prompt in prompts]
    completion_ids = _completions(prompt_ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids]}


def _reward_even(completions, **kwargs):
    return [sum(int(t[1:]) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]


def _reward_long(completions, **kwargs):
    return [math.log1p(len(c.split())) for c in completions]


def _ds_config(stage: int, u: int, r: int, layout: str, usp: dict = {}) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "sequence_parallel": "usp", "sequence_parallel_size": u * r,
            "usp": {"ulysses_degree": u, "ring_degree": r, "layout": layout, **usp}}


def _common(out: str, ds_config) -> dict:
    return dict(output_dir=out, deepspeed=ds_config, use_cpu=True, max_steps=STEPS, logging_steps=1, report_to=[], bf16=False,
                save_strategy="no", learning_rate=LR, optim="sgd", max_grad_norm=1.0, seed=0,
                model_init_kwargs={"attn_implementation": "usp" if ds_config else "sdpa", "dtype": torch.float32})


def _summary(trainer, stage: int) -> dict:
    import deepspeed

    logs = [{k: v for k, v in h.items() if k not in TIMING and isinstance(v, (int, float))}
            for h in trainer.state.log_history]
    params = list(trainer.model.parameters())
    with deepspeed.zero.GatheredParameters(params) if stage == 3 else _null():
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"logs": [h for h in logs if len(h) > 1], "params": weights}


def _null():
    import contextlib

    return contextlib.nullcontext()


GRPO_CASES = [  # (model, zero stage, U, R, layout, loss_type, beta, extra GRPOConfig)
    ("llama", 2, 2, 2, "zigzag", "dapo", 0.0, {}),
    ("qwen3", 3, 1, 4, "contiguous", "grpo", 0.05, {"importance_sampling_level": "sequence"}),
    ("llama", 2, 1, 4, "contiguous", "dr_grpo", 0.05, {"scale_rewards": "batch", "top_entropy_quantile": 0.5}),
    ("qwen3", 3, 2, 2, "zigzag", "bnpo", 0.0, {"num_iterations": 2, "epsilon": 0.05}),
    ("llama", 2, 2, 1, "zigzag", "dapo", 0.05, {}),  # 2 replicas of an SP group of 2
    ("qwen3", 3, 1, 2, "contiguous", "grpo", 0.0, {"scale_rewards": "batch"}),
]


def _grpo(model_dir: str, out: str, case: tuple, use_usp: bool, rollout: bool = True, rloo: bool = False):
    import ds_usp  # noqa: F401 - registers "usp" and the deepspeed.initialize hook
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    _, stage, u, r, layout, loss_type, beta, extra = case
    extra = dict(extra)
    usp = extra.pop("usp", {})
    if rloo:
        cls = ds_usp.USPRLOOTrainer if use_usp else RLOOTrainer
    else:
        cls = ds_usp.USPGRPOTrainer if use_usp else GRPOTrainer  # imported before the config, as a user script does
    _fresh_accelerate()
    replicas = 4 // (u * r) if use_usp else 1  # the same global batch of 8 completions (2 prompts) per step
    settings = dict(per_device_train_batch_size=8 // replicas, num_generations=4, max_completion_length=16, temperature=0.8,
                    beta=beta, shuffle_dataset=False, **({} if rloo else {"loss_type": loss_type}))
    args = (RLOOConfig if rloo else GRPOConfig)(**{**_common(out, _ds_config(stage, u, r, layout, usp) if use_usp else None), **settings, **extra})
    kwargs = dict(model=model_dir, reward_funcs=[_reward_even, _reward_long], args=args, train_dataset=_prompts(16),
                  processing_class=_tokenizer())
    if rloo:  # RLOO takes no rollout_func: its generation step gives the same deterministic completions
        cls = type(cls.__name__, (cls,), {"_generate_single_turn": lambda self, prompt_ids, *_: _completions(prompt_ids)})
    elif rollout:
        kwargs["rollout_func"] = _rollout
    trainer = cls(**kwargs)
    trainer.train()
    return trainer


def train_grpo(model_dir: str, out: str, case: tuple, rloo: bool = False) -> dict:
    """On every rank: USPGRPOTrainer (USPRLOOTrainer); its logs and final parameters."""
    return _summary(_grpo(model_dir, out, case, True, rloo=rloo), case[1])


def _same(got: dict, want: dict) -> None:
    assert len(got["logs"]) == len(want["logs"]) == STEPS
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
        assert sorted(g) == sorted(w), (sorted(g), sorted(w))
        for key in w:
            torch.testing.assert_close(torch.tensor(float(g[key])), torch.tensor(float(w[key])), **TOL,
                                       msg=lambda m: f"step {step + 1} {key}: {m}")
    for name, value in got["params"].items():
        torch.testing.assert_close(value, want["params"][name], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", GRPO_CASES, ids=[f"{c[0]}-zero{c[1]}-{c[2]}x{c[3]}-{c[5]}-beta{c[6]}"
                                                 for c in GRPO_CASES])
def test_grpo_equals_single_process(world4, model_dirs, tmp_path_factory, case):
    path = model_dirs[case[0]]
    results = world4.run(train_grpo, path, str(tmp_path_factory.mktemp("usp")), case)
    want = _summary(_grpo(path, str(tmp_path_factory.mktemp("ref")), case, False), 0)
    _fresh_accelerate()
    assert all(res["logs"] == results[0]["logs"] for res in results)  # the ranks of the group log the same
    _same(results[0], want)


RLOO_CASE = ("qwen3", 2, 2, 2, "zigzag", None, 0.05, {})


def test_rloo_equals_single_process(world4, model_dirs, tmp_path_factory):
    path = model_dirs["qwen3"]
    results = world4.run(train_grpo, path, str(tmp_path_factory.mktemp("usp")), RLOO_CASE, True)
    want = _summary(_grpo(path, str(tmp_path_factory.mktemp("ref")), RLOO_CASE, False, rloo=True), 0)
    _fresh_accelerate()
    _same(results[0], want)


def sampled_grpo(model_dir: str, out: str) -> list:
    """On every rank: USPGRPOTrainer generating with the model (sampling); the completions each rank trained on."""
    import trl.trainer.grpo_trainer as grpo

    import torch.distributed as dist

    seen = []
    score, generate = grpo.GRPOTrainer._generate_and_score_completions, grpo.GRPOTrainer._generate_single_turn

    def keep(self, inputs):
        batch = score(self, inputs)
        seen.append(batch["completion_ids"].tolist())
        return batch

    def sample_differently(self, *args, **kwargs):
        torch.manual_seed(100 + dist.get_rank())  # each rank samples other completions: only the first rank's count
        return generate(self, *args, **kwargs)

    grpo.GRPOTrainer._generate_and_score_completions = keep
    grpo.GRPOTrainer._generate_single_turn = sample_differently
    try:
        _grpo(model_dir, out, ("llama", 2, 2, 2, "zigzag", "dapo", 0.0, {"max_steps": 2}), True, rollout=False)
    finally:
        grpo.GRPOTrainer._generate_and_score_completions = score
        grpo.GRPOTrainer._generate_single_turn = generate
    return seen


def test_sampled_rollouts_are_the_same_on_every_rank_of_the_group(world4, model_dirs, tmp_path_factory):
    seen = world4.run(sampled_grpo, model_dirs["llama"], str(tmp_path_factory.mktemp("sampled")))
    assert len(seen[0]) == 2 and all(s == seen[0] for s in seen)
    assert len({tuple(row) for row in seen[0][0]}) > 1  # really sampled: the completions of a prompt differ


# ---- DPO --------------------------------------------------------------------------------------------------------

def _pairs(n: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(9)

    def text(m: int) -> str:
        return " ".join(f"t{t}" for t in torch.randint(4, VOCAB, (m,), generator=g).tolist())

    return Dataset.from_dict({"prompt": [text(3 + 2 * (i % 5)) for i in range(n)],
                              "chosen": [text(2 + (3 * i) % 11) for i in range(n)],
                              "rejected": [text(4 + (5 * i) % 9) for i in range(n)]})


DPO_CASES = [("llama", 2, 2, 2, "zigzag", ["sigmoid"]), ("qwen3", 3, 1, 4, "contiguous", ["ipo", "sft"]),
             ("llama", 3, 2, 1, "zigzag", ["sigmoid", "bco_pair"])]  # the last: 2 replicas


def _dpo(model_dir: str, out: str, case: tuple, use_usp: bool):
    import ds_usp
    from trl import DPOConfig, DPOTrainer

    _, stage, u, r, layout, loss_type = case
    cls = ds_usp.USPDPOTrainer if use_usp else DPOTrainer
    _fresh_accelerate()
    args = DPOConfig(**_common(out, _ds_config(stage, u, r, layout) if use_usp else None),
                     per_device_train_batch_size=4 // (4 // (u * r) if use_usp else 1), loss_type=loss_type, beta=0.2,
                     max_length=40)
    trainer = cls(model=model_dir, args=args, train_dataset=_pairs(12), processing_class=_tokenizer())
    trainer.train()
    return trainer


def train_dpo(model_dir: str, out: str, case: tuple) -> dict:
    """On every rank: USPDPOTrainer; its logs and final parameters."""
    return _summary(_dpo(model_dir, out, case, True), case[1])


@pytest.mark.parametrize("case", DPO_CASES, ids=[f"{c[0]}-zero{c[1]}-{c[2]}x{c[3]}-{'+'.join(c[5])}" for c in DPO_CASES])
def test_dpo_equals_single_process(world4, model_dirs, tmp_path_factory, case):
    path = model_dirs[case[0]]
    results = world4.run(train_dpo, path, str(tmp_path_factory.mktemp("usp")), case)
    want = _summary(_dpo(path, str(tmp_path_factory.mktemp("ref")), case, False), 0)
    _fresh_accelerate()
    _same(results[0], want)


# ---- refusals ---------------------------------------------------------------------------------------------------

REFUSED = {  # what a user asks for -> the words of the refusal
    "grpo_vllm": ("use_vllm=True", "USPGRPOTrainer"),
    "grpo_liger": ("Liger kernels", "USPGRPOTrainer"),
    "dpo_padding_free": ("padding_free=True", "USPDPOTrainer"),
    "dpo_precompute": ("precompute_ref_log_probs=True", "USPDPOTrainer"),
    "grpo_hybrid": ("linear attention / state-space layers", "USPGRPOTrainer"),
}


def refused(model_dir: str, out: str, what: str) -> str:
    """On every rank: a USP RL trainer asked for something SP does not do; the error it raises before training."""
    import ds_usp
    from trl import DPOConfig, GRPOConfig

    ds_config = _ds_config(2, 2, 2, "zigzag")
    _fresh_accelerate()
    try:
        if what.startswith("dpo"):
            extra = {"padding_free": True} if what == "dpo_padding_free" else {"precompute_ref_log_probs": True}
            cls = ds_usp.USPDPOTrainer
            args = DPOConfig(**_common(out, ds_config), per_device_train_batch_size=4, **extra)
            cls(model=model_dir, args=args, train_dataset=_pairs(8), processing_class=_tokenizer())
        else:
            cls = ds_usp.USPGRPOTrainer
            extra = {"grpo_vllm": {"use_vllm": True}, "grpo_liger": {"use_liger_kernel": True}}.get(what, {})
            args = GRPOConfig(**_common(out, ds_config), per_device_train_batch_size=8, num_generations=4, **extra)
            cls(model=_hybrid() if what == "grpo_hybrid" else model_dir, reward_funcs=_reward_even, args=args,
                train_dataset=_prompts(8), processing_class=_tokenizer())
    except ValueError as err:
        return str(err)
    return "no error"


def _hybrid():
    """A tiny Qwen3.5-style hybrid (Gated DeltaNet layers) built with the "usp" attention."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                          layer_types=["linear_attention", "full_attention"], num_experts=0, pad_token_id=0,
                          eos_token_id=1)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="usp", dtype=torch.float32)


def test_what_sequence_parallelism_does_not_do_is_refused_by_name(world4, model_dirs, tmp_path_factory):
    for what, words in REFUSED.items():
        messages = world4.run(refused, model_dirs["llama"], str(tmp_path_factory.mktemp(what)), what)
        assert all(all(w in m for w in words) and "not supported" in m for m in messages), (what, messages)
