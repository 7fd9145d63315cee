"""Diffusion transformers under USP: every family's attention forms trained exactly, or refused by name.

Tiny random configs of the installed diffusers (nothing downloaded), trained through ``ds_usp.initialize`` on 4 CPU
ranks against the same weights in one process with diffusers' own attention, the user's single-process loop on every
rank (whole inputs, whole output, ``F.mse_loss`` against a random target, 3 AdamW steps):

* Wan (T2V, and TI2V's per-token timestep), Flux, HunyuanVideo (two rows of right-padded text, 4 and 2 tokens; I2V's
  token_replace), LTX-Video (text mask; per-token timesteps), CogVideoX (RoPE), SD3.5 (dual attention, QK-norm, the
  last block's context_pre_only) and QwenImage (two rows: a text mask with holes in the middle, a full one);
* 2x2, 1x4 and 4x1 (where the heads allow: Flux's 2 and SD3.5's 3 heads take the ring), ZeRO-2 and ZeRO-3, every
  token count odd (so no stream divides the 4 ranks) and text of 5 or 6 tokens;
* each step's loss within 1e-4 relative of one process's, and every parameter's step-1 gradient within 1e-4
  relative of one process's (relative to its own norm, floored at 1e-4 of the whole model's gradient norm: a key
  bias's gradient is zero in exact arithmetic, so its rounding noise has no norm of its own to be relative to);
* a planted bug, one rank's RoPE positions off by one, fails exactly these checks;
* the memory stack (per-block selective checkpointing, tiled feed-forward) changes nothing;
* the key-validity mask of ``ds_usp.usp_attention`` (what joint attention with padding needs) against torch's SDPA
  at every split; the safety net refusing a training forward that ran no sequence-parallel layer, and not the user's
  module that calls ``ds_usp.usp_attention``; an unknown diffusers class, a custom processor and different inputs
  on the ranks of a group (at the first call, and a key mask at a later one) refused by name; the planner given a
  diffusers config.
"""
from __future__ import annotations

import json

import pytest
import torch

from dist_harness import get_topo

WORLD_TIMEOUT = 900
STEPS, LR = 3, 1e-3
LOSS_REL, GRAD_REL, GRAD_FLOOR = 1e-4, 1e-4, 1e-4


# ------------------------------------------------------------------------------------------------- the families


def _wan(ti2v: bool = False, latent: tuple[int, int, int] = (3, 6, 6)):
    from diffusers import WanTransformer3DModel

    def build():
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4,
                                     out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2,
                                     rope_max_seq_len=32)

    def inputs(g: torch.Generator) -> dict:
        frames, height, width = latent
        n = frames * (height // 2) * (width // 2)  # 27 tokens after the (1, 2, 2) patches
        t = torch.rand(1, n, generator=g) * 1000 if ti2v else torch.rand(1, generator=g) * 1000
        return dict(hidden_states=torch.randn(1, 4, frames, height, width, generator=g), timestep=t,
                    encoder_hidden_states=torch.randn(1, 5, 16, generator=g), return_dict=False)
    return build, inputs


def _flux():
    from diffusers import FluxTransformer2DModel

    def build():
        return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                      pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))

    def inputs(g: torch.Generator) -> dict:
        img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(3.0), torch.arange(3.0), indexing="ij"),
                              -1).reshape(-1, 3)
        return dict(hidden_states=torch.randn(1, 9, 16, generator=g),
                    encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                    pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.rand(1, generator=g),
                    img_ids=img_ids, txt_ids=torch.zeros(5, 3), guidance=torch.full((1,), 3.5), return_dict=False)
    return build, inputs


def _hunyuan(token_replace: bool = False):
    from diffusers import HunyuanVideoTransformer3DModel

    def build():
        extra = dict(image_condition_type="token_replace") if token_replace else {}
        return HunyuanVideoTransformer3DModel(
            **extra, in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))

    def inputs(g: torch.Generator) -> dict:
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])  # right-padded text of 4 and 2 tokens
        return dict(hidden_states=torch.randn(2, 4, 3, 6, 6, generator=g), timestep=torch.rand(2, generator=g) * 1000,
                    encoder_hidden_states=torch.randn(2, 6, 16, generator=g), encoder_attention_mask=mask,
                    pooled_projections=torch.randn(2, 8, generator=g), guidance=torch.full((2,), 6000.0),
                    return_dict=False)
    return build, inputs


