"""A VLM's vision tower at length (issue 37): per-rank peak memory and time of the tower, whole on every rank vs sharded.

Run:

    python benchmarks/vision_tower.py --videos 1x8,1x16,2x16,2x28,8x28 --json vision_tower.json
    python benchmarks/vision_tower.py --videos 16x28 --systems sharded --json vision_tower_long.json

One forward and backward of a Qwen2.5-VL vision tower (random weights; ``--hidden`` 512, ``--depth`` 8 blocks, 8
heads, window attention with full attention at blocks 3 and 7, Qwen2.5-VL's patch 14 / window 112 / merge 2) on one
video of ``T`` temporal patches of ``S`` x ``S`` patches each (``--videos TxS,...``), inside a tiny Qwen2.5-VL built with
``attn_implementation="usp"`` and ``ds_usp.initialize`` on 4 CPU ranks (2x2 zigzag), once per system, each a fresh job:

* ``replicated`` (``usp.vision_tower`` default): every rank encodes every patch (sdpa; on CPU the family's own
  non-flash path, which runs one attention call per window or frame);
* ``sharded``: each block on the rank's quarter of the patches, its attention USP over the group (one call over
  the windows or frames as documents).

Memory: the growth of the resident set over the tower's forward and backward (``5 > /proc/self/clear_refs`` and
``malloc_trim`` first, ``VmHWM`` minus the resident size then), the largest over the ranks. Time: wall seconds of the
same, the slowest rank; 4 ranks share this machine's cores, so it measures the group's total work. The merged
features (the tower's output) of the two systems must agree to 1e-4 (checked, printed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_job_flags, base_parser, run_as_job, start_ranks, write_result  # noqa: E402
from long_seq import read_peak, reset_peak  # noqa: E402

TAG = "[vision_tower]"


def _model(args: argparse.Namespace):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads = 8
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=args.depth, hidden_size=args.hidden, intermediate_size=args.hidden * 27 // 10,
                           num_heads=heads, out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, window_size=112,
                           fullatt_block_indexes=[d for d in range(args.depth) if d % 4 == 3]))
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="usp", dtype=torch.float32)


def run(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    import ds_usp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ds_usp.hf.register_usp_attention()
    model = _model(args)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
              "sequence_parallel": "usp", "sequence_parallel_size": 4,
              "usp": {"ulysses_degree": 2, "ring_degree": 2, "vision_tower": args.role}}
    engine = ds_usp.initialize(model=model, config=config)[0]
    tower = engine.module.model.visual
    grid = torch.tensor([[args.frame_count, args.side_count, args.side_count]])
    patches = int(grid.prod())
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    base = reset_peak()
    start = time.perf_counter()
    out = tower(pixels, grid_thw=grid).pooler_output
    loss = out.pow(2).mean()
    loss.backward()
    seconds = time.perf_counter() - start
    row = {"patches": patches, "peak_mib": (read_peak() - base) / 2**20, "seconds": seconds,
           "features": out.detach()[::max(1, out.shape[0] // 64)].flatten()[:4096].tolist()}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"peak_mib": row["peak_mib"], "seconds": seconds})
    row["peak_mib"] = max(r["peak_mib"] for r in rows)
    row["peak_mib_per_rank"] = [r["peak_mib"] for r in rows]
    row["seconds"] = max(r["seconds"] for r in rows)
    dist.barrier()
    return row if dist.get_rank() == 0 else {}


def _job(system: str, frames: int, side: int, args: argparse.Namespace) -> dict:
    out = Path(f"/tmp/vision_tower_{os.getpid()}_{system}_{frames}x{side}.json")
    start_ranks(__file__, ["--role", system, "--frame-count", frames, "--side-count", side, "--hidden", args.hidden,
                           "--depth", args.depth, "--out", out], 4, check=True)
    return json.loads(out.read_text())


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--videos", default="1x8,1x16,2x16,2x28,8x28",
                   help="videos as TxS: T temporal patches of S x S patches (28: a 392x392 frame), one run each")
    p.add_argument("--systems", default="replicated,sharded", help="which systems to run")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    add_job_flags(p)
    p.add_argument("--frame-count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--side-count", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if run_as_job(args, run):
        return
    results = []
    systems = args.systems.split(",")
    for video in args.videos.split(","):
        frames, side = (int(x) for x in video.split("x"))
        rows = {system: _job(system, frames, side, args) for system in systems}
        patches = next(iter(rows.values()))["patches"]
        line = " | ".join(f"{k} peak {v['peak_mib']:8.1f} MiB {v['seconds']:6.2f} s" for k, v in rows.items())
        result = {"video": video, "patches": patches, **rows}
        if len(rows) == 2:
            a, b = rows["replicated"], rows["sharded"]
            drift = max(abs(x - y) for x, y in zip(a.pop("features"), b.pop("features")))
            result["max_abs_diff"] = drift
            line += (f" | memory {b['peak_mib'] / a['peak_mib']:.3f}x time {b['seconds'] / a['seconds']:.3f}x | "
                     f"features max |diff| {drift:.1e}")
            if not drift < 1e-4:
                raise SystemExit(f"{TAG} the systems disagree on the features ({drift:.2e})")
        for row in rows.values():
            row.pop("features", None)
        results.append(result)
        print(f"{TAG} {video:>6} ({patches:6d} patches): {line}", flush=True)
    if args.json:
        path = write_result(args.json, {"benchmark": "vision_tower", "args": {k: v for k, v in vars(args).items()
                                                                             if k not in ("role", "out", "frame_count",
                                                                                          "side_count")},
                                        "runs": results})
        print(f"{TAG} wrote {path}")


if __name__ == "__main__":
    main()
