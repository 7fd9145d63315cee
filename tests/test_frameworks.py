"""Trainer subclasses built the way LLaMA-Factory's and axolotl's are, given a DeepSpeed JSON with the key and
nothing else, train with USP on 4 CPU ranks equal to the same class in one process.

Each class overrides what its framework overrides (read from LLaMA-Factory 0.9.5's ``CustomSeq2SeqTrainer`` /
``CustomTrainer`` and axolotl's ``AxolotlTrainer``): ``compute_loss`` calling the Trainer's with
``num_items_in_batch`` and its own bookkeeping, ``prediction_step`` (LLaMA-Factory's SFT pops the labels to generate
and blanks the prompt of the predictions), the optimizer and the train sampler, and its data collator (LLaMA-Factory's
SFT pads to a multiple of 8 with labels -100, its pre-training collator is HF's language-modeling one). ds-usp owns
none of them: every rank of a group holds the whole batch and the model's forward shards it. The global batch is the
same as the reference's: the replicas (world / SP) times the per-device batch is the single process's batch.
A subclass that computes its loss from the logits is refused, the method named.

Tolerances: per-step loss and grad norm rtol 1e-5 / atol 1e-6 (fp32, as tests/test_hf_trainer.py), parameters
1e-4 / 1e-6 (the ring's merge order differs from one process's softmax).
"""
from __future__ import annotations

import pytest
import torch

from test_hf_trainer import _fresh_accelerate, _same_weights
from test_training import VOCAB, _llama, _params

pytest.importorskip("accelerate")
STEPS, GAS, LR = 4, 2, 0.05
TOL = dict(rtol=1e-5, atol=1e-6)
ROWS = 4 * STEPS * GAS  # enough rows for the largest global batch (2 per device x 2 replicas)
# (framework, ZeRO stage, U, R): SP 2 on 4 ranks has 2 replicas, 2 x 2 has one
CASES = [("llamafactory_sft", 2, 2, 1), ("llamafactory_sft", 3, 2, 2), ("llamafactory_pt", 3, 1, 2),
         ("axolotl", 2, 2, 2), ("axolotl", 3, 2, 1)]


