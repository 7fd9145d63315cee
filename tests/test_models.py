"""The model zoo: every decoder family long-context users train, exact under USP or refused by name.

Tiny random configs of the installed transformers (nothing downloaded), trained through ``ds_usp.initialize``
(ZeRO-2) on 4 CPU ranks, 2 Ulysses x 2 ring, zigzag, an odd length (S = 67), against the same weights in one
process with the family's own eager attention on the whole sequence:

* regime "features": weights at std 0.1 and caps that matter (Gemma 2: 2 on attention, 3 on logits; Granite's
  logits divided by 4; Cohere's scaled by 1/16; GPT-OSS's sinks): the first step's per-token losses (through the
  gathered logits) within 1e-4, ``engine(**shard).loss`` within 1e-5 relative of HF's own loss, and the gradient
  of every parameter within 1e-3 relative (``deepspeed.utils.safe_get_full_grad``: the sinks included);
* regime "usual": HF's own init, 3 AdamW steps, each step's per-token losses within 1e-4 and the SP loss within
  1e-5 relative of the reference's (no family's eager and sdpa attentions drift apart by 1e-4 after 3 steps
  here: tests/test_models.py::test_reference_variants_agree measures it, the bound holds with that drift);
* packed documents and a 1 x 4 ring for the families with softcap, sinks and MLA; the MoE router loss
  (``output_router_logits=True``) of the MoE families equal to the single-process one for the whole sequence.

Falcon (its attention bypasses transformers' interface) and a model built with another attention are refused by
name. docs/models.md's table lists exactly these families (checked here), and every keyword any attention module
of the installed transformers passes to the interface is classified as honoured, neutral or refused by ds-usp.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from dist_harness import get_topo

SEQ, VOCAB, STEPS, LR = 67, 128, 3, 1e-3
LOSS_TOL = dict(rtol=1e-5, atol=1e-4)  # per-token losses
GRAD_REL = 1e-3
WORLD_TIMEOUT = 900
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            attention_dropout=0.0)
ALTERNATING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
# family -> (config class, its tiny settings, what ds-usp does for it beyond plain attention)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "plain"),
    "mistral": ("MistralConfig", {"sliding_window": 16}, "sliding window on every layer"),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, **ALTERNATING}, "per-layer windows"),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "use_sliding_window": True, **ALTERNATING}, "per-layer windows"),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}, "MoE: tiled experts, SP router loss"),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
                "MoE: tiled experts, SP router loss; window"),
    "gemma": ("GemmaConfig", {"head_dim": 16}, "plain"),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, **ALTERNATING,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
               "attention soft-cap, final logit soft-cap, per-layer windows"),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16, **ALTERNATING,
                                         "final_logit_softcapping": 3.0}, "final logit soft-cap, per-layer windows"),
    "phi3": ("Phi3Config", {"sliding_window": 16}, "sliding window"),
    "starcoder2": ("Starcoder2Config", {"sliding_window": 16}, "sliding window"),
    "olmo2": ("Olmo2Config", {}, "plain"),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "attention_multiplier": 0.25}, "logits divided by "
                "logits_scaling, attention scale attention_multiplier"),
    "cohere": ("CohereConfig", {}, "logits times logit_scale"),
    "smollm3": ("SmolLM3Config", {}, "NoPE layers"),
    "gpt_oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, **ALTERNATING,
                                 "max_position_embeddings": 4096},
                "attention sinks (s_aux, with their gradient), per-layer windows, MoE"),
    "glm4": ("Glm4Config", {"head_dim": 16}, "partial rotary"),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 8,
                                         "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                                         "topk_group": 1, "rope_scaling": None},
                    "MLA (value head dim 8, query/key 24), MoE"),
    "gpt_neox": ("GPTNeoXConfig", {}, "partial rotary, parallel residual"),
    "llama4_text": ("Llama4TextConfig", {"head_dim": 16, "intermediate_size_mlp": 128, "num_local_experts": 4,
                                         "attention_chunk_size": 16, "no_rope_layers": [1, 0], "floor_scale": 8,
                                         "attn_temperature_tuning": True},
                    "chunked attention (the mask's chunks, from each document's start), NoPE layers with "
                    "attention temperature tuning by the global row, MoE"),
}
FEATURES = {  # regime "features": what makes each family's special arguments matter
    "granite": {"logits_scaling": 4.0}, "cohere": {"logit_scale": 0.0625},
}
SPECIAL = ("gemma2", "gpt_oss", "deepseek_v3", "llama4_text")  # softcap, sinks, MLA, chunks: also packed and 1x4
ROW_REFERENCE = ("llama4_text",)  # packed rows: the reference is HF on the whole row (see _reference_token_losses)
MOE = ("qwen3_moe", "mixtral", "gpt_oss")
REFUSED = {"falcon": "computes attention in its own code"}
DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def _config(family: str, regime: str):
    import transformers

    name, extra, _ = FAMILIES[family]
    kwargs = {**BASE, **extra, **(FEATURES.get(family, {}) if regime == "features" else {})}
    if family == "gpt_neox":
        kwargs.pop("num_key_value_heads")
    if regime == "features":
        kwargs["initializer_range"] = 0.1
    return getattr(transformers, name)(**kwargs)


def _models(family: str, regime: str):
    """(reference with eager attention, the same weights with "usp" attention)."""
    from transformers import AutoModelForCausalLM

    import ds_usp

    ds_usp.hf.register_usp_attention()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(family, regime), attn_implementation="eager", dtype=torch.float32)
    sp = AutoModelForCausalLM.from_config(_config(family, regime), attn_implementation="usp", dtype=torch.float32)
    sp.load_state_dict(ref.state_dict())
    return ref, sp


def _batch(step: int, packed: bool) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packed:  # three documents: positions restart at each
        batch["position_ids"] = torch.cat([torch.arange(n) for n in (20, 30, SEQ - 50)]).unsqueeze(0)
    return batch


def _doc_lens(batch: dict) -> list[int]:
    pos = batch.get("position_ids")
    if pos is None:
        return [SEQ]
    starts = [0] + (torch.nonzero(pos[0, 1:] == 0).flatten() + 1).tolist()
    return [b - a for a, b in zip(starts, starts[1:] + [SEQ])]


def _reference_token_losses(model, batch: dict, whole_row: bool = False,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Per-token losses ``(S,)`` (0 where ignored) and the mean loss of the whole batch, one document at a time;
    ``whole_row``: the packed row in one call with its position ids, as HF computes it (Llama 4 scales its NoPE
    queries by the row index, not the document's position, so a packed row differs from its documents alone)."""
    import torch.nn.functional as F

    losses, outs, start = [], [], 0
    if whole_row and "position_ids" in batch:
        ids = batch["input_ids"]
        out = model(input_ids=ids, position_ids=batch["position_ids"], use_cache=False, **kwargs)
        tokens = F.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:], reduction="none")
        ends = torch.tensor(_doc_lens(batch)).cumsum(0) - 1  # the last token of a document predicts nothing
        tokens = torch.cat([tokens, torch.zeros(1)]).index_fill(0, ends, 0.0)
        return tokens, tokens.sum() / (SEQ - len(ends)), [out]
    for n in _doc_lens(batch):
        ids = batch["input_ids"][:, start:start + n]
        out = model(input_ids=ids, **kwargs)
        logits = out.logits[0, :-1].float()
        losses.append(F.cross_entropy(logits, ids[0, 1:], reduction="none"))
        losses.append(torch.zeros(1))
        outs.append(out)
        start += n
    tokens = torch.cat(losses)
    return tokens, tokens.sum() / (SEQ - len(_doc_lens(batch))), outs