def _ltx(per_token: bool = False):
    from diffusers import LTXVideoTransformer3DModel

    def build():
        return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=12,
                                          cross_attention_dim=48, num_layers=1, caption_channels=16)

    def inputs(g: torch.Generator) -> dict:
        n = 3 * 2 * 3  # 18 tokens
        mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
        t = torch.rand(1, n, generator=g) * 1000 if per_token else torch.rand(1, generator=g) * 1000
        return dict(hidden_states=torch.randn(1, n, 8, generator=g),
                    encoder_hidden_states=torch.randn(1, 5, 16, generator=g), timestep=t, encoder_attention_mask=mask,
                    num_frames=3, height=2, width=3, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)
    return build, inputs


def _cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    def build():
        return CogVideoXTransformer3DModel(num_attention_heads=6, attention_head_dim=16, in_channels=4, out_channels=4,
                                           time_embed_dim=16, text_embed_dim=16, num_layers=1, sample_width=6,
                                           sample_height=6, sample_frames=9, patch_size=2, max_text_seq_length=5,
                                           use_rotary_positional_embeddings=True)

    def inputs(g: torch.Generator) -> dict:
        angles = torch.randn(27, 8, generator=g).repeat_interleave(2, dim=-1)  # (tokens, head_dim) RoPE tables
        return dict(hidden_states=torch.randn(1, 3, 4, 6, 6, generator=g),
                    encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
                    timestep=torch.randint(0, 1000, (1,), generator=g), image_rotary_emb=(angles.cos(), angles.sin()),
                    return_dict=False)
    return build, inputs


def _sd35():
    from diffusers import SD3Transformer2DModel

    def build():
        return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                     num_attention_heads=3, joint_attention_dim=16, caption_projection_dim=24,
                                     pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8,
                                     dual_attention_layers=(0,), qk_norm="rms_norm")

    def inputs(g: torch.Generator) -> dict:
        return dict(hidden_states=torch.randn(1, 4, 6, 6, generator=g),
                    encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
                    pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.rand(1, generator=g) * 1000,
                    return_dict=False)
    return build, inputs


def _qwenimage():
    from diffusers import QwenImageTransformer2DModel

    def build():
        return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                           attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16,
                                           axes_dims_rope=(4, 6, 6))

    def inputs(g: torch.Generator) -> dict:
        mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])  # holes in the middle of [text, image]; a full row
        return dict(hidden_states=torch.randn(2, 9, 16, generator=g),
                    encoder_hidden_states=torch.randn(2, 5, 16, generator=g), encoder_hidden_states_mask=mask,
                    timestep=torch.rand(2, generator=g), img_shapes=[[(1, 3, 3)]] * 2, return_dict=False)
    return build, inputs


FAMILIES = {"wan": _wan, "wan_ti2v": lambda: _wan(ti2v=True), "wan_long": lambda: _wan(latent=(4, 32, 32)),
            "flux": _flux, "hunyuan": _hunyuan,
            "hunyuan_token_replace": lambda: _hunyuan(token_replace=True), "ltx": _ltx,
            "ltx_per_token": lambda: _ltx(per_token=True), "cogvideox": _cogvideox, "sd35": _sd35,
            "qwenimage": _qwenimage}


# ------------------------------------------------------------------------------------------------- one training run


def _ds_config(u: int, r: int, zero: int, usp: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": zero}, "sequence_parallel": "usp", "sequence_parallel_size": u * r,
            "usp": {"ulysses_degree": u, "ring_degree": r, "native_op": False, **usp}}


def _plant_rope_shift(model) -> None:
    """The planted bug: rank 1's RoPE positions off by one (its cos / sin tables rolled by one token)."""
    import torch.distributed as dist

    def roll(module, args, output):
        return tuple(torch.roll(x, 1, dims=1) for x in output) if dist.get_rank() == 1 else output
    model.rope.register_forward_hook(roll)


