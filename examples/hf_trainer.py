"""The HuggingFace ``Trainer`` with USP: a plain Trainer script, three lines changed.

    deepspeed --num_gpus 4 examples/hf_trainer.py --deepspeed ds_configs/hf_trainer.json

What differs from a plain Trainer script (marked ``# USP`` below):

1. ``from ds_usp import USPTrainer`` and ``USPTrainer`` instead of ``Trainer``;
2. the model is built with ``attn_implementation="usp"``;
3. the DeepSpeed JSON has ``"sequence_parallel": "usp"`` (ds_configs/hf_trainer.json: 2 Ulysses x 2 ring,
   ZeRO-3, HF's ``"auto"`` values).

Model: a small Llama with random weights; data: the docstrings of Python's standard library,
byte-level tokens in rows of ``--seq-len`` (examples/train_llama.py's corpus; nothing is downloaded).
The Trainer logs the loss (the whole sequence's, the same on every rank), evaluates and saves as usual.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_llama import VOCAB, packed_sequences, stdlib_corpus  # noqa: E402

from ds_usp import USPTrainer  # noqa: E402  # USP (1/3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default="ds_configs/hf_trainer.json", help="DeepSpeed JSON")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--out", default="runs/hf_trainer", help="logs, checkpoints and the final model")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    rows = packed_sequences(stdlib_corpus(), args.seq_len, seed=0)
    train = Dataset.from_dict({"input_ids": rows[16:].tolist(), "labels": rows[16:].tolist()})
    held_out = Dataset.from_dict({"input_ids": rows[:16].tolist(), "labels": rows[:16].tolist()})
    # the arguments come first: with ZeRO-3 they make HF build the model partitioned (zero.Init)
    training = TrainingArguments(output_dir=args.out, deepspeed=args.deepspeed, max_steps=args.steps,
                                 per_device_train_batch_size=1, per_device_eval_batch_size=1,
                                 gradient_accumulation_steps=2, learning_rate=2e-3, warmup_steps=3,
                                 logging_steps=5, eval_strategy="steps", eval_steps=15, save_strategy="steps",
                                 save_steps=15, report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
                                 include_num_input_tokens_seen="non_padding")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(4096, args.seq_len),
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="usp")  # USP (2/3)
    trainer = USPTrainer(model=model, args=training, train_dataset=train, eval_dataset=held_out)  # USP (3/3)
    trainer.train()
    print(f"eval loss {trainer.evaluate()['eval_loss']:.4f}; tokens seen {trainer.state.num_input_tokens_seen}")
    trainer.save_model(f"{args.out}/final")


if __name__ == "__main__":
    main()
