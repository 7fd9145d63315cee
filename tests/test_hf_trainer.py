"""HF ``Trainer`` and TRL ``SFTTrainer`` with USP on 4 CPU ranks, against the same trainer in one process.

The user's change is an import and a class (``ds_usp.USPTrainer`` / ``USPSFTTrainer``) and
``"sequence_parallel": "usp"`` in the DeepSpeed JSON (here a dict, with HF's ``"auto"`` values). A tiny
Llama (tests/test_training.py's) trains 5 steps with gradient accumulation 2 and ``max_grad_norm``
1.0, SGD; (U, R) = (2, 2) zigzag and (4, 1), ZeRO-2 and ZeRO-3. Every logged loss and grad norm, the
evaluation loss and the parameters after training equal the plain ``Trainer``'s in one process
without DeepSpeed on the same data (rtol 1e-5, atol 1e-6; parameters 1e-4 as in test_training);
tokens seen count every real token once; ``predict`` returns the whole sequences' logits. Resume from
a checkpoint saved at step 2 continues the losses bitwise. An ``SFTTrainer`` with ``packing=True``
(TRL's padding-free packing) matches its single-process twin for 3 steps.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from test_training import SEQ, VOCAB, _batch, _llama, _params

pytest.importorskip("accelerate")
STEPS, GAS, LR = 5, 2, 0.05
TOL = dict(rtol=1e-5, atol=1e-6)
SPLITS = [(2, 2, 2, "zigzag"), (3, 2, 2, "zigzag"), (2, 4, 1, "contiguous"), (3, 4, 1, "zigzag")]


WORLD_TIMEOUT = 600


def _dataset(n: int):
    from datasets import Dataset

    rows = [_batch(i) for i in range(n)]
    return Dataset.from_dict({"input_ids": [r["input_ids"][0].tolist() for r in rows],
                              "labels": [r["labels"][0].tolist() for r in rows]})


def _args(out: str, ds_config, **extra):
    from transformers import TrainingArguments

    settings = dict(output_dir=out, deepspeed=ds_config, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=1,
                    per_device_eval_batch_size=1, gradient_accumulation_steps=GAS, logging_steps=1, report_to=[],
                    save_strategy="no", learning_rate=LR, optim="sgd", max_grad_norm=1.0,
                    train_sampling_strategy="sequential", include_num_input_tokens_seen="non_padding", seed=0)
    return TrainingArguments(**{**settings, **extra})


def _ds_config(stage: int, u: int, r: int, layout: str) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "sequence_parallel": "usp", "sequence_parallel_size": u * r,
            "usp": {"ulysses_degree": u, "ring_degree": r, "layout": layout}}


def _fresh_accelerate() -> None:
    """Forget the accelerate state of an earlier trainer in this process (tests run several)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _same_weights(model, reference: dict):
    """``reference``'s weights into ``model``: under zero.Init the random initialization draws differently."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        for name, param in model.named_parameters():
            param.data.copy_(reference[name])
    return model


def _summary(trainer, stage: int) -> dict:
    logs = trainer.state.log_history
    return {"loss": [h["loss"] for h in logs if "loss" in h], "grad_norm": [h["grad_norm"] for h in logs if "grad_norm" in h],
            "tokens": trainer.state.num_input_tokens_seen, "params": _params(trainer.model_wrapped, stage)
            if stage else {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}


def train_trainer(out: str, stage: int, u: int, r: int, layout: str, resume: Any = False, save: bool = False,
                  async_save: bool = False) -> dict:
    """On every rank: USPTrainer on the DeepSpeed JSON with "sequence_parallel" (and ``usp.async_save``); returns its
    logs and parameters."""
    from ds_usp import USPTrainer

    _fresh_accelerate()
    reference = _llama("sdpa").state_dict()  # before the arguments switch HF's zero.Init on
    extra = {"save_strategy": "steps", "save_steps": 2} if save else {}
    config = _ds_config(stage, u, r, layout)
    config["usp"]["async_save"] = async_save
    args = _args(out, config, **extra)
    model = _same_weights(_llama("usp"), reference)  # ZeRO-3: built inside HF's zero.Init (the arguments came first)
    trainer = USPTrainer(model=model, args=args, train_dataset=_dataset(STEPS * GAS), eval_dataset=_dataset(4))
    engine_ok = trainer.state is not None
    # resume: "auto" (True: the newest complete checkpoint-N), True (checkpoint-2 by path) or False
    trainer.train(resume_from_checkpoint=True if resume == "auto" else
                  os.path.join(out, "checkpoint-2") if resume else None)
    result = _summary(trainer, stage)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["mpu"] = type(trainer.model_wrapped.mpu).__name__ if engine_ok else None
    predictions = trainer.predict(_dataset(2))
    result["predictions"] = torch.as_tensor(predictions.predictions)
    if save:
        trainer.save_model(os.path.join(out, "final"))
    return result


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The plain Trainer in this process, no DeepSpeed, no sequence parallelism."""
    from transformers import Trainer

    _fresh_accelerate()
    trainer = Trainer(model=_llama("sdpa"), args=_args(str(tmp_path_factory.mktemp("ref")), None),
                      train_dataset=_dataset(STEPS * GAS), eval_dataset=_dataset(4))
    trainer.train()
    result = _summary(trainer, 0)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["predictions"] = torch.as_tensor(trainer.predict(_dataset(2)).predictions)
    _fresh_accelerate()
    return result


