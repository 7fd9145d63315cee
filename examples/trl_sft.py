"""TRL's ``SFTTrainer`` with USP and packed documents: a plain SFT script, three lines changed.

    deepspeed --num_gpus 4 examples/trl_sft.py --deepspeed ds_configs/hf_trainer.json

What differs from a plain SFTTrainer script (marked ``# USP`` below): ``USPSFTTrainer`` from
``ds_usp.USPSFTTrainer`` instead of ``trl.SFTTrainer``, the model built with ``attn_implementation="usp"``,
and ``"sequence_parallel": "usp"`` in the DeepSpeed JSON.

Data: every docstring of a fixed list of standard-library modules is one document (byte-level
tokens, nothing downloaded); ``packing=True`` packs them padding-free into rows of ``--max-length``
tokens, and USP keeps the documents apart exactly (each token attends only within its document).
TRL's token-accuracy and entropy metrics are not logged under sequence parallelism (they need the
whole logits, which the chunked loss never builds); the loss is.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_llama import STDLIB_MODULES, VOCAB  # noqa: E402

from ds_usp import USPSFTTrainer  # noqa: E402  # USP (1/3)

PAD, EOS = VOCAB, VOCAB + 1  # two ids past the bytes


def documents(min_len: int = 16) -> list[list[int]]:
    """One document per docstring of the listed modules' public members, byte-level tokens + EOS."""
    import importlib

    docs = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(inspect.getmembers(module), key=lambda kv: kv[0]):
            text = inspect.getdoc(obj) if getattr(obj, "__module__", None) == module.__name__ else None
            if text and len(text) >= min_len:
                docs.append(list(text.encode("utf-8")) + [EOS])
    return docs


def tokenizer():
    """A byte-level tokenizer object for TRL (it reads the pad and EOS ids from it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(VOCAB)} | {"<pad>": PAD, "<eos>": EOS}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # text prompts (the RL examples): "<72> <105> ..."
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default="ds_configs/hf_trainer.json", help="DeepSpeed JSON")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--out", default="runs/trl_sft", help="logs, checkpoints and the final model")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import SFTConfig

    data = Dataset.from_dict({"input_ids": documents()})
    training = SFTConfig(output_dir=args.out, deepspeed=args.deepspeed, max_steps=args.steps, packing=True,
                         max_length=args.max_length, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                         learning_rate=2e-3, warmup_steps=3, logging_steps=5, save_strategy="no", report_to=[],
                         use_cpu=not torch.cuda.is_available(), seed=0)
    config = LlamaConfig(vocab_size=VOCAB + 2, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS,
                         max_position_embeddings=max(4096, args.max_length), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="usp")  # USP (2/3)
    trainer = USPSFTTrainer(model=model, args=training, train_dataset=data, processing_class=tokenizer())  # USP (3/3)
    trainer.train()
    trainer.save_model(f"{args.out}/final")


if __name__ == "__main__":
    main()