def train_family(family: str, u: int, r: int, zero: int, plant: bool = False, usp: dict = None,
                 plain_deepspeed: bool = False) -> dict:
    """On every rank: the family through ds_usp.initialize (or the plain ``deepspeed.initialize`` after ``import
    ds_usp``) and one process's reference; their differences."""
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F

    import ds_usp

    build, inputs = FAMILIES[family]()
    torch.manual_seed(0)
    ref = build()
    model = build()
    model.load_state_dict(ref.state_dict())
    entry = deepspeed.initialize if plain_deepspeed else ds_usp.initialize
    engine, *_ = entry(model=model, model_parameters=model.parameters(), config=_ds_config(u, r, zero, usp or {}))
    if plant:
        _plant_rope_shift(engine.module)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    report = {"loss": [], "grad": {}, "choices": None}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        given = inputs(g)
        want = ref(**given)[0]
        target = torch.randn(want.shape, generator=g)
        want_loss = F.mse_loss(want.float(), target)
        got = engine(**given)[0]
        loss = F.mse_loss(got.float(), target)
        report["loss"].append(abs(loss.item() - want_loss.item()) / abs(want_loss.item()))
        opt.zero_grad()
        want_loss.backward()
        engine.backward(loss)
        if step == 0:
            grads = {name: (deepspeed.utils.safe_get_full_grad(q), p.grad) for (name, p), (_, q) in
                     zip(ref.named_parameters(), engine.module.named_parameters())}
            total = torch.sqrt(sum((w.float() ** 2).sum() for _, w in grads.values() if w is not None))
            for name, (full, want_grad) in grads.items():
                want_grad = torch.zeros_like(full) if want_grad is None else want_grad
                full = torch.zeros_like(want_grad) if full is None else full
                report["grad"][name] = float((full.float() - want_grad.float()).norm() /
                                             max(float(want_grad.norm()), GRAD_FLOOR * float(total)))
            memory = engine.usp.memory
            report["choices"] = None if memory is None or memory.choices is None else \
                (memory.choices.checkpoint, memory.choices.checkpoint_layers, memory.choices.mlp_tiles)
        opt.step()
        engine.step()
    dist.barrier()
    return report


def _check(report: dict, what: str) -> None:
    assert max(report["loss"]) < LOSS_REL, f"{what}: loss relative errors {report['loss']}"
    bad = {n: e for n, e in report["grad"].items() if not e < GRAD_REL}
    assert report["grad"] and not bad, f"{what}: step-1 gradients off (relative): {bad}"


# family -> the (U, R, ZeRO) runs; together every family, every split the heads allow, ZeRO-2 and ZeRO-3
RUNS = {
    "wan": [(4, 1, 3), (2, 2, 2)], "wan_ti2v": [(1, 4, 2)], "flux": [(1, 4, 3), (2, 2, 2)],
    "hunyuan": [(2, 2, 3)], "hunyuan_token_replace": [(1, 4, 2)], "ltx": [(4, 1, 2)], "ltx_per_token": [(2, 2, 3)],
    "cogvideox": [(2, 2, 2)], "sd35": [(1, 4, 3)], "qwenimage": [(2, 2, 3), (4, 1, 2)],
}


PLAIN_DEEPSPEED = ("cogvideox",)  # these run through deepspeed.initialize itself (ds_usp's hook of it)


@pytest.mark.parametrize("family", sorted(RUNS))
def test_family_trains_as_one_process(world4, family):
    for u, r, zero in RUNS[family]:
        report = world4.run(train_family, family, u, r, zero, plain_deepspeed=family in PLAIN_DEEPSPEED)[0]
        _check(report, f"{family} {u}x{r} ZeRO-{zero}")


def test_a_shifted_rope_shard_fails_the_checks(world4):
    report = world4.run(train_family, "wan", 2, 2, 2, plant=True)[0]
    worst = max(report["grad"].values())
    assert worst > 100 * GRAD_REL and max(report["loss"]) > LOSS_REL, (
        f"rank 1's RoPE positions off by one went unnoticed: worst gradient error {worst:.2e}, losses "
        f"{report['loss']}")


def test_memory_stack_changes_nothing(world4):
    """Every block checkpointed and every feed-forward block tiled (Wan: 1024 tokens, 256 per rank, so the tile budget
    cuts 2 tiles; Flux: full checkpointing of its dual- and single-stream blocks)."""
    for family, mode, tiles in (("wan_long", "selective", 2), ("flux", "full", 1)):
        usp = {"activation_checkpointing": mode, "tiled_mlp": True, "tile_mib": 0.001}
        report = world4.run(train_family, family, 2, 2, 3, usp=usp)[0]
        _check(report, f"{family} 2x2 ZeRO-3, {mode} checkpointing and tiled feed-forward")
        assert report["choices"] == (mode, 2, tiles), f"{family}: the features did not apply: {report['choices']}"


