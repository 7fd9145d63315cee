"""Asynchronous checkpoints (issue 39): how long a save pauses training, blocking against ``async_save``.

Run:

    python benchmarks/async_save.py --json async_save.json

Two shapes, each a fresh job that trains one step (so the optimizer state exists) and then saves ``--reps`` times each
way through the engine's ``save_checkpoint`` (the same complete checkpoint either way: files synced, manifest with
SHA-256, ``latest`` last):

* ``demo``: the README's demo (examples/train_llama.py: Llama hidden 128, 4 layers, byte vocabulary; 4 ranks, USP 2x2,
  ZeRO-3);
* ``1b``: the ~1B Llama's layer shape (TinyLlama: hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000)
  with ``--layers`` of its 22 layers (8 by default: 0.48B parameters; training state and one copy of it fill this
  24 GiB machine at 8), one rank, ZeRO-2, fp32, Adam.

Reported per save: the pause (how much later the group goes on: from the last rank's entering ``save_checkpoint`` to
the last rank's leaving it; beside it the slowest rank's call, which also counts any wait for a rank that entered
late), for an asynchronous save
also the time until its files are committed (``wait_for_checkpoint`` right after: nothing else runs), the time of one
training step taken while the write goes on against one without it, the growth of the resident set over the save
(``VmHWM``, largest rank: the host copy) and the bytes written; and the floor: DeepSpeed's own save with a checkpoint
engine that writes nothing (its barriers, tag check, ZeRO-3's parameter epilogue), which an asynchronous save still
runs on the training thread. Target (issue 39): the asynchronous pause under a third
of the blocking one, at both shapes. 4 ranks on 2 cores: the demo's times are the group's total work.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_job_flags, base_parser, run_as_job, start_ranks, write_result  # noqa: E402
from long_seq import read_peak, reset_peak  # noqa: E402

TAG = "[async_save]"
SHAPES = {  # ranks, ZeRO stage, tokens per step, Llama config
    "demo": (4, 3, 1024, dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2)),
    "1b": (1, 2, 128, dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4)),
}


class _NoWrites:
    """A checkpoint engine that writes nothing: what DeepSpeed's save costs around the writes (the floor)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def save(self, state_dict: object, path: str) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        return False

    def is_decoupled(self) -> bool:
        return False