def _rows(kind: str) -> list[dict]:
    """Rows of varied length: SFT rows mask their prompt (-100), pre-training rows are plain text."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(ROWS):
        n = int(torch.randint(40, 150, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        if kind == "llamafactory_pt":
            rows.append({"input_ids": ids})
        else:
            prompt = int(torch.randint(5, n // 2, (1,), generator=g))
            rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _classes() -> dict:
    """The three trainer classes, built as the frameworks build theirs (defined here, on every rank)."""
    from torch.utils.data import SequentialSampler
    from transformers import Seq2SeqTrainer, Trainer

    class CustomSeq2SeqTrainer(Seq2SeqTrainer):  # LLaMA-Factory's SFT trainer
        def create_optimizer(self):
            return super().create_optimizer()  # LLaMA-Factory builds its custom optimizers here, else the Trainer's

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)  # disable_shuffling

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            return super().compute_loss(model, inputs, return_outputs, **kwargs)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
            if self.args.predict_with_generate:
                labels = inputs.pop("labels", None)
            else:
                labels = inputs.get("labels")
            loss, generated, _ = super().prediction_step(model, inputs, prediction_loss_only=prediction_loss_only,
                                                         ignore_keys=ignore_keys, **gen_kwargs)
            if generated is not None and self.args.predict_with_generate:
                generated[:, : inputs["input_ids"].size(-1)] = self.processing_class.pad_token_id
            return loss, generated, labels

    class CustomTrainer(Trainer):  # LLaMA-Factory's pre-training trainer
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, *args, **kwargs):
            return super().compute_loss(model, inputs, *args, **kwargs)

    class AxolotlTrainer(Trainer):  # axolotl's: token bookkeeping, then the Trainer's loss
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.tokens_trained = getattr(self, "tokens_trained", 0) + int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    return {"llamafactory_sft": CustomSeq2SeqTrainer, "llamafactory_pt": CustomTrainer, "axolotl": AxolotlTrainer}


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", eos_token="t1")


def _collator(kind: str, tokenizer):
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    if kind == "llamafactory_pt":
        return DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8, label_pad_token_id=-100)


def _ds_config(stage: int, u: int, r: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "sequence_parallel": "usp", "sequence_parallel_size": u * r,
            "usp": {"ulysses_degree": u, "ring_degree": r}}


def run_framework(out: str, kind: str, ds_config, per_device: int) -> dict:
    """The framework-like trainer on this rank (one process: ``ds_config`` None); its logs and parameters."""
    from datasets import Dataset
    from transformers import Seq2SeqTrainingArguments

    _fresh_accelerate()
    reference = _llama("sdpa").state_dict()
    args = Seq2SeqTrainingArguments(
        output_dir=out, deepspeed=ds_config, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device, gradient_accumulation_steps=GAS, logging_steps=1, report_to=[],
        save_strategy="no", learning_rate=LR, optim="sgd", max_grad_norm=1.0, seed=0, remove_unused_columns=False)
    tokenizer = _tokenizer()
    model = _same_weights(_llama("sdpa"), reference) if ds_config else _llama("sdpa")
    trainer = _classes()[kind](model=model, args=args, train_dataset=Dataset.from_list(_rows(kind)),
                               eval_dataset=Dataset.from_list(_rows(kind)[:4]),
                               data_collator=_collator(kind, tokenizer), processing_class=tokenizer)
    trainer.train()
    logs = trainer.state.log_history
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage", 0)
    return {"class": type(trainer).__name__, "loss": [h["loss"] for h in logs if "loss" in h],
            "grad_norm": [h["grad_norm"] for h in logs if "grad_norm" in h],
            "eval_loss": trainer.evaluate()["eval_loss"],
            "params": _params(trainer.model_wrapped, stage) if stage else
            {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """A framework's class in this process, no DeepSpeed, at a global batch of rows: run when a case first asks."""
    found = {}

    def reference(kind: str, batch: int) -> dict:
        if (kind, batch) not in found:
            found[kind, batch] = run_framework(str(tmp_path_factory.mktemp(f"{kind}{batch}")), kind, None, batch)
            _fresh_accelerate()
        return found[kind, batch]
    return reference


@pytest.mark.parametrize("kind,stage,u,r", CASES, ids=[f"{k}-zero{s}-{u}x{r}" for k, s, u, r in CASES])
def test_framework_trainer_equals_single_process(world4, tmp_path_factory, references, kind, stage, u, r):
    replicas = 4 // (u * r)
    results = world4.run(run_framework, str(tmp_path_factory.mktemp(kind)), kind, _ds_config(stage, u, r), 2)
    got, want = results[0], references(kind, 2 * replicas)
    assert got["class"].startswith("USP") and want["class"] == got["class"][3:]  # its own class, made ds-usp's
    assert len(got["loss"]) == STEPS and all(res["loss"] == got["loss"] for res in results)
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), **TOL)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(want["grad_norm"]), **TOL)
    torch.testing.assert_close(torch.tensor(got["eval_loss"]), torch.tensor(want["eval_loss"]), **TOL)
    for name, value in got["params"].items():
        torch.testing.assert_close(value, want["params"][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def logits_loss_refused(out: str) -> str:
    """On every rank: a subclass whose compute_loss pops the labels and takes the cross entropy of the logits."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    class LogitsLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    _fresh_accelerate()
    reference = _llama("sdpa").state_dict()
    args = TrainingArguments(output_dir=out, deepspeed=_ds_config(2, 2, 2), use_cpu=True, max_steps=1,
                             per_device_train_batch_size=1, report_to=[], save_strategy="no", optim="sgd")
    tokenizer = _tokenizer()
    trainer = LogitsLossTrainer(model=_same_weights(_llama("sdpa"), reference), args=args,
                                train_dataset=Dataset.from_list(_rows("axolotl")[:2]),
                                data_collator=_collator("axolotl", tokenizer), processing_class=tokenizer)
    try:
        trainer.train()
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_loss_from_the_logits_is_refused_naming_the_method(world4, tmp_path_factory):
    messages = world4.run(logits_loss_refused, str(tmp_path_factory.mktemp("logits")))
    assert all("LogitsLossTrainer.compute_loss calls LlamaForCausalLM without labels" in m for m in messages), messages
