"""Build a tiny random Llama, its tokenizer and a tiny LLaMA-Factory dataset in one folder (nothing is downloaded).

    python examples/llamafactory/make_tiny_llama.py OUT_DIR

Writes:

* ``OUT_DIR/model``: a byte-level BPE tokenizer (``tokenizers``, trained here on the dataset's own text, vocab 384,
  ``<s>`` / ``</s>`` / ``<pad>``) wrapped as ``PreTrainedTokenizerFast``, and a random ``LlamaForCausalLM``
  (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128) saved in float32 with a fixed seed;
* ``OUT_DIR/data``: ``sft.json`` (alpaca rows: instruction / input / output, 48 rows of varied lengths),
  ``pt.json`` (``{"text": ...}`` rows for ``stage: pt``) and the ``dataset_info.json`` that names them
  ``tiny_sft`` and ``tiny_pt``.

The same OUT_DIR and seed give the same files, so every run of run_llamafactory.py starts from the same weights.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = ("the a one two three river stone light window garden market winter summer engine signal number sequence "
         "parallel ring ulysses attention head token model layer loss gradient shard rank batch length train data "
         "quick brown fox jumps over lazy dog small large red green blue bright dark quiet loud early late north "
         "south east west count sort merge split read write open close begin end first last next previous").split()
TASKS = ["Write a sentence about {w}.", "Repeat the words: {w}.", "Sort these words: {w}.",
         "Count the words in: {w}.", "Describe {w} in a few words.", "Translate to plain words: {w}."]


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_rows(seed: int = 0, n: int = 48) -> tuple[list[dict], list[dict]]:
    """Alpaca rows (and plain-text rows) whose lengths run from a few tokens to past a 128-token cutoff."""
    rng = random.Random(seed)
    sft, pt = [], []
    for i in range(n):
        short = i % 4 == 0
        w = _phrase(rng, rng.randint(1, 4))
        inp = "" if short else _phrase(rng, rng.randint(2, 30))
        out = _phrase(rng, rng.randint(2, 8) if short else rng.randint(6, 70)).capitalize() + "."
        sft.append({"instruction": rng.choice(TASKS).format(w=w), "input": inp, "output": out})
        pt.append({"text": _phrase(rng, rng.randint(5, 90)).capitalize() + "."})
    return sft, pt


def build_tokenizer(texts: list[str], path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=384, min_frequency=1, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=4096, padding_side="right")
    # a plain chat template (LLaMA-Factory's `template: default` replaces it with its own anyway)
    fast.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}Human: {{ m['content'] }}</s>\n"
                          "Assistant:{% elif m['role'] == 'assistant' %}{{ m['content'] }}</s>\n"
                          "{% elif m['role'] == 'system' %}System: {{ m['content'] }}</s>\n{% endif %}{% endfor %}")
    fast.save_pretrained(path)
    return fast


def build_model(tokenizer, path: Path, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)


def main(out: str) -> None:
    out_dir = Path(out)
    (out_dir / "model").mkdir(parents=True, exist_ok=True)
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    sft, pt = make_rows()
    data = out_dir / "data"
    (data / "sft.json").write_text(json.dumps(sft, indent=1))
    (data / "pt.json").write_text(json.dumps(pt, indent=1))
    (data / "dataset_info.json").write_text(json.dumps({
        "tiny_sft": {"file_name": "sft.json"},  # alpaca columns (instruction / input / output) are the default
        "tiny_pt": {"file_name": "pt.json", "columns": {"prompt": "text"}},
    }, indent=1))
    texts = [" ".join(r.values()) for r in sft] + [r["text"] for r in pt] + ["Human: Assistant: System:"] * 4
    tokenizer = build_tokenizer(texts, out_dir / "model")
    build_model(tokenizer, out_dir / "model")
    lengths = sorted(len(tokenizer(" ".join(r.values()))["input_ids"]) for r in sft)
    print(f"wrote {out_dir}/model (vocab {len(tokenizer)}) and {out_dir}/data ({len(sft)} sft rows, "
          f"tokens min/median/max {lengths[0]}/{lengths[len(lengths) // 2]}/{lengths[-1]})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/llamafactory/assets")