# ---------------------------------------------------------------------------------------- the attention's key mask


def key_mask_attention(u: int, r: int) -> list[float]:
    """``usp_attention`` with valid-key runs (holes in the middle, per row) against SDPA with the boolean key mask:
    the output and dq, dk, dv (largest absolute errors)."""
    import torch.nn.functional as F

    import ds_usp

    topo = get_topo(u, r)
    torch.manual_seed(0)
    b, s, h, d = 2, 24, 4, 8
    q, k, v = (torch.randn(b, s, h, d, requires_grad=True) for _ in range(3))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, 3:5] = valid[0, 11:13] = valid[1, 20:] = valid[1, 6] = False
    keys = [[(a, e) for a, e in _runs(row)] for row in valid.tolist()]
    # (b, s, h, d) -> (b, h, s, d) for SDPA and back
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=valid[:, None, None, :]).transpose(1, 2)
    cot = torch.randn_like(want)
    (want * cot).sum().backward()
    mine = [ds_usp.shard_sequence(x.detach(), topo, 1, "contiguous").requires_grad_() for x in (q, k, v)]
    out = ds_usp.usp_attention(*mine, topo, causal=False, layout="contiguous", keys=keys, native_op=False)
    (out * ds_usp.shard_sequence(cot, topo, 1, "contiguous")).sum().backward()
    errs = [float((ds_usp.gather_sequence(out, topo, 1, "contiguous") - want).abs().max())]
    for x, shard in zip((q, k, v), mine):
        errs.append(float((ds_usp.gather_sequence(shard.grad, topo, 1, "contiguous") - x.grad).abs().max()))
    return errs


def _runs(row: list) -> list[tuple[int, int]]:
    out, start = [], None
    for i, x in enumerate(row + [False]):
        if x and start is None:
            start = i
        elif not x and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("split", [(2, 2), (1, 4), (4, 1)])
def test_key_mask_is_exact(world4, split):
    errs = world4.run(key_mask_attention, *split)[0]
    assert max(errs) < 1e-5, f"{split}: output / dq / dk / dv errors {errs}"


# ------------------------------------------------------------------------------------ no host read inside a block


def _masked_inputs(family: str, step: int) -> dict:
    """The family's inputs with a text key mask that changes every step (a new tensor each step)."""
    g = torch.Generator().manual_seed(200 + step)
    given = FAMILIES[family]()[1](g)
    if family == "hunyuan":  # right-padded text; diffusers' forward makes the blocks' (b, 1, 1, image + text) mask
        given["encoder_attention_mask"] = torch.tensor([[1] * (6 - step) + [0] * step,
                                                        [1] * (2 + step) + [0] * (4 - step)])
    else:  # QwenImage: holes that move (the blocks get the mask as bool, the processor a new joint mask per call)
        rows = [[1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1]]
        given["encoder_hidden_states_mask"] = torch.tensor([rows[step % 3], rows[(step + 1) % 3]])
    return given


def block_host_reads(family: str, u: int, r: int, usp: dict, diffusers_checkpointing: bool) -> list[dict]:
    """On every rank: ``STEPS`` training steps of the family with a key mask that changes per step, the host's reads of
    tensor values and the tensors it makes of host data inside the transformer blocks counted per step, forward and
    recomputation apart (:class:`ds_usp.instruments.work_meter.LayerHostReads`), and each step's loss against one
    process's."""
    import torch.nn.functional as F

    import ds_usp
    from ds_usp.instruments.work_meter import LayerHostReads

    build = FAMILIES[family]()[0]
    torch.manual_seed(0)
    ref = build()
    model = build()
    model.load_state_dict(ref.state_dict())
    if diffusers_checkpointing:
        model.enable_gradient_checkpointing()
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(u, r, 2, usp))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    blocks = [b for name in ("transformer_blocks", "single_transformer_blocks")
              for b in getattr(engine.module, name, ())]
    steps = []
    for step in range(STEPS):
        given = _masked_inputs(family, step)
        want = ref(**given)[0]
        target = torch.randn(want.shape, generator=torch.Generator().manual_seed(300 + step))
        want_loss = F.mse_loss(want.float(), target)
        with LayerHostReads(blocks) as reads:
            loss = F.mse_loss(engine(**given)[0].float(), target)
            engine.backward(loss)
        engine.step()
        opt.zero_grad()
        want_loss.backward()
        opt.step()
        steps.append({**reads.counts(), "sites": reads.sites(),
                      "loss": abs(loss.item() - want_loss.item()) / want_loss.item()})
    return steps