@pytest.mark.parametrize("stage,u,r,layout", SPLITS, ids=[f"zero{s}-{u}x{r}-{lay}" for s, u, r, lay in SPLITS])
def test_trainer_equals_single_process(world4, tmp_path_factory, single_process, stage, u, r, layout):
    results = world4.run(train_trainer, str(tmp_path_factory.mktemp("usp")), stage, u, r, layout)
    got, want = results[0], single_process
    assert got["mpu"] == "USPMpu"
    assert len(got["loss"]) == STEPS and all(res["loss"] == got["loss"] for res in results)
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), **TOL)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(want["grad_norm"]), **TOL)
    torch.testing.assert_close(torch.tensor(got["eval_loss"]), torch.tensor(want["eval_loss"]), **TOL)
    assert got["tokens"] == want["tokens"] == STEPS * GAS * SEQ  # every real token once, not the shards' padding
    for name, value in got["params"].items():
        torch.testing.assert_close(value, want["params"][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert got["predictions"].shape == want["predictions"].shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(got["predictions"], want["predictions"], rtol=1e-4, atol=1e-4)


def test_resume_continues_bitwise(world4, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("resume"))
    # saved with "usp.async_save": the engine writes in the background, the trainer waits before the folder's manifest
    full = world4.run(train_trainer, out, 2, 2, 2, "zigzag", False, True, True)[0]
    assert all(os.path.isfile(os.path.join(out, f"checkpoint-{n}", "ds_usp_manifest.json")) for n in (2, 4))
    resumed = world4.run(train_trainer, out, 2, 2, 2, "zigzag", True, False)[0]
    # the first two logged losses come back with the checkpoint's trainer state; steps 3..5 are new and bitwise equal
    assert len(resumed["loss"]) == STEPS and resumed["loss"] == full["loss"], (resumed["loss"], full["loss"])
    for name, value in resumed["params"].items():
        assert torch.equal(value, full["params"][name]), name
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"), attn_implementation="sdpa")
    for name, value in saved.named_parameters():  # save_model wrote the trained weights, loadable without ds-usp
        assert torch.equal(value, full["params"][name]), name


def test_resume_skips_a_damaged_checkpoint_folder(world4, tmp_path_factory):
    """USPTrainer's checkpoint-N folders get a manifest after every rank's files; resume_from_checkpoint=True skips a
    damaged newest folder (a file truncated, as a crash mid-save leaves it) with a warning and resumes from the one
    before, bitwise as the uninterrupted run; the damaged folder named by path is refused naming the file."""
    import shutil

    from ds_usp.integration.engine.checkpoints import MANIFEST, CheckpointDamaged

    out = str(tmp_path_factory.mktemp("damaged"))
    # saved with "usp.async_save": the engine writes in the background, the trainer waits before the folder's manifest
    full = world4.run(train_trainer, out, 2, 2, 2, "zigzag", False, True, True)[0]
    assert all(os.path.isfile(os.path.join(out, f"checkpoint-{n}", "ds_usp_manifest.json")) for n in (2, 4))
    assert all(os.path.isfile(os.path.join(out, f"checkpoint-{n}", MANIFEST)) for n in (2, 4, 5))
    shutil.rmtree(os.path.join(out, "checkpoint-5"))  # the run "crashed" while saving checkpoint-4
    victim = os.path.join(out, "checkpoint-4", "trainer_state.json")
    os.truncate(victim, os.path.getsize(victim) // 2)
    resumed = world4.run(train_trainer, out, 2, 2, 2, "zigzag", "auto", False)[0]
    assert resumed["loss"] == full["loss"], (resumed["loss"], full["loss"])
    for name, value in resumed["params"].items():
        assert torch.equal(value, full["params"][name]), name
    from ds_usp.integration.trainers.trainer import complete_checkpoint_folder

    assert complete_checkpoint_folder(out, True) == os.path.join(out, "checkpoint-2")
    with pytest.raises(CheckpointDamaged, match=r"checkpoint-4/trainer_state\.json: \d+ bytes, expected"):
        complete_checkpoint_folder(out, os.path.join(out, "checkpoint-4"))


def refused_loss(out: str) -> str:
    """On every rank: a USPTrainer asked for label smoothing; returns the error it raises."""
    from ds_usp import USPTrainer

    _fresh_accelerate()
    reference = _llama("sdpa").state_dict()
    args = _args(out, _ds_config(2, 2, 2, "zigzag"), label_smoothing_factor=0.1)
    trainer = USPTrainer(model=_same_weights(_llama("usp"), reference), args=args, train_dataset=_dataset(4))
    try:
        trainer.train()
    except ValueError as err:
        return str(err)
    return "no error"


def test_losses_that_need_whole_logits_are_refused(world4, tmp_path_factory):
    messages = world4.run(refused_loss, str(tmp_path_factory.mktemp("refused")))
    assert all("label_smoothing_factor is not supported" in m for m in messages), messages


def plain_trainer_refused(out: str) -> str:
    """On every rank: HF's own Trainer given the USP config (ds_usp imported) with ds-usp's automatic switch off
    (``DS_USP_AUTO=0``; on, the Trainer becomes ds-usp's: tests/test_json_key.py); returns the error it raises."""
    import os

    from transformers import Trainer

    import ds_usp  # noqa: F401 - the deepspeed.initialize hook

    _fresh_accelerate()
    reference = _llama("sdpa").state_dict()
    os.environ["DS_USP_AUTO"] = "0"
    try:
        trainer = Trainer(model=_same_weights(_llama("usp"), reference),
                          args=_args(out, _ds_config(2, 2, 2, "zigzag")), train_dataset=_dataset(4))
        trainer.train()
    except ValueError as err:
        return str(err)
    finally:
        del os.environ["DS_USP_AUTO"]
    return "no error"


def test_plain_trainer_with_the_usp_config_is_refused(world4, tmp_path_factory):
    """With the automatic switch off, a plain Trainer would give every rank whole sequences: refused before any step,
    naming the switch and what to use."""
    messages = world4.run(plain_trainer_refused, str(tmp_path_factory.mktemp("plain")))
    assert all("Use ds_usp.USPTrainer" in m and "DS_USP_AUTO=0" in m for m in messages), messages


# ---- TRL --------------------------------------------------------------------------------------------------------

def _sft(use_usp: bool, out: str, stage: int = 2):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig

    _fresh_accelerate()
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        pad_token="t0", eos_token="t1")
    ds_config = _ds_config(stage, 2, 2, "balanced") if use_usp else None
    args = SFTConfig(output_dir=out, deepspeed=ds_config, use_cpu=True, max_steps=3, per_device_train_batch_size=4,
                     gradient_accumulation_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                     learning_rate=LR, optim="sgd", max_grad_norm=1.0, train_sampling_strategy="sequential",
                     packing=True, max_length=64, seed=0, eos_token="t1", pad_token="t0")
    g = torch.Generator().manual_seed(1)
    from datasets import Dataset

    lens = torch.randint(3, 40, (60,), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lens]})
    return tokenizer, args, data


