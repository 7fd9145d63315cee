"""TRL's ``DPOTrainer`` with USP: long prompts, chosen and rejected continuations; a plain DPO script, three lines
changed.

    deepspeed --num_gpus 4 examples/trl_dpo.py --deepspeed ds_configs/hf_trainer.json

What differs from a plain DPOTrainer script (marked ``# USP`` below): ``ds_usp.USPDPOTrainer`` instead of
``trl.DPOTrainer``, the model built with ``attn_implementation="usp"`` (TRL builds the reference model the same way),
and ``"sequence_parallel": "usp"`` in the DeepSpeed JSON. Each prompt + chosen and prompt + rejected row runs sharded
over the sequence-parallel group, policy and reference, the sequence log-probs summed over the group.

The pairs: the prompt is the first ``--prompt-length`` bytes of a standard-library docstring (nothing downloaded), the
chosen continuation its next ``--answer-length`` bytes, the rejected one the same bytes reversed. Rank 0 saves
``curves.png`` (loss, reward accuracy and margin per step) in ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curves import plot_curves  # noqa: E402
from trl_sft import EOS, PAD, VOCAB, documents, tokenizer  # noqa: E402

from ds_usp import USPDPOTrainer  # noqa: E402  # USP (1/3)


def pairs(prompt_length: int, answer_length: int):
    """Preference pairs from the docstrings, as token strings the tokenizer maps back."""
    from datasets import Dataset

    def text(ids: list) -> str:
        return " ".join(f"<{t}>" for t in ids)

    rows = [doc for doc in documents() if len(doc) > prompt_length + answer_length]
    return Dataset.from_dict({
        "prompt": [text(d[:prompt_length]) for d in rows],
        "chosen": [text(d[prompt_length:prompt_length + answer_length]) for d in rows],
        "rejected": [text(d[prompt_length:prompt_length + answer_length][::-1]) for d in rows]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default="ds_configs/hf_trainer.json", help="DeepSpeed JSON")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--prompt-length", type=int, default=384, help="prompt tokens (bytes)")
    parser.add_argument("--answer-length", type=int, default=32, help="tokens of each continuation")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--out", default="runs/trl_dpo", help="logs, the curves and the final model")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import DPOConfig

    config = LlamaConfig(vocab_size=VOCAB + 2, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="usp")  # USP (2/3)
    reference = copy.deepcopy(model)  # TRL would load it from the policy's path, which a model built here has not
    training = DPOConfig(output_dir=args.out, deepspeed=args.deepspeed, max_steps=args.steps,
                         per_device_train_batch_size=4, learning_rate=5e-3, warmup_steps=2, logging_steps=1,
                         save_strategy="no", report_to=[], beta=0.1, loss_type=["sigmoid"], bf16=False,
                         max_length=args.prompt_length + args.answer_length + 2,
                         use_cpu=not torch.cuda.is_available(), seed=0)
    trainer = USPDPOTrainer(model=model, ref_model=reference, args=training, train_dataset=pairs(args.prompt_length, args.answer_length),
                            processing_class=tokenizer())  # USP (3/3)
    trainer.train()
    if trainer.is_world_process_zero():
        plot_curves(trainer.state.log_history, ["loss", "rewards/accuracies", "rewards/margins"],
                    f"{args.out}/curves.png")


if __name__ == "__main__":
    main()