@pytest.mark.parametrize("family, split, usp, diffusers_checkpointing", [
    ("hunyuan", (2, 2), {"activation_checkpointing": False}, True),  # diffusers' checkpointing: the block's call again
    ("qwenimage", (1, 4), {"activation_checkpointing": "full"}, False),  # ds-usp's: the block's forward, below hooks
])
def test_no_host_read_inside_a_block_with_a_key_mask(world4, family, split, usp, diffusers_checkpointing):
    """Issue 63: with a key mask that changes every step, after the first step the host reads no tensor value and
    makes no tensor of host data inside any block, in the forward and in the recomputation; the training stays exact
    (each step's loss within 1e-4 relative of one process's)."""
    per_rank = world4.run(block_host_reads, family, *split, usp, diffusers_checkpointing)
    bad = []
    for rank, steps in enumerate(per_rank):  # every rank: a read on one rank alone stalls the group's collectives
        assert max(s["loss"] for s in steps) < LOSS_REL, (rank, [s["loss"] for s in steps])
        assert all(s["recompute"]["module_calls"] for s in steps), "no block was recomputed: the case checks nothing"
        bad += [(rank, i, {p: s[p] for p in ("fwd", "recompute")}, s["sites"]) for i, s in enumerate(steps)
                if i and s["sites"]]
    assert not bad, "host reads / host-made tensors inside the blocks after the first step:\n" + "\n".join(
        f"rank {rank}, step {i}: {c}\n  " + "\n  ".join(sites) for rank, i, c, sites in bad)