def _ds_config(u: int, r: int, layout: str = "zigzag") -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 2}, "sequence_parallel": "usp", "sequence_parallel_size": u * r,
            "usp": {"ulysses_degree": u, "ring_degree": r, "layout": layout, "native_op": False}}


def _sp_token_losses(engine, shard: dict) -> torch.Tensor:
    """Per-token losses of the whole sequence from this rank's logits, gathered (the same on every rank)."""
    import torch.nn.functional as F

    import ds_usp

    seq = int(shard["cu_seq_lens_q"][-1]) // shard["input_ids"].shape[0]
    with torch.no_grad():
        logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                        cu_seq_lens_q=shard["cu_seq_lens_q"], cu_seq_lens_k=shard["cu_seq_lens_k"]).logits
    labels = shard["shift_labels"]
    losses = F.cross_entropy(logits[0].float(), labels[0].clamp_min(0), reduction="none") * (labels[0] >= 0)
    topo = engine.usp.topo
    return ds_usp.gather_sequence(losses[None, :, None], topo, dim=1, layout=engine.usp.layout, seq_len=seq,
                                  doc_lens=_shard_docs(shard))[0, :, 0]


def _shard_docs(shard: dict):
    from ds_usp.integration.data.batch import docs_from_cu_seq_lens

    _, docs = docs_from_cu_seq_lens(shard["cu_seq_lens_q"], 1)
    return None if len(docs[0]) == 1 else docs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def train_family(family: str, regime: str, u: int = 2, r: int = 2, packed: bool = False,
                 router: bool = False) -> dict:
    """On every rank: the family through ds_usp.initialize and the reference in this process; the differences."""
    import deepspeed
    import torch.distributed as dist

    import ds_usp

    ref, model = _models(family, regime)
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(u, r))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    kwargs = {"output_router_logits": True} if router else {}
    report = {"token": [], "loss": [], "grad": {}, "aux": []}
    for step in range(1 if regime == "features" else STEPS):
        batch = _batch(step, packed)
        want_tokens, want_loss, outs = _reference_token_losses(ref, batch, family in ROW_REFERENCE, **kwargs)
        shard = ds_usp.shard_batch(batch, engine.usp.topo, layout=engine.usp.layout)
        got_tokens = _sp_token_losses(engine, shard)
        report["token"].append(float((got_tokens - want_tokens.detach()).abs().max()))
        out = engine(**shard, **kwargs)
        if router:  # one document: the reference's own router loss of the whole sequence
            want_aux = outs[0].aux_loss
            report["aux"].append(abs(float(out.aux_loss) - float(want_aux)) / abs(float(want_aux)))
            want_loss = want_loss + ref.router_aux_loss_coef * want_aux
        report["loss"].append(abs(float(out.loss) - float(want_loss)) / abs(float(want_loss)))
        opt.zero_grad()
        want_loss.backward()
        engine.backward(out.loss)
        if step == 0:
            for (name, p), (_, q) in zip(ref.named_parameters(), engine.module.named_parameters()):
                full = deepspeed.utils.safe_get_full_grad(q)
                if p.grad is not None and p.grad.norm() > 0:
                    report["grad"][name] = _rel(full, p.grad)
        opt.step()
        engine.step()
    dist.barrier()
    return report


