"""A stock HF ``Trainer`` and TRL ``SFTTrainer`` script, as a user writes one: nothing of ds-usp in it (run by
tests/test_json_key.py).

Usage: ``stock_trainer_job.py MODEL_DIR DATA_DIR OUT_DIR [--deepspeed ds.json] [--use_cpu] [--probe_refusal ds.json]``
under any launcher (``deepspeed``, ``accelerate launch`` with DeepSpeed from its YAML, or one process with the launcher
variables set). It trains the model in MODEL_DIR for 3 steps on DATA_DIR/train.jsonl and evaluates it on
DATA_DIR/test.jsonl twice: with transformers' ``Trainer`` (rows padded to 32 tokens, batches of 2), then with TRL's
``SFTTrainer`` (the same model path and text, TRL's own tokenization and collator). Rank 0 writes OUT_DIR/result.json:
each trainer's losses and eval loss and what ran (the trainer's class, the model's attention, the engine's mpu), and
whether ds-usp was imported by the end. ``--probe_refusal`` first creates ``TrainingArguments`` with that DeepSpeed
config and records the error it raises (the test runs it with ``DS_USP_AUTO=0``).
"""
import argparse
import json
import os
import sys

from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)
from trl import SFTConfig, SFTTrainer

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("data")
parser.add_argument("out")
parser.add_argument("--deepspeed", default=None)
parser.add_argument("--use_cpu", action="store_true")
parser.add_argument("--probe_refusal", default=None)
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
cli = parser.parse_args()

COMMON = dict(deepspeed=cli.deepspeed, use_cpu=cli.use_cpu, max_steps=3, per_device_train_batch_size=2,
              per_device_eval_batch_size=2, logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3,
              max_grad_norm=1.0, seed=0)
result = {}
if cli.probe_refusal:
    try:
        TrainingArguments(output_dir=cli.out, **{**COMMON, "deepspeed": cli.probe_refusal})
        result["refused"] = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result["refused"] = f"{type(e).__name__}: {e}"
files = {split: os.path.join(cli.data, f"{split}.jsonl") for split in ("train", "test")}


def ran(trainer):
    history = trainer.state.log_history
    return {"loss": [h["loss"] for h in history if "loss" in h], "eval_loss": trainer.evaluate()["eval_loss"],
            "trainer": type(trainer).__name__, "attention": trainer.model.config._attn_implementation,
            "mpu": type(getattr(trainer.model_wrapped, "mpu", None)).__name__}


# transformers' Trainer
args = TrainingArguments(output_dir=cli.out, **COMMON)
tokenizer = AutoTokenizer.from_pretrained(cli.model)
data = load_dataset("json", data_files=files)
tokens = data.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=32, padding="max_length"),
                  batched=True, remove_columns=["text"])
trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(cli.model), args=args, train_dataset=tokens["train"],
                  eval_dataset=tokens["test"], processing_class=tokenizer,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
result["trainer"] = ran(trainer)

# TRL's SFTTrainer, given the model's path (it builds the model itself)
sft = SFTTrainer(model=cli.model, args=SFTConfig(output_dir=cli.out, max_length=32, bf16=False, **COMMON),
                 train_dataset=data["train"], eval_dataset=data["test"], processing_class=tokenizer)
sft.train()
result["sft"] = ran(sft)

if trainer.args.process_index == 0:
    import deepspeed

    result["ds_usp_imported"] = "ds_usp" in sys.modules
    result["initialize_gated"] = getattr(deepspeed.initialize, "_ds_usp", False)
    with open(os.path.join(cli.out, "result.json"), "w") as f:
        json.dump(result, f)