def _reference_keys(masks: dict, lengths: dict, order: tuple, batch: int, n: int):
    """The valid keys of the global sequence over ``order`` from boolean tensors (what DiTCall.keys computed before it
    worked on runs): per rank, each stream's part of its mask, padding dropped."""
    ranks = []
    for rank in range(n):
        parts = []
        for name in order:
            c = -(-lengths[name] // n)
            mask = masks.get(name, torch.ones(batch, lengths[name], dtype=torch.bool))
            part = mask[:, rank * c:(rank + 1) * c]
            part = torch.cat([part, torch.zeros(batch, c - part.shape[1], dtype=torch.bool)], dim=1)
            parts.append(part & (torch.arange(c) + rank * c < lengths[name]))
        ranks.append(torch.cat(parts, dim=1))
    valid = torch.cat(ranks, dim=1)
    return None if bool(valid.all()) else tuple(tuple(_runs(row)) for row in valid.tolist())


def test_dit_call_keys_cuts_and_deferred_checks():
    """In one process, a forward's state on every rank of several splits (a stand-in topology): the rank's part of a
    stream is ``shard_sequence``'s contiguous shard; the valid keys worked out from runs are those of the boolean
    masks; a mask object already cut is handed back as it was; a block's mask that is not the one the model's
    parameter makes, a second block's that differs from the first, and an attention's mask that is not the one ds-usp
    cut, are refused by name at the forward's end (:meth:`DiTCall.finish`), and what a recomputation checks after it
    is dropped."""
    from types import SimpleNamespace

    import ds_usp
    from ds_usp.integration.models.diffusion.hooks import cut_key_mask
    from ds_usp.integration.models.diffusion.plans import IMAGE, TEXT, RootMask
    from ds_usp.integration.models.diffusion.routing import AttentionRoute
    from ds_usp.integration.models.diffusion.state import DiTCall

    g = torch.Generator().manual_seed(0)
    prefix, kept = RootMask("encoder_attention_mask", TEXT, "prefix"), RootMask("text_mask", TEXT, "kept")

    def error(fn) -> str:
        try:
            fn()
        except ValueError as e:
            return str(e)
        return ""

    for u, r in ((1, 1), (2, 2), (1, 4), (3, 1)):
        for rank in range(u * r):
            topo = SimpleNamespace(ulysses_degree=u, ring_degree=r, sp_size=u * r, sp_rank=rank)
            for image, text in ((9, 5), (4, 6), (1, 3)):
                lengths = {IMAGE: image, TEXT: text}
                x = torch.randn(2, image, 3, generator=g)
                root = (torch.rand(2, text, generator=g) < 0.6).long()
                root[:, 0] = 1
                for form in (prefix, kept, None):  # HunyuanVideo's, QwenImage's, read where first given
                    call = DiTCall(topo, "M")
                    assert torch.equal(call.cut(x, IMAGE, 1), ds_usp.shard_sequence(x, topo, 1, "contiguous"))
                    call.cut(torch.randn(2, text, 3), TEXT, 1)
                    if form is not None:
                        call.expect_mask(form, root)
                    text_kept = torch.arange(text) < root.sum(1, keepdim=True) if form is prefix else root != 0
                    whole = torch.cat([torch.ones(2, image, dtype=torch.bool), text_kept], dim=1)[:, None, None]
                    part = cut_key_mask(call, whole, (IMAGE, TEXT))
                    assert cut_key_mask(call, whole, (IMAGE, TEXT)) is part
                    for order in ((IMAGE, TEXT), (TEXT, IMAGE), (TEXT,), (IMAGE,)):
                        assert call.keys(order, 2) == _reference_keys({TEXT: text_kept}, lengths, order, 2, u * r)
                    route = AttentionRoute(SimpleNamespace(call=call, model_name="M"), (IMAGE, TEXT), "blocks.0.attn")
                    route._check_mask(part, 2)  # the part handed on: nothing to compare
                    route._check_mask(part.clone().float().log(), 2)  # the same, additive
                    call.finish()
    # refused at the forward's end, by name
    topo = SimpleNamespace(ulysses_degree=2, ring_degree=1, sp_size=2, sp_rank=1)
    root = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])

    def forward(block_masks: list, attention_mask=None, recomputed=None) -> str:
        call = DiTCall(topo, "M")
        call.cut(torch.randn(2, 5, 3), IMAGE, 1)
        call.cut(torch.randn(2, 4, 3), TEXT, 1)
        call.expect_mask(prefix, root)
        parts = [cut_key_mask(call, m[:, None, None], (IMAGE, TEXT)) for m in block_masks]
        route = AttentionRoute(SimpleNamespace(call=call, model_name="M"), (IMAGE, TEXT), "blocks.0.attn")
        if attention_mask is not None:
            route._check_mask(attention_mask, 2)
        found = error(call.finish)
        if recomputed is not None:  # after the forward: dropped
            cut_key_mask(call, recomputed[:, None, None], (IMAGE, TEXT))
            route._check_mask(torch.zeros_like(parts[0]), 2)
            assert not call._pending
        return found

    made = torch.cat([torch.ones(2, 5, dtype=torch.bool), torch.arange(4) < root.sum(1, keepdim=True)], dim=1)
    holed = made.clone()
    holed[0, 5] = False
    assert forward([made, made.clone()], recomputed=holed) == ""
    assert "not the one ds-usp makes of its encoder_attention_mask" in forward([holed])
    assert "blocks are given different text key masks in one forward" in forward([made, holed])
    wrong = torch.zeros(2, 1, 1, 5, dtype=torch.bool)  # the rank's 3 image + 2 text tokens, none kept
    assert "M (blocks.0.attn) passes an attention mask to its attention" in forward([made], wrong)


# ----------------------------------------------------------------------------------------------- refusals, safety


class _NoSPModel(torch.nn.Module):
    """A plain module whose attention is torch's own: under SP each rank would run the whole sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).unflatten(-1, (2, 4)).transpose(1, 2)  # (b, s, 8) -> (b, 2, s, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


class _USPModel(torch.nn.Module):
    """The plain-PyTorch path: the user's module calls ds_usp.usp_attention on its shard."""

    def __init__(self, topo) -> None:
        super().__init__()
        self.proj, self.topo = torch.nn.Linear(8, 8), topo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import ds_usp

        q = self.proj(x).unflatten(-1, (2, 4))  # (b, s, 8) -> (b, s, 2, 4)
        return ds_usp.usp_attention(q, q, q, self.topo, causal=False, layout="contiguous", native_op=False).flatten(2)