def run(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ds_usp

    torch.set_num_threads(1 if args.role == "demo" else 2)
    ranks, stage, seq, shape = SHAPES[args.role]
    if args.role == "1b":
        shape = dict(shape, num_hidden_layers=args.layers)
    ds_usp.hf.register_usp_attention()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape, tie_word_embeddings=False),
                                             attn_implementation="usp" if ranks > 1 else "sdpa", dtype=torch.float32)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9}
    if ranks > 1:
        config.update(sequence_parallel="usp", sequence_parallel_size=ranks,
                      usp={"ulysses_degree": 2, "ring_degree": ranks // 2})
    engine = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    ids = torch.randint(0, shape["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    if ranks > 1:
        batch = {k: v for k, v in ds_usp.shard_batch({"input_ids": ids}, engine.usp.topo,
                                                     layout=engine.usp.layout).items()
                 if k in ("input_ids", "position_ids", "shift_labels")}
    else:
        batch = {"input_ids": ids, "labels": ids}

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(**batch).loss)
        engine.step()
        return time.perf_counter() - start

    step()  # the optimizer state exists from here
    idle_step = step()
    params = sum(p.numel() for p in model.parameters()) if stage < 3 else sum(
        p.ds_numel for p in model.parameters())
    rows = []
    root = Path(args.dir)
    for rep in range(args.reps):
        for mode in ("blocking", "async", "floor"):
            where = root / f"{mode}{rep}"
            base = reset_peak()  # before the barrier: it took a rank up to 0.3 s here, which the save's pause counted
            dist.barrier()
            start = time.perf_counter()
            if mode == "floor":  # DeepSpeed's own save with a checkpoint engine that writes nothing
                inner, engine.checkpoint_engine = engine.checkpoint_engine, _NoWrites(engine.checkpoint_engine)
                type(engine).save_checkpoint(engine, str(where), save_latest=False)
                engine.checkpoint_engine = inner
            else:
                engine.save_checkpoint(str(where), async_save=mode == "async")
            end = time.perf_counter()
            row = {"mode": mode, "start": start, "end": end}
            if mode == "async":
                row["step_during_write_s"] = step()
                engine.wait_for_checkpoint()
                dist.barrier()
                row["until_committed_s"] = time.perf_counter() - start
            row["peak_growth_mib"] = (read_peak() - base) / 2**20
            dist.barrier()
            if dist.get_rank() == 0 and mode == "floor":
                shutil.rmtree(where)
            elif dist.get_rank() == 0:
                files = [p for p in where.rglob("*") if p.is_file()]
                row["bytes_written"] = sum(p.stat().st_size for p in files)
                assert (where / (where / "latest").read_text().strip() / "ds_usp_manifest.json").is_file()
                shutil.rmtree(where)
            rows.append(row)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    for i, row in enumerate(rows):  # the slowest rank, the largest growth
        for key in ("until_committed_s", "step_during_write_s", "peak_growth_mib"):
            if key in row:
                row[key] = max(r[i][key] for r in everyone)
        # the group goes on when its last rank leaves the save; without a save it could go on when its last rank
        # arrived (the clock is the host's monotonic one, the same in every process of one node)
        starts, ends = [r[i].pop("start") for r in everyone], [r[i].pop("end") for r in everyone]
        row["pause_s"] = max(ends) - max(starts)
        row["slowest_call_s"] = max(e - s for s, e in zip(starts, ends))
    dist.barrier()
    return {"params": params, "ranks": ranks, "zero_stage": stage, "idle_step_s": idle_step, "saves": rows} \
        if dist.get_rank() == 0 else {}


def _job(shape: str, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="async_save_")) / "row.json"
    start_ranks(__file__, ["--role", shape, "--out", out, "--reps", args.reps or (8 if shape == "demo" else 2),
                           "--layers", args.layers, "--dir", out.parent / "ckpt"], SHAPES[shape][0],
                env={"OMP_NUM_THREADS": "1"}, check=True)
    row = __import__("json").loads(out.read_text())
    shutil.rmtree(out.parent)
    return row


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--shapes", default="demo,1b", help="which shapes to run")
    p.add_argument("--reps", type=int, default=None,
                   help="saves of each kind (default: 8 at the demo's size, where 4 ranks on 2 cores make one noisy; 2 at 1b)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the 1b shape (22: the whole 1.1B)")
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    add_job_flags(p)
    args = p.parse_args()
    if run_as_job(args, run):
        return
    results = {}
    for shape in args.shapes.split(","):
        res = results[shape] = _job(shape, args)
        blocking = [s["pause_s"] for s in res["saves"] if s["mode"] == "blocking"]
        async_ = [s for s in res["saves"] if s["mode"] == "async"]
        res["pause_ratio"] = min(s["pause_s"] for s in async_) / min(blocking)
        floor = min(s["pause_s"] for s in res["saves"] if s["mode"] == "floor")
        print(f"{TAG} {shape} ({res['params'] / 1e6:.1f}M parameters, {res['saves'][0]['bytes_written'] / 2**20:.0f} "
              f"MiB written): blocking save pauses {min(blocking):.2f} s; async pauses "
              f"{min(s['pause_s'] for s in async_):.2f} s (ratio {res['pause_ratio']:.3f}, target < 0.333), committed "
              f"after {min(s['until_committed_s'] for s in async_):.2f} s; a step {res['idle_step_s']:.2f} s idle, "
              f"{min(s['step_during_write_s'] for s in async_):.2f} s while writing; copy "
              f"{max(s['peak_growth_mib'] for s in async_):.0f} MiB; DeepSpeed's save writing nothing {floor:.2f} s "
              f"({floor / min(blocking):.3f} of the blocking pause); the slowest rank's call: blocking "
              f"{min(s['slowest_call_s'] for s in res['saves'] if s['mode'] == 'blocking'):.2f} s, async "
              f"{min(s['slowest_call_s'] for s in async_):.2f} s", flush=True)
    if args.json:
        path = write_result(args.json, {"benchmark": "async_save", "args": {
            k: v for k, v in vars(args).items() if k not in ("role", "out", "dir")}, "shapes": results})
        print(f"{TAG} wrote {path}")


if __name__ == "__main__":
    main()
