"""Build a tiny random Llama and its tokenizer for the axolotl example (nothing is downloaded).

    python examples/axolotl/make_tiny_llama.py [MODEL_DIR] [--data examples/axolotl/data/tiny_alpaca.jsonl]

Writes:

* ``MODEL_DIR`` (default ``runs/axolotl/tiny_llama``): a byte-level BPE tokenizer (``tokenizers``, trained here
  on the dataset's own text, vocab 1024, ``<s>`` / ``</s>`` / ``<pad>`` / ``<unk>``) wrapped as
  ``PreTrainedTokenizerFast``, and a random ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 KV heads,
  intermediate 128) saved in float32 with a fixed seed;
* the dataset, only when it is missing or ``--rewrite-data`` is given: alpaca rows (instruction / input / output,
  48 rows of lengths from a few tokens to past the YAMLs' 128-token ``sequence_len``) as JSON lines. The repository
  ships ``data/tiny_alpaca.jsonl``, which this script wrote with the default seed.

The same seed gives the same files, so every run of run_axolotl.py starts from the same weights.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORDS = ("the a one two three river stone light window garden market winter summer engine signal number sequence "
         "parallel ring ulysses attention head token model layer loss gradient shard rank batch length train data "
         "quick brown fox jumps over lazy dog small large red green blue bright dark quiet loud early late north "
         "south east west count sort merge split read write open close begin end first last next previous").split()
TASKS = ["Write a sentence about {w}.", "Repeat the words: {w}.", "Sort these words: {w}.",
         "Count the words in: {w}.", "Describe {w} in a few words.", "Translate to plain words: {w}."]
# the fixed text of axolotl's alpaca prompt, so that the tokenizer has merges for it
ALPACA_TEXT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
               "Write a response that appropriately completes the request.\n\n### Instruction:\n\n### Input:\n\n"
               "### Response:\n Below is an instruction that describes a task. Write a response that appropriately "
               "completes the request.")


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_rows(seed: int = 0, n: int = 48) -> list[dict]:
    """Alpaca rows whose lengths run from a few tokens to past a 128-token ``sequence_len``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        short = i % 4 == 0
        w = _phrase(rng, rng.randint(1, 4))
        inp = "" if short else _phrase(rng, rng.randint(2, 30))
        out = _phrase(rng, rng.randint(2, 8) if short else rng.randint(6, 70)).capitalize() + "."
        rows.append({"instruction": rng.choice(TASKS).format(w=w), "input": inp, "output": out})
    return rows


def build_tokenizer(texts: list[str], path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, min_frequency=1, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    # a Llama-like tokenizer: <s> before every text (axolotl's alpaca strategy appends </s> itself)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos), ("</s>", eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=4096, padding_side="right")
    fast.save_pretrained(path)
    return fast


def build_model(tokenizer, path: Path, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", nargs="?", default="runs/axolotl/tiny_llama")
    parser.add_argument("--data", default=str(HERE / "data" / "tiny_alpaca.jsonl"), help="the alpaca JSON lines")
    parser.add_argument("--rewrite-data", action="store_true", help="write the dataset even if it exists")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    data = Path(args.data)
    if args.rewrite_data or not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(args.seed)))
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    out = Path(args.model_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = [" ".join(r.values()) for r in rows] + [ALPACA_TEXT] * 8
    tokenizer = build_tokenizer(texts, out)
    build_model(tokenizer, out, seed=args.seed)
    lengths = sorted(len(tokenizer(ALPACA_TEXT[:150] + " ".join(r.values()))["input_ids"]) for r in rows)
    print(f"wrote {out} (vocab {len(tokenizer)}); {data}: {len(rows)} rows, about {lengths[0]}/"
          f"{lengths[len(lengths) // 2]}/{lengths[-1]} tokens (min/median/max) with the alpaca prompt")


if __name__ == "__main__":
    main()