def refusals() -> dict:
    """On every rank: what ds-usp refuses, each error's text (or None when it accepted)."""
    import ds_usp

    config = _ds_config(2, 2, 2, {})
    found = {}

    def error(fn) -> str | None:
        try:
            fn()
        except (ValueError, RuntimeError) as e:
            return str(e)
        return None

    def train_once(model, x) -> None:
        engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()

    found["no_sp_layer"] = error(lambda: train_once(_NoSPModel(), torch.randn(1, 8, 8)))
    found["usp_attention"] = error(lambda: train_once(_USPModel(get_topo(2, 2)), torch.randn(1, 4, 8)))

    from diffusers import PixArtTransformer2DModel
    from diffusers.models.attention_processor import AttnProcessor

    pixart = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                      num_layers=1, cross_attention_dim=16, sample_size=8, caption_channels=16)
    found["unknown_class"] = error(lambda: ds_usp.initialize(model=pixart, model_parameters=pixart.parameters(),
                                                             config=config))
    build, inputs = _wan()
    custom = build()
    custom.blocks[0].attn1.set_processor(AttnProcessor())
    found["custom_processor"] = error(lambda: ds_usp.initialize(model=custom, model_parameters=custom.parameters(),
                                                                config=config))
    model = build()
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
    import torch.distributed as dist

    given = inputs(torch.Generator().manual_seed(dist.get_rank()))  # a different batch on every rank
    found["different_inputs"] = error(lambda: engine(**given))
    build, inputs = _qwenimage()
    model = build()
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
    given = inputs(torch.Generator().manual_seed(0))
    engine(**given)  # the first call: the same inputs, checked equal
    given["encoder_hidden_states_mask"] = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, dist.get_rank() % 2]])
    found["different_mask"] = error(lambda: engine(**given))  # a later call: the mask's runs agreed at the root
    return found


def test_refusals_and_the_safety_net(world4):
    found = world4.run(refusals)
    assert all(f == found[0] for f in found), "the ranks answered differently"
    found = found[0]
    assert found["no_sp_layer"] and "_NoSPModel" in found["no_sp_layer"] and \
        "no ds-usp sequence-parallel layer ran" in found["no_sp_layer"], found["no_sp_layer"]
    assert found["usp_attention"] is None, f"the plain-PyTorch path was refused: {found['usp_attention']}"
    assert found["unknown_class"] and "PixArtTransformer2DModel" in found["unknown_class"], found["unknown_class"]
    assert found["custom_processor"] and "AttnProcessor" in found["custom_processor"] and \
        "blocks.0.attn1" in found["custom_processor"], found["custom_processor"]
    assert found["different_inputs"] and "same whole inputs" in found["different_inputs"], found["different_inputs"]
    assert found["different_mask"] and all(w in found["different_mask"] for w in (
        "QwenImageTransformer2DModel was called with different inputs", "encoder_hidden_states_mask (a hash)",
        "same whole inputs")), found["different_mask"]


# ------------------------------------------------------------------------------------------------------ the planner


def test_planner_reads_a_diffusers_config(tmp_path, capsys):
    """``python -m ds_usp.plan`` given a Wan 2.1 1.3B config: the tokens of a 480p 81-frame clip from the latent grid
    and the patch size, the heads and blocks from the config, Ulysses limited to the 12 heads' divisors (its
    ``main``, in this process)."""
    from ds_usp.plan import main

    config = {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.42.1", "patch_size": [1, 2, 2],
              "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16, "out_channels": 16,
              "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
              "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = main(["--model", str(path), "--frames", "21", "--height", "60", "--width", "104", "--gpus-per-node", "8",
                 "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = json.loads(out.out[out.out.index("{"):])
    assert plan["seq"] == 21 * 30 * 52, plan["seq"]
    assert plan["model"]["heads"] == 12 and plan["model"]["attention_layers"] == 30
    assert plan["model"]["causal"] is False
    assert 1.2e9 < plan["model"]["params"] < 1.5e9, plan["model"]["params"]
    feasible = [p for p in plan["plans"] if p["problem"] is None]
    assert feasible and all(12 % p["U"] == 0 for p in feasible)
    assert any("heads not divisible" in (p["problem"] or "") for p in plan["plans"] if p["U"] == 8)
    # without the latent grid, or with a class ds-usp has no plan for: an answer, not a guess
    with pytest.raises(SystemExit):
        main(["--model", str(path), "--frames", "21"])
    path.write_text(json.dumps({**config, "_class_name": "PixArtTransformer2DModel"}))
    assert main(["--model", str(path), "--frames", "1", "--height", "64", "--width", "64"]) == 1
    assert "PixArtTransformer2DModel" in capsys.readouterr().err