def _check(report: dict, what: str) -> None:
    assert max(report["token"]) < LOSS_TOL["atol"], f"{what}: per-token loss errors {report['token']}"
    assert max(report["loss"]) < 1e-5, f"{what}: SP loss relative errors {report['loss']}"
    bad = {n: e for n, e in report["grad"].items() if not e < GRAD_REL}
    assert report["grad"] and not bad, f"{what}: gradients off (relative): {bad}"
    if report["aux"]:
        assert max(report["aux"]) < 1e-5, f"{what}: router loss relative errors {report['aux']}"


@pytest.mark.parametrize("regime", ["features", "usual"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_exact_2x2(world4, family, regime):
    report = world4.run(train_family, family, regime)[0]
    _check(report, f"{family} ({regime}, 2x2 zigzag, S={SEQ})")


@pytest.mark.parametrize("family", SPECIAL)
def test_special_families_packed_and_ring(world4, family):
    _check(world4.run(train_family, family, "features", packed=True)[0], f"{family} packed 2x2")
    _check(world4.run(train_family, family, "features", 1, 4)[0], f"{family} 1x4")


@pytest.mark.parametrize("family", MOE)
def test_router_loss_is_the_whole_sequence(world4, family):
    report = world4.run(train_family, family, "features", router=True)[0]
    assert report["aux"], "no router loss"
    _check(report, f"{family} router loss")


def test_reference_variants_agree():
    """The bound of the usual regime: where a family's sdpa differs from its eager attention, by less than 1e-4."""
    from transformers import AutoModelForCausalLM

    for family in ("llama", "qwen2", "mistral", "gemma"):  # families with both (gemma2 / gpt_oss have no sdpa)
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(_config(family, "usual"), attn_implementation="eager")
        sdpa = AutoModelForCausalLM.from_config(_config(family, "usual"), attn_implementation="sdpa")
        sdpa.load_state_dict(eager.state_dict())
        batch = _batch(0, False)
        drift = (_reference_token_losses(eager, batch)[0] - _reference_token_losses(sdpa, batch)[0]).abs().max()
        assert drift < LOSS_TOL["atol"], f"{family}: eager vs sdpa per-token drift {float(drift):.2e}"


EXPECTED_TAIL = {"gemma2": (1.0, 3.0), "gemma3_text": (1.0, 3.0), "granite": (0.25, 0.0), "cohere": (0.0625, 0.0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_logits_tail_is_found_in_every_training_dtype(dtype):
    """The probe of what a model applies after lm_head runs in the model's own dtype: a bf16 or fp16 model is
    not refused for a tail it does not have, and the tails that exist are found."""
    from transformers import AutoModelForCausalLM

    from ds_usp.integration.step.forward import decoder_of
    from ds_usp.integration.step.tail import find_logits_tail

    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(family, "features"), dtype=dtype)
        tail = find_logits_tail(model, model.forward, decoder_of(model), model.get_output_embeddings())
        assert tail is not None, f"{family} in {dtype}: no tail found"
        assert (tail.scale, tail.softcap) == EXPECTED_TAIL.get(family, (1.0, 0.0)), (family, dtype, tail)


def test_non_interface_families_are_refused_by_name():
    import transformers

    import ds_usp

    ds_usp.hf.register_usp_attention()
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    with pytest.raises(ValueError, match="FalconForCausalLM computes attention in its own code"):
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="usp")
    built_with_sdpa = transformers.AutoModelForCausalLM.from_config(_config("llama", "usual"),
                                                                    attn_implementation="sdpa")
    from ds_usp.integration.models.checks import check_model

    with pytest.raises(ValueError, match="LlamaForCausalLM was built with attn_implementation='sdpa'"):
        check_model(built_with_sdpa)
    bart = transformers.AutoModelForCausalLM.from_config(transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, decoder_layers=1, encoder_layers=1, decoder_attention_heads=4,
        encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64), attn_implementation="usp")
    with pytest.raises(ValueError, match="BartForCausalLM.forward takes no position_ids"):
        check_model(bart)  # its decoder numbers the tokens it gets from 0: each rank would restart at 0


def test_every_interface_keyword_is_classified():
    """Walk every modeling file of the installed transformers: each keyword an attention module passes to the
    attention interface is honoured, neutral or refused by name (an unclassified one would still be refused at
    run time when not None; this makes the decision explicit)."""
    import transformers

    from ds_usp.integration.models.attention import HONOURED, NEUTRAL, REFUSED

    known = set(HONOURED) | set(NEUTRAL) | set(REFUSED) | {"query", "key", "value", "attention_mask"}
    seen: dict[str, set] = {}
    for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        source = path.read_text()
        if "attention_interface(" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "attention_interface":
                for kw in node.keywords:
                    if kw.arg is not None:
                        seen.setdefault(kw.arg, set()).add(path.parent.name)
    assert {"softcap", "s_aux", "sliding_window", "scaling"} <= set(seen), sorted(seen)  # the walk found them
    unknown = {k: sorted(v)[:5] for k, v in seen.items() if k not in known}
    assert not unknown, f"keywords ds-usp neither honours nor refuses: {unknown}"


def test_unknown_keywords_are_refused():
    from torch import nn

    from ds_usp.integration.models.attention import USPContext, check_keywords

    ctx = USPContext(topo=None, layout="zigzag", model_name="SomeForCausalLM")
    check_keywords(nn.Linear(1, 1), ctx, {"position_ids": torch.zeros(1), "use_cache": True, "new_thing": None})
    with pytest.raises(ValueError, match=r"SomeForCausalLM \(Linear\) passes new_thing=3 .*does not know"):
        check_keywords(nn.Linear(1, 1), ctx, {"new_thing": 3})
    with pytest.raises(ValueError, match="position_bias=a Tensor .*additive"):
        check_keywords(nn.Linear(1, 1), ctx, {"position_bias": torch.zeros(1)})


def test_models_doc_lists_the_tested_families():
    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|", text, flags=re.M))
    assert set(rows) == set(FAMILIES) | set(REFUSED), sorted(set(rows) ^ (set(FAMILIES) | set(REFUSED)))
    for family in REFUSED:
        assert "refused" in rows[family]
    assert json.dumps(sorted(FAMILIES))  # the table is checked against this module's list


def test_masks_are_read_from_transformers_mask_functions():
    """The "usp" mask interface reads what each transformers mask creator asks for (no (s x s) tensor), and the
    attention refuses a mask part it does not implement, an is_causal or sliding_window that disagrees with the
    mask, instead of computing a plain causal mask."""
    import transformers
    from torch import nn
    from transformers import masking_utils as mu

    import ds_usp
    from ds_usp.integration.models.attention import USPContext, _mask_of
    from ds_usp.integration.models.masks import HFMask

    ds_usp.hf.register_usp_attention()
    cfg = transformers.Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, sliding_window=16,
                                        attention_chunk_size=8)
    cfg._attn_implementation = "usp"
    x = torch.zeros(1, 12, 64)
    packed = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    args = dict(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None)
    assert mu.create_causal_mask(**args) == HFMask(causal=True)
    assert mu.create_causal_mask(**args, position_ids=packed) == HFMask(causal=True)  # documents come as cu_seq_lens
    end_padding = torch.tensor([[1] * 10 + [0] * 2])
    assert mu.create_causal_mask(**{**args, "attention_mask": end_padding}) == HFMask(causal=True)
    assert mu.create_sliding_window_causal_mask(**args) == HFMask(causal=True, window=16)
    assert mu.create_chunked_causal_mask(**args, position_ids=packed) == HFMask(causal=True, chunk=8)
    assert mu.create_bidirectional_mask(config=cfg, inputs_embeds=x, attention_mask=None) == HFMask(causal=False)
    ids = torch.tensor([[-1, 0, 0, 0, -1, -1, 1, 1, -1, 2, 2, 2]])  # three image blocks
    image_blocks = mu.create_causal_mask(**args, block_sequence_ids=ids)
    assert image_blocks == HFMask(causal=True, spans=(((1, 4), (6, 8), (9, 12)),)), image_blocks
    windowed = mu.create_causal_mask(**args, or_mask_function=mu.blockwise_overlay(ids),
                                     and_mask_function=mu.sliding_window_overlay(5))  # Gemma 3's sliding layers
    assert windowed == HFMask(causal=True, window=5, spans=image_blocks.spans), windowed
    short = mu.create_sliding_window_causal_mask(**args, block_sequence_ids=ids)  # PaliGemma 2: or(window, blocks)
    assert short == HFMask(causal=True, window=16, spans=image_blocks.spans), short  # blocks within the window
    long_block = torch.tensor([[-1] + [0] * 10 + [-1]])
    cfg.sliding_window = 8
    unbounded = mu.create_sliding_window_causal_mask(**args, block_sequence_ids=long_block)
    assert unbounded.unsupported == ("bidirectional blocks or-ed onto a sliding window of 8 tokens, one of them 10 "
                                     "tokens long",), unbounded
    cfg.sliding_window = 16
    torn = mu.create_causal_mask(**args, block_sequence_ids=torch.tensor([[0, 0, -1] * 4]))
    assert torn.unsupported and "a block in two pieces" in torn.unsupported[0], torn
    anything = mu.create_causal_mask(**args, or_mask_function=lambda b, h, q, k: k > q + 100)
    assert anything.unsupported and "or_masks(" in anything.unsupported[0], anything
    custom = mu.create_causal_mask(**args, and_mask_function=lambda b, h, q, k: k > q - 3)
    assert custom.unsupported and "test_models" in custom.unsupported[0], custom
    both = mu.create_bidirectional_sliding_window_mask(config=cfg, inputs_embeds=x, attention_mask=None)
    assert both == HFMask(causal=False, both_sides=16), both

    layer, ctx = nn.Linear(1, 1), USPContext(topo=None, layout="zigzag", model_name="SomeForCausalLM")
    assert _mask_of(layer, ctx, HFMask(causal=True, window=16), None, 16) == (True, (15, 0), None)
    assert _mask_of(layer, ctx, HFMask(causal=True, chunk=8), True, None) == (True, None, 8)
    assert _mask_of(layer, ctx, HFMask(causal=False, both_sides=4), None, None) == (False, (4, 4), None)
    assert _mask_of(layer, ctx, None, None, 16) == (True, (15, 0), None)  # no mask built: the arguments alone
    with pytest.raises(ValueError, match=r"SomeForCausalLM \(Linear\) passes attention_mask=.*or_masks"):
        _mask_of(layer, ctx, anything, None, None)
    with pytest.raises(ValueError, match="passes sliding_window=16 .*its mask has no window"):
        _mask_of(layer, ctx, HFMask(causal=True), None, 16)
    with pytest.raises(ValueError, match="passes is_causal=True .*its mask is bidirectional"):
        _mask_of(layer, ctx, HFMask(causal=False), True, None)
    with pytest.raises(AttributeError, match=r"reads its attention mask as a tensor \(mask.dtype\)"):
        HFMask().dtype


