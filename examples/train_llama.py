"""Train a small Llama on long sequences with Unified Sequence Parallelism.

    deepspeed --num_gpus 4 examples/train_llama.py --deepspeed_config ds_configs/cpu_demo.json

* model: a HuggingFace Llama built from a config with random weights (nothing is downloaded),
  its attention running through ``ds_usp.usp_attention`` (``attn_implementation="usp"``);
* data: the docstrings of Python's standard library (they ship with every Python), byte-level
  tokenized (no tokenizer download), packed into sequences of ``--seq-len`` tokens and shuffled
  with a fixed seed (the corpus goes module by module; unshuffled, the loss jumps at each topic);
* every rank of a sequence-parallel group gets the same sequences and keeps its shard of them;
  ``engine(input_ids=..., position_ids=..., shift_labels=...).loss`` is the token-weighted mean over
  the whole sequence, computed without the whole logits when the sequence is long (``usp.chunked_loss``;
  the other memory features of docs/config.md turn on by themselves too);
* progress bar (loss, tokens/s, layout), JSON-lines log, checkpoints every ``--save-every``
  steps, ``--resume`` from the latest one, and ``loss.png`` at the end when matplotlib is present.

A step is one optimizer step (``gradient_accumulation_steps`` micro batches on each replica).
Optimizer step ``s`` trains on the sequences ``s * B ... s * B + B - 1`` with ``B`` the global batch,
whatever the layout, so ``--resume`` continues exactly where the saved run was (the step comes
from the checkpoint), also on another ``(U, R, dp)`` layout with the same global batch; see
docs/reliability.md, "Checkpoints".
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import pkgutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ds_usp
import ds_usp.config
from ds_usp.checkpoint import CheckpointMismatchError, load_checkpoint

STDLIB_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
                  "decimal", "email", "functools", "heapq", "http", "inspect", "itertools", "json", "logging",
                  "multiprocessing", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
                  "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
                  "urllib", "uuid", "zipfile")
VOCAB = 256  # bytes


def stdlib_corpus() -> bytes:
    """Docstrings of a fixed list of standard-library modules and their members, in a fixed order."""
    texts = []
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        mods = [mod]
        if hasattr(mod, "__path__"):
            for info in sorted(pkgutil.iter_modules(mod.__path__), key=lambda i: i.name):
                if info.name.startswith("_"):  # e.g. unittest.__main__ would run unittest
                    continue
                try:
                    mods.append(importlib.import_module(f"{name}.{info.name}"))
                except Exception:  # noqa: BLE001 - optional submodules (e.g. platform-specific) are skipped
                    continue
        for m in mods:
            texts.append(inspect.getdoc(m) or "")
            for _, obj in sorted(inspect.getmembers(m), key=lambda kv: kv[0]):
                if getattr(obj, "__module__", None) == m.__name__:
                    texts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(t for t in texts if t).encode("utf-8")


def packed_sequences(corpus: bytes, seq_len: int, seed: int) -> torch.Tensor:
    """Byte-level tokens packed into ``(n, seq_len)`` rows, in an order shuffled with ``seed``."""
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    n = tokens.numel() // seq_len
    rows = tokens[: n * seq_len].view(n, seq_len)
    return rows[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]


def build_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.seq_len),
                      attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=ds_usp.hf.register_usp_attention())


def plot(log_path: Path, out: Path) -> bool:
    """Draw the loss curve from the JSON-lines log; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(rows[-1]["layout"] if rows else "")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with the sequence_parallel keys")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all (a resumed run included)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (bytes of the corpus)")
    parser.add_argument("--hidden", type=int, default=128, help="model width (the MLP is 3x as wide)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads; ulysses_degree must divide them")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA); must divide --heads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data order")
    parser.add_argument("--out", default="runs/train_llama", help="log, checkpoints and loss.png go here")
    parser.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    args = parser.parse_args()
    try:  # a missing or unreadable config is reported before the model is built
        ds_usp.config.read_ds_config(args.deepspeed_config)
    except ds_usp.USPConfigError as e:
        raise SystemExit(f"--deepspeed_config: {e}")

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
    topo, layout = engine.usp.topo, engine.usp.layout
    if topo is None:
        raise SystemExit('this example trains with sequence parallelism: set "sequence_parallel" in the config')
    data = packed_sequences(stdlib_corpus(), args.seq_len, args.seed)
    out = Path(args.out)
    log_path = out / "log.jsonl"
    start = 0
    if args.resume:
        try:  # ds_usp's check first: a clear error for another world size or ZeRO stage, or no checkpoint
            path, _ = load_checkpoint(engine, str(out / "checkpoints"))
        except (FileNotFoundError, CheckpointMismatchError) as e:  # every rank stops; rank 0 says why
            hint = (f"; this program writes one every --save-every steps (now {args.save_every})"
                    if isinstance(e, FileNotFoundError) else "")
            raise SystemExit(f"--resume: {e}{hint}" if topo.rank == 0 else 1)
        start = engine.global_steps  # optimizer steps done: the data position follows from it
        if topo.rank == 0:
            print(f"resumed from {os.path.dirname(path)} at step {start}"
                  + (f"; it is already at --steps {args.steps}: nothing to train (raise --steps to continue)"
                     if start >= args.steps else ""), flush=True)
    if topo.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        # a resumed run rewrites the steps after its checkpoint (a crash may have logged some)
        logged = log_path.read_text().splitlines() if args.resume and log_path.exists() else []
        log_path.write_text("".join(f"{r}\n" for r in logged if r.strip() and json.loads(r)["step"] <= start))
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = micro * accumulation * topo.dp_size  # sequences per optimizer step
    split = f"U={topo.ulysses_degree} R={topo.ring_degree} dp={topo.dp_size} ({layout})"
    if topo.rank == 0:
        print(f"{n_params / 1e6:.2f}M parameters, "
              f"{data.shape[0]} sequences of {args.seq_len} tokens, {split}", flush=True)

    from tqdm import tqdm

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=topo.rank != 0, unit="step")
    for step in bar:
        t0 = time.perf_counter()
        total = 0.0
        for acc in range(accumulation):  # DeepSpeed steps the optimizer after the last one
            # same samples per optimizer step on every run and layout with this global batch
            first = step * global_batch + (acc * topo.dp_size + topo.dp_rank) * micro
            rows = torch.arange(first, first + micro) % data.shape[0]
            shard = ds_usp.shard_batch({"input_ids": data[rows].to(engine.device)}, topo, layout=layout)
            # the whole sequence's loss on every SP rank; long sequences never hold the whole logits
            loss = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                          shift_labels=shard["shift_labels"]).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        value = torch.tensor(total, device=engine.device)  # NCCL reduces CUDA tensors only
        if topo.dp_size > 1:
            dist.all_reduce(value, group=topo.dp_group)
        value = float(value) / (accumulation * topo.dp_size)
        tokens_per_s = global_batch * args.seq_len / (time.perf_counter() - t0)
        if topo.rank == 0:
            bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{tokens_per_s:.0f}", layout=split)
            with log_path.open("a") as f:
                f.write(json.dumps({"step": step + 1, "loss": value, "tokens_per_s": tokens_per_s,
                                    "layout": split}) + "\n")
        if not math.isfinite(value):
            raise SystemExit(f"loss is {value} at step {step + 1}")
        if args.save_every and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(str(out / "checkpoints"), client_state={"step": step + 1})
    if topo.rank == 0:
        rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        if rows:
            print(f"loss {rows[0]['loss']:.3f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.3f} "
                  f"(step {rows[-1]['step']}); log: {log_path}")
        if plot(log_path, out / "loss.png"):
            print(f"loss curve: {out / 'loss.png'}")


if __name__ == "__main__":
    main()