def _sft_logs(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h[key] for h in logs] for key in ("loss", "num_tokens", "mean_token_accuracy", "entropy")}


def train_sft(out: str) -> dict:
    """On every rank: USPSFTTrainer with packing, 2x2 balanced, ZeRO-2 (TRL's own compute_loss, its fused LM head
    answered on the shards)."""
    from ds_usp import USPSFTTrainer

    reference = _llama("sdpa").state_dict()
    tokenizer, args, data = _sft(True, out)
    trainer = USPSFTTrainer(model=_same_weights(_llama("usp"), reference), args=args, train_dataset=data,
                            processing_class=tokenizer)
    trainer.train()
    return _sft_logs(trainer)


def _plain_cross_entropy(outputs, labels, num_items_in_batch=None):
    """HF's causal-LM loss on the whole logits (TRL's default loss reads log-probs from its fused lm head)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, VOCAB, num_items_in_batch=num_items_in_batch)


def test_sft_packing_equals_single_process(world4, tmp_path_factory):
    from trl import SFTTrainer

    tokenizer, args, data = _sft(False, str(tmp_path_factory.mktemp("sft_ref")))
    reference = SFTTrainer(model=_llama("sdpa"), args=args, train_dataset=data, processing_class=tokenizer,
                           compute_loss_func=_plain_cross_entropy)
    reference.train()
    want = _sft_logs(reference)
    _fresh_accelerate()
    got = world4.run(train_sft, str(tmp_path_factory.mktemp("sft")))[0]
    assert len(got["loss"]) == len(want["loss"]) == 3
    # rtol 5e-5: inside SFTTrainer.train the reference's own first loss (4.8740010) is 1.2e-5 relative off the
    # fp64 per-document loss of the same batch and weights (4.8739449; the same model called outside the trainer
    # gives 4.8739448); ds-usp's is 4.8740125. Attending across the documents moves it by 1.2e-3, counting one
    # target more or fewer by ~4e-3: both far outside.
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), rtol=5e-5, atol=1e-6)
    assert got["num_tokens"] == want["num_tokens"]  # each token once, not once per rank of the group
    for metric in ("mean_token_accuracy", "entropy"):  # TRL's metrics from the whole sequences' log-probs
        torch.testing.assert_close(torch.tensor(got[metric]), torch.tensor(want[metric]), rtol=5e-4, atol=1e-6)


# ---- dynamic SP through the Trainer: a config key, nothing else ------------------------------------------------------

DYN_BATCH, DYN_STEPS = 6, 3


def _dyn_dataset():
    """Rows of 3 to 150 tokens (a long tail), a prompt masked in each; the collator pads them on the right."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    lens = [150, 7, 12, 3, 40, 9, 21, 5, 66, 8, 14, 30, 4, 90, 6, 11, 35, 17][: DYN_BATCH * DYN_STEPS]
    ids = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lens]
    return Dataset.from_dict({"input_ids": ids, "labels": [[-100] * (len(x) // 3) + x[len(x) // 3:] for x in ids]})


def _pad_right(rows: list) -> dict:
    seq = max(len(r["input_ids"]) for r in rows)
    pad = lambda xs, v: torch.tensor([x + [v] * (seq - len(x)) for x in xs])  # noqa: E731
    return {"input_ids": pad([r["input_ids"] for r in rows], 0), "labels": pad([r["labels"] for r in rows], -100),
            "attention_mask": pad([[1] * len(r["input_ids"]) for r in rows], 0)}


def _dyn_args(out: str, ds_config, gas: int = 1):
    return _args(out, ds_config, max_steps=DYN_STEPS, per_device_train_batch_size=DYN_BATCH,
                 gradient_accumulation_steps=gas, remove_unused_columns=False)


def train_dynamic_trainer(out: str, stage: int, u: int, r: int, gas: int = 1) -> Any:
    """On every rank: USPTrainer with ``"usp": {"dynamic_sp": true}``; its logs and parameters (or its refusal)."""
    from ds_usp import USPTrainer

    _fresh_accelerate()
    reference = _llama("sdpa").state_dict()
    config = _ds_config(stage, u, r, "zigzag")
    config["usp"]["dynamic_sp"] = True
    args = _dyn_args(out, config, gas)
    model = _same_weights(_llama("usp"), reference)
    try:
        trainer = USPTrainer(model=model, args=args, train_dataset=_dyn_dataset(), data_collator=_pad_right)
    except ValueError as err:
        return str(err)
    trainer.train()
    return _summary(trainer, stage)


@pytest.mark.parametrize("stage,u,r", [(2, 2, 2), (3, 1, 4)], ids=["zero2-2x2", "zero3-1x4"])
def test_dynamic_sp_trainer_equals_single_process(world4, tmp_path_factory, stage, u, r):
    """Each step's 6 right-padded rows become documents on the degrees their lengths need (the 150-token row on all 4
    ranks, short rows alone on one rank): every logged loss and grad norm and the parameters equal the plain Trainer's
    in one process on the same padded batches; tokens seen count each real token once."""
    from transformers import Trainer

    _fresh_accelerate()
    plain = Trainer(model=_llama("sdpa"), args=_dyn_args(str(tmp_path_factory.mktemp("dyn_ref")), None),
                    train_dataset=_dyn_dataset(), data_collator=_pad_right)
    plain.train()
    want = _summary(plain, 0)
    _fresh_accelerate()
    results = world4.run(train_dynamic_trainer, str(tmp_path_factory.mktemp("dyn")), stage, u, r)
    got = results[0]
    assert len(got["loss"]) == DYN_STEPS and all(res["loss"] == got["loss"] for res in results)
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), **TOL)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(want["grad_norm"]), **TOL)
    assert got["tokens"] == want["tokens"] == sum(len(x) for x in _dyn_dataset()["input_ids"])
    for name, value in got["params"].items():
        torch.testing.assert_close(value, want["params"][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_dynamic_sp_trainer_refuses_gradient_accumulation(world4, tmp_path_factory):
    results = world4.run(train_dynamic_trainer, str(tmp_path_factory.mktemp("dyn_gas")), 2, 2, 2, 2)
    assert all("gradient_accumulation_steps=1 (not 2)" in str(res) for res in results), results[0]


def test_hook_check_names_what_is_missing(monkeypatch):
    """Versions are not gated; a release without a hook the integration uses is refused naming the hook."""
    import transformers

    import ds_usp.integration.trainers.trainer as hf_trainer

    hf_trainer.check_hooks()  # the installed versions have every hook
    monkeypatch.delattr(transformers.Trainer, "get_batch_samples")
    with pytest.raises(ImportError, match=r"does not have: transformers\.Trainer\.get_batch_samples\. It was tested with transformers 5\.23"):
        hf_trainer.check_hooks()
    monkeypatch.undo()
    renamed = (("transformers", "Trainer", "compute_loss", ("num_items",)),)
    with pytest.raises(ImportError, match=r"compute_loss parameter\(s\) num_items"):
        hf_trainer.check_hooks(renamed, ())
    with pytest.raises(ImportError, match=r"transformers\.trainer reading Trainer\.no_such_attribute"):
        hf_trainer.check_hooks((), ("no_such_attribute",))


def test_the_patched_hf_function_is_still_hfs():
    """The one HF function ds-usp wraps still exists, fills train_batch_size from the world, and is wrapped."""
    import inspect

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    import ds_usp.integration.trainers.trainer  # noqa: F401 - applies the wrapper

    wrapped = HfTrainerDeepSpeedConfig.trainer_config_process
    assert getattr(wrapped, "_ds_usp", False)
    source = inspect.getsource(wrapped.__wrapped__)
    assert "args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps" in source