# ---- breadth: more families, one forward at 2 x 2 against their eager attention --------------------------------------

MORE = ("axk1", "bamba", "bitnet", "cohere2", "deepseek_v2", "ernie4_5_moe", "exaone4", "flint", "gemma3n_text",
        "gemma4_text", "glm4_moe", "glm4_moe_lite", "gpt2", "granitemoe", "granitemoehybrid", "helium", "hunyuan_v1_moe",
        "hy_v3", "falcon_h1", "falcon_mamba", "laguna", "lfm2_moe", "mamba", "mamba2", "mimo_v2_flash", "minicpm3", "minimax_m2", "ministral3", "olmo3", "olmoe", "opt",
        "phimoe", "qwen2_moe", "roberta", "seed_oss", "vaultgemma", "xlm-roberta", "youtu", "zamba2")
# axk1, deepseek_v2, glm4_moe_lite, minicpm3, youtu: MLA variants; opt: learned positions, offset 2; bamba,
# granitemoehybrid, zamba2: Mamba-2 hybrids (Nemotron-H is trained in test_linear.py); mamba2: no attention at all;
# roberta, xlm-roberta: positions from padding_idx + 1 around padding tokens (ds_usp.shard_batch numbers them);
# falcon_h1: Mamba-2 with muP multipliers (none of them 1) and the gated norm, below also without it; mamba,
# falcon_mamba (its dt/B/C norms): Mamba-1, no attention; lfm2_moe: short convolutions (Jamba, LFM2 train in
# test_linear.py)
VARIANTS = {"falcon_h1 without the gated norm": ("falcon_h1", {"mamba_rms_norm": False})}


