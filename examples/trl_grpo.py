"""TRL's ``GRPOTrainer`` with USP: long prompts, sampled rollouts, a reward; a plain GRPO script, three lines changed.

    deepspeed --num_gpus 4 examples/trl_grpo.py --deepspeed ds_configs/hf_trainer.json

What differs from a plain GRPOTrainer script (marked ``# USP`` below): ``ds_usp.USPGRPOTrainer`` instead of
``trl.GRPOTrainer``, the model built with ``attn_implementation="usp"``, and ``"sequence_parallel": "usp"`` in the
DeepSpeed JSON. Every rank of a sequence-parallel group generates (ZeRO-3 needs each in the parameter gathers), the
group keeps its first rank's completions, and the policy update runs the prompt + completion sharded over the group,
log-probs through the LM head chunk by chunk.

The task: prompts are the first ``--prompt-length`` bytes of standard-library docstrings (nothing downloaded); the
reward is the share of lower-case letters in the completion (a random tiny model starts near 26 / 258), so the mean
reward climbs within a few dozen steps. Rank 0 saves ``curves.png`` (reward and loss per step) in ``--out``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curves import plot_curves  # noqa: E402
from trl_sft import EOS, PAD, VOCAB, documents, tokenizer  # noqa: E402

from ds_usp import USPGRPOTrainer  # noqa: E402  # USP (1/3)

LETTERS = set(range(ord("a"), ord("z") + 1))


def letter_share(completion_ids: list, **kwargs) -> list[float]:
    """Reward: the share of lower-case letters among a completion's bytes."""
    return [sum(t in LETTERS for t in ids) / max(1, len(ids)) for ids in completion_ids]


def prompts(length: int):
    """One prompt per docstring long enough: its first ``length`` bytes, as token strings the tokenizer maps back."""
    from datasets import Dataset

    rows = [doc[:length] for doc in documents() if len(doc) > length]
    return Dataset.from_dict({"prompt": [" ".join(f"<{t}>" for t in row) for row in rows]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default="ds_configs/hf_trainer.json", help="DeepSpeed JSON")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--prompt-length", type=int, default=256, help="prompt tokens (bytes)")
    parser.add_argument("--completion-length", type=int, default=16, help="tokens generated per completion")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--out", default="runs/trl_grpo", help="logs, the curves and the final model")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import GRPOConfig

    training = GRPOConfig(output_dir=args.out, deepspeed=args.deepspeed, max_steps=args.steps,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=args.completion_length,
                          learning_rate=1e-2, warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[],
                          loss_type="dapo", beta=0.0, temperature=1.0, bf16=False, use_cpu=not torch.cuda.is_available(),
                          seed=0)
    config = LlamaConfig(vocab_size=VOCAB + 2, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="usp")  # USP (2/3)
    trainer = USPGRPOTrainer(model=model, reward_funcs=letter_share, args=training,  # USP (3/3)
                             train_dataset=prompts(args.prompt_length), processing_class=tokenizer())
    trainer.train()
    if trainer.is_world_process_zero():
        plot_curves(trainer.state.log_history, ["reward", "loss"], f"{args.out}/curves.png")


if __name__ == "__main__":
    main()
