"""A vision-language model trained with USP: a tiny random Qwen2.5-VL on rows with images and a video.

    deepspeed --num_gpus 4 examples/train_vlm.py

The README's path, unchanged, for a VLM: the model built with ``attn_implementation="usp"``, ``ds_usp.initialize``,
``ds_usp.shard_batch(batch, topo, layout=...)`` given the whole multimodal batch (``input_ids`` with the placeholder
tokens, ``mm_token_type_ids``, ``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` / ``video_grid_thw``,
``labels``), and ``engine(**shard)`` returning the whole sequence's loss. Each rank runs the vision tower on every
image and frame (``--vision-tower sharded``: each block on the rank's shard of the patches), the model's own code splices the features in and computes the 3-D MRoPE positions on the whole
sequence, and the language model runs on the rank's shard (docs/models.md, "Vision-language models").

The data is random (nothing downloaded): each row is a text prompt, an image (``--image`` patches per side), more text,
a video of ``--frames`` frames and an answer; the loss is on the text after the image. The loss falls as the model
learns the random tokens' distribution; every rank prints the same loss.
"""
from __future__ import annotations

import argparse
import os

import torch

import ds_usp

IMAGE, VIDEO, START, END, VOCAB = 500, 501, 502, 503, 512


def model(attn: str = "usp"):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                           patch_size=8, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=32,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def batch(step: int, side: int, frames: int) -> dict:
    """One row: prompt, image (side x side patches), text, video (frames x side x side), answer."""
    g = torch.Generator().manual_seed(step)
    text = lambda n: torch.randint(0, 400, (n,), generator=g)  # noqa: E731
    image_tokens, video_tokens = side * side // 4, (frames // 2) * side * side // 4
    ids = torch.cat([text(37), torch.tensor([START]), torch.full((image_tokens,), IMAGE), torch.tensor([END]), text(21),
                     torch.tensor([START]), torch.full((video_tokens,), VIDEO), torch.tensor([END]), text(63)])[None]
    labels = ids.clone()
    labels[:, :37 + image_tokens + 2] = -100  # the prompt and the image are not scored
    labels[ids == VIDEO] = -100
    patch = 3 * 2 * 8 * 8
    return {"input_ids": ids, "labels": labels,
            "mm_token_type_ids": (ids == IMAGE).long() + 2 * (ids == VIDEO).long(),
            "pixel_values": torch.randn(side * side, patch, generator=g),
            "image_grid_thw": torch.tensor([[1, side, side]]),
            "pixel_values_videos": torch.randn((frames // 2) * side * side, patch, generator=g),
            "video_grid_thw": torch.tensor([[frames // 2, side, side]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--image", type=int, default=16, help="image patches per side (even)")
    parser.add_argument("--frames", type=int, default=4, help="video frames (even)")
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--vision-tower", default="replicated", choices=("replicated", "sharded"),
                        help="usp.vision_tower: every rank encodes every patch, or each its shard")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    ds_usp.hf.register_usp_attention()
    net = model()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "sequence_parallel": "usp", "sequence_parallel_size": world,
              "usp": {"layout": args.layout, "vision_tower": args.vision_tower}}
    engine, *_ = ds_usp.initialize(model=net, model_parameters=net.parameters(), config=config)
    topo = engine.usp.topo
    for step in range(args.steps):
        full = batch(step % 4, args.image, args.frames)
        shard = ds_usp.shard_batch(full, topo, layout=args.layout)
        loss = engine(**shard).loss
        engine.backward(loss)
        engine.step()
        if topo.rank == 0:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}  ({full['input_ids'].shape[1]} tokens, "
                  f"{int(shard['input_ids'].shape[1])} per rank)", flush=True)


if __name__ == "__main__":
    main()