def forward_more_families() -> dict:
    """On every rank: each family of MORE, tiny (benchmarks/family_sweep.py's config: 4 layers, a 16-token window
    where it has one), one forward of the usp model at 2 x 2 zigzag, S = 67, against the same weights with eager
    attention over the whole sequence; the largest logit error relative to the largest logit, per family."""
    from family_sweep import forward_error, reference_logits

    topo = get_topo(2, 2)
    cases = {**{family: (family, {}) for family in MORE}, **VARIANTS}
    return {name: forward_error(topo, reference_logits(family, **overrides)) for name, (family, overrides) in cases.items()}


def test_more_families_forward_exact_2x2(world4):
    errors = world4.run(forward_more_families)[0]
    bad = {family: e for family, e in errors.items() if not e < 1e-4}
    assert set(errors) == set(MORE) | set(VARIANTS) and not bad, f"logits off (relative): {bad}"


def test_default_positions_follow_the_model():
    """RoBERTa-style embeddings number real tokens from padding_idx + 1 around padding tokens: ds_usp.initialize
    hands that rule to shard_batch (topo.default_positions); a rotary model keeps 0..S-1 (no rule)."""
    from transformers import LlamaConfig, LlamaForCausalLM, RobertaConfig, RobertaForCausalLM

    from ds_usp.integration.models.checks import default_positions

    tiny = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    roberta = RobertaForCausalLM(RobertaConfig(**tiny, is_decoder=True, pad_token_id=1))
    ids = torch.tensor([[5, 6, 1, 7, 8, 1, 9]])
    assert default_positions(roberta)(ids).tolist() == [[2, 3, 1, 4, 5, 1, 6]]
    assert default_positions(LlamaForCausalLM(LlamaConfig(**tiny))) is None
