"""Train a small video (Wan) or image (Flux) diffusion transformer with Unified Sequence Parallelism.

    deepspeed --num_gpus 4 examples/train_dit.py --deepspeed_config ds_configs/dit_demo.json
    deepspeed --num_gpus 4 examples/train_dit.py --deepspeed_config ds_configs/dit_demo.json --family flux

* model: a diffusers ``WanTransformer3DModel`` (or ``FluxTransformer2DModel``) built from a small config with random
  weights (nothing is downloaded);
* data: synthetic latents, smooth random fields (sums of a few low-frequency waves over frames x height x width)
  with a text embedding drawn from the field's own wave numbers, so the model has something to learn from the text;
* flow matching, the loss of the single-process loop: ``x_t = (1 - s) x_0 + s eps``, the model predicts the velocity
  ``eps - x_0`` (Wan takes the timestep ``1000 s``, Flux ``s``), ``F.mse_loss`` on the whole output;
* the loop is the single-process one: every rank of a sequence-parallel group gives the model the same whole latents,
  noise and timesteps (drawn per data-parallel replica) and gets the whole prediction back; ds-usp cuts the tokens
  after the patch embedding, runs the attention over the group and gathers before the final projection;
* progress bar (loss, samples/s, layout), JSON-lines log and ``loss.png`` at the end when matplotlib is present.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_usp
import ds_usp.config

WAVES = 4  # low-frequency waves per synthetic latent
TEXT_TOKENS, TEXT_DIM = 8, 32


def build_model(family: str, heads: int, seed: int) -> torch.nn.Module:
    """A small diffusers transformer with random weights."""
    torch.manual_seed(seed)
    if family == "wan":
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=16,
                                     in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=64, ffn_dim=128,
                                     num_layers=2, rope_max_seq_len=256)
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=TEXT_DIM, guidance_embeds=False, axes_dims_rope=(4, 6, 6))


def sample(index: int, frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index`` of the synthetic data set: a latent ``(4, frames, height, width)`` and its text ``(T, D)``."""
    g = torch.Generator().manual_seed(1000 + index)
    k = torch.randint(1, 4, (WAVES, 3), generator=g).float()  # wave numbers along frames, height, width
    phase = torch.rand(WAVES, 4, generator=g) * 2 * math.pi
    f, h, w = torch.meshgrid(torch.linspace(0, 1, frames), torch.linspace(0, 1, height), torch.linspace(0, 1, width),
                             indexing="ij")
    grid = torch.stack([f, h, w], -1)  # (F, H, W, 3)
    arg = 2 * math.pi * (grid @ k.t())  # (F, H, W, waves)
    latent = torch.sin(arg[None] + phase.t()[:, None, None, None, :]).sum(-1) / math.sqrt(WAVES)  # (4, F, H, W)
    text = torch.cat([k.flatten(), phase.flatten()]) @ torch.randn(k.numel() + phase.numel(), TEXT_TOKENS * TEXT_DIM,
                                                                   generator=torch.Generator().manual_seed(7))
    return latent, text.view(TEXT_TOKENS, TEXT_DIM) / 10


def flow_matching_step(engine, family: str, latent: torch.Tensor, text: torch.Tensor,
                       g: torch.Generator) -> torch.Tensor:
    """One forward of the flow-matching loss on a batch (``(b, 4, F, H, W)`` latents, ``(b, T, D)`` text)."""
    b = latent.shape[0]
    # logit-normal times, as SD3 / Flux train, stratified over the batch (a steadier loss curve)
    s = torch.sigmoid(torch.erfinv(2 * (torch.arange(b) + torch.rand(b, generator=g)) / b - 1) * math.sqrt(2))
    noise = torch.randn(latent.shape, generator=g)
    x_t = (1 - s.view(-1, 1, 1, 1, 1)) * latent + s.view(-1, 1, 1, 1, 1) * noise
    target = noise - latent
    device = engine.device
    if family == "wan":
        pred = engine(hidden_states=x_t.to(device), timestep=(1000 * s).to(device),
                      encoder_hidden_states=text.to(device), return_dict=False)[0]
    else:  # Flux takes packed image tokens (b, H*W, C) with their 3-axis ids, frames folded into the height
        _, c, frames, height, width = latent.shape
        tokens = x_t.permute(0, 2, 3, 4, 1).reshape(b, frames * height * width, c)
        ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(frames * height * 1.0),
                                         torch.arange(width * 1.0), indexing="ij"), -1).reshape(-1, 3)
        pred = engine(hidden_states=tokens.to(device), encoder_hidden_states=text.to(device),
                      pooled_projections=text.mean(1).to(device), timestep=s.to(device), img_ids=ids.to(device),
                      txt_ids=torch.zeros(text.shape[1], 3, device=device), return_dict=False)[0]
        pred = pred.reshape(b, frames, height, width, c).permute(0, 4, 1, 2, 3)
    return F.mse_loss(pred.float(), target.to(pred.device).float())


def plot(log_path: Path, out: Path) -> bool:
    """Draw the loss curve from the JSON-lines log; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    steps, losses = [r["step"] for r in rows], [r["loss"] for r in rows]
    window = max(1, len(rows) // 10)
    mean = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, alpha=0.35, label="loss")
    ax.plot(steps, mean, label=f"mean of {window} steps")
    ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss (MSE)")
    ax.set_yscale("log")
    ax.set_title(f"{rows[-1]['family']}, {rows[-1]['layout']}" if rows else "")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_config", default="ds_configs/dit_demo.json",
                        help="DeepSpeed JSON with the sequence_parallel keys")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    parser.add_argument("--family", choices=("wan", "flux"), default="wan", help="video (Wan) or image (Flux) DiT")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--frames", type=int, default=5, help="latent frames (Flux folds them into the height)")
    parser.add_argument("--height", type=int, default=18, help="latent height")
    parser.add_argument("--width", type=int, default=22, help="latent width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads; ulysses_degree must divide them")
    parser.add_argument("--samples", type=int, default=64, help="synthetic samples in the data set")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and the noise")
    parser.add_argument("--out", default="runs/train_dit", help="log and loss.png go here")
    args = parser.parse_args()
    try:  # a missing or unreadable config is reported before the model is built
        ds_usp.config.read_ds_config(args.deepspeed_config)
    except ds_usp.USPConfigError as e:
        raise SystemExit(f"--deepspeed_config: {e}")
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

    model = build_model(args.family, args.heads, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
    topo = engine.usp.topo
    if topo is None:
        raise SystemExit('this example trains with sequence parallelism: set "sequence_parallel" in the config')
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = micro * accumulation * topo.dp_size
    data = [sample(i, args.frames, args.height, args.width) for i in range(args.samples)]
    tokens = args.frames * (args.height // 2) * (args.width // 2) if args.family == "wan" else \
        args.frames * args.height * args.width
    split = f"U={topo.ulysses_degree} R={topo.ring_degree} dp={topo.dp_size}"
    out = Path(args.out)
    log_path = out / "log.jsonl"
    if topo.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        print(f"{args.family}: {n_params / 1e6:.2f}M parameters, {tokens} image tokens per sample "
              f"({tokens / topo.sp_size:.1f} per rank), {split}", flush=True)

    from tqdm import tqdm

    bar = tqdm(range(args.steps), disable=topo.rank != 0, unit="step")
    for step in bar:
        t0 = time.perf_counter()
        total = 0.0
        for acc in range(accumulation):
            # this replica's samples and noise: the same on every rank of its sequence-parallel group
            first = step * global_batch + (acc * topo.dp_size + topo.dp_rank) * micro
            rows = [data[i % len(data)] for i in range(first, first + micro)]
            latent, text = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + first)
            loss = flow_matching_step(engine, args.family, latent, text, g)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        value = torch.tensor(total, device=engine.device)
        if topo.dp_size > 1:
            dist.all_reduce(value, group=topo.dp_group)
        value = float(value) / (accumulation * topo.dp_size)
        per_s = global_batch / (time.perf_counter() - t0)
        if topo.rank == 0:
            bar.set_postfix(loss=f"{value:.4f}", samples_s=f"{per_s:.2f}", layout=split)
            with log_path.open("a") as f:
                f.write(json.dumps({"step": step + 1, "loss": value, "samples_per_s": per_s, "layout": split,
                                    "family": args.family}) + "\n")
        if not math.isfinite(value):
            raise SystemExit(f"loss is {value} at step {step + 1}")
    if topo.rank == 0:
        rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        print(f"loss {rows[0]['loss']:.4f} (step 1) -> {rows[-1]['loss']:.4f} (step {rows[-1]['step']}); "
              f"memory features: {engine.usp.memory.choices.describe(engine.usp.memory.layers)}; log: {log_path}")
        if plot(log_path, out / "loss.png"):
            print(f"loss curve: {out / 'loss.png'}")


if __name__ == "__main__":
    main()
