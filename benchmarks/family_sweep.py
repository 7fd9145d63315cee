"""Which transformers causal-LM families ds-usp runs exactly, which it refuses by name, and which fail otherwise.

    python benchmarks/family_sweep.py                          # every causal-LM family of the installed transformers
    python benchmarks/family_sweep.py --families llama4_text,olmo3 --json family_sweep.json

Each family runs in its own 2-process gloo world (a 1 x 2 ring, zigzag, S = 67): a tiny config (the keys of
:data:`SMALL` the family's config has, :data:`MLA`'s for latent-attention families, per-layer type lists cut to
4 layers with each kind once, a 16-token window and chunk where it has them), the same weights with eager
attention over the whole sequence in each process and with ``attn_implementation="usp"`` on the shards; one
forward, the largest logit error relative to the largest logit. Verdicts: ``exact`` (< 1e-4), ``MISMATCH``,
``refused`` (a ``ValueError``, or an error naming ds-usp, that says what ds-usp does not support; or transformers
cannot build the model with the ``"usp"`` attention at all), ``config`` (the tiny config does not build or run even
with eager attention: not checked), ``error`` (anything else, a defect to look at) and ``timeout``.
A correctness sweep, not a timing: it needs no idle machine. ``tests/test_models.py`` runs :func:`forward_error`
on a fixed list of families at 2 x 2 in CI.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from _common import add_job_flags, base_parser, run_as_job, save_results, start_ranks, table

SEQ, VOCAB, ATTN = 67, 128, "usp"
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=16, max_position_embeddings=256, sliding_window=16,
             attention_chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0,
             initializer_range=0.1, moe_intermediate_size=32, n_routed_experts=4, num_experts=4, num_local_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32, first_k_dense_replace=1,
             n_group=1, topk_group=1, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, n_embd=64,
             n_layer=4, n_head=4, n_positions=256, n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, moe_topk=2, intermediate_size_mlp=128,
             floor_scale=8, rotary_dim=8, linear_num_heads=4, linear_head_dim=16, num_experts_per_token=2,
             d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
             decoder_ffn_dim=128, encoder_ffn_dim=128)  # the last: BART-style decoders (BlenderBot, Pegasus...)
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16,
           head_dim=8, num_key_value_heads=4, index_topk=16, index_head_dim=16, index_n_heads=2)  # latent attention
PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types", "layers_block_type")  # lists of one entry per layer
SPECIFIC = {"gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                                 intermediate_size=[128] * 4, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
                                 laurel_rank=8),
            "lfm2": dict(layer_types=["conv", "full_attention"] * 2),  # the default 4 layers are all attention
            "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2),
            "mamba2": dict(num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, chunk_size=16),
            # Mamba-2 hybrids: 8 heads of 16 in 2 groups, 16-token scan chunks, attention layers among them
            "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                               layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention"]),
            "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16,
                          attn_layer_indices=[1, 3]),
            "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                                     mamba_chunk_size=16, layer_types=["linear_attention", "full_attention"] * 2),
            "zamba2": dict(n_mamba_heads=8, mamba_headdim=16, mamba_d_state=16, mamba_ngroups=2, chunk_size=16),
            # Falcon-H1: Mamba-2 with muP multipliers everywhere (not 1, so that a dropped one shows), the gated norm
            "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=2,
                              mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=False,
                              ssm_in_multiplier=0.5, ssm_multipliers=[0.7, 1.3, 0.9, 1.1, 0.8], key_multiplier=0.6,
                              attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_out_multiplier=1.1,
                              mlp_multipliers=[0.8, 1.2], embedding_multiplier=2.0, lm_head_multiplier=0.5),
            "longcat_flash": dict(ffn_hidden_size=128, expert_ffn_hidden_size=32, zero_expert_num=2),
            "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}}),
            "dbrx": dict(d_model=64, n_heads=4, n_layers=4, max_seq_len=256,
                         attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                         ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2})}


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny config of ``family`` (a transformers model type): the keys of :data:`SMALL` its config has, then
    :data:`SPECIFIC`'s and ``overrides``."""
    from transformers import AutoConfig

    kwargs = _small(AutoConfig.for_model(family).to_dict())
    return AutoConfig.for_model(family, **{**kwargs, **SPECIFIC.get(family, {}), **overrides})


def _small(defaults: dict) -> dict:
    """The keys of :data:`SMALL` (and :data:`MLA`'s, :data:`PER_LAYER`'s) that a config's ``defaults`` have, and the
    same for each of its sub-configs (a VLM's ``text_config`` and ``vision_config``: a composite family would
    otherwise be built at full size)."""
    mla = {k: v for k, v in MLA.items() if defaults.get(k) is not None} if defaults.get("kv_lora_rank") else {}
    kwargs = {k: v for k, v in {**SMALL, **mla}.items() if k in defaults}
    layers = kwargs.get("num_hidden_layers", 4)
    full = defaults.get("num_hidden_layers")
    for key, kinds in defaults.items():  # a list of one entry per layer of the full-size model (PER_LAYER's, or
        # any list as long as its layers): each kind of layer once, then its own order
        if isinstance(kinds, list) and len(kinds) > layers and (key in PER_LAYER or len(kinds) == full):
            kwargs[key] = (list(dict.fromkeys(kinds)) + kinds)[:layers] if all(
                isinstance(k, (str, int, float, bool)) for k in kinds) else kinds[:layers]
        elif isinstance(kinds, dict) and kinds and all(str(k).isdigit() for k in kinds):  # {layer index: ...}
            kwargs[key] = {k: v for k, v in kinds.items() if int(k) < layers}
    for key, sub in defaults.items():
        if key.endswith("_config") and isinstance(sub, dict) and "model_type" in sub:
            kwargs[key] = {**sub, **_small(sub)}
    return kwargs


def reference_logits(family: str, **overrides: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(eager model, input ids (1, SEQ), its logits)`` of the tiny ``family`` (seed 0 weights, config
    :func:`tiny_config` with ``overrides``); the ids hold the padding token twice where the config names one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager").eval()
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    pad = getattr(ref.config, "pad_token_id", None)
    if isinstance(pad, int) and 0 <= pad < VOCAB:
        ids[0, [5, 40]] = pad  # padding tokens inside the row: RoBERTa-style models number around them
    with torch.no_grad():
        return ref, ids, ref(input_ids=ids, use_cache=False).logits


def forward_error(topo: Any, reference: tuple[Any, torch.Tensor, torch.Tensor]) -> float:
    """On every rank of ``topo``'s world: the ``"usp"`` model's logits on this rank's shard against the reference's
    (:func:`reference_logits`; the same config and weights), the largest error relative to the largest logit, the
    maximum over the ranks."""
    import torch.distributed as dist

    import ds_usp
    from ds_usp.integration.models.attention import USPContext, attach
    from ds_usp.integration.models.hybrid import is_wrapped_mixer, wrap_linear_layers
    from ds_usp.integration.models.checks import check_model, default_positions

    ds_usp.hf.register_usp_attention()
    ref, ids, want = reference
    sp = type(ref)._from_config(copy.deepcopy(ref.config), attn_implementation="usp").eval()
    sp.load_state_dict(ref.state_dict())
    check_model(sp, handled=is_wrapped_mixer)  # what ds_usp.initialize refuses, and the layers it wraps
    attach(sp, USPContext(topo=topo, layout="zigzag"))
    wrap_linear_layers(sp)
    topo = dataclasses.replace(topo, default_positions=default_positions(sp))  # as ds_usp.initialize sets it
    shard = ds_usp.shard_batch({"input_ids": ids}, topo)
    with torch.no_grad():
        got = sp(**{k: shard[k] for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")},
                 use_cache=False).logits
    real = shard["attention_mask"][0].bool()  # the shard's end padding is not compared
    err = (got - ds_usp.shard_sequence(want, topo))[:, real].abs().max() if real.any() else torch.zeros(())
    err = (err / want.abs().max()).reshape(1).float()
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return float(err)


def run(args: argparse.Namespace) -> dict:
    """One rank of a family's 2-rank job (``--role FAMILY``): the family's verdict, on rank 0 (the others: nothing)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from ds_usp.topology import USPTopology

    family = args.role
    topo = USPTopology.build(1, 2)
    try:
        reference = reference_logits(family)
    except Exception as e:  # noqa: BLE001 - the family's own eager model fails on this tiny config
        verdict = ("config", f"{type(e).__name__}: {e}")
    else:
        try:
            err = forward_error(topo, reference)
            verdict = ("exact" if err < 1e-4 else "MISMATCH", f"{err:.2e}")
        except KeyError as e:  # transformers' own table of attention classes has no "usp" (GIT): it cannot be built
            verdict = ("refused", f"transformers cannot build it with attn_implementation='usp': KeyError {e}") \
                if str(e) == repr(ATTN) else ("error", f"KeyError: {e} | {traceback.format_exc(limit=-2)}")
        except Exception as e:  # noqa: BLE001 - a refusal names ds-usp; anything else is a defect to look at
            named = isinstance(e, ValueError) or "ds-usp" in str(e)
            verdict = ("refused", str(e)) if named else \
                ("error", f"{type(e).__name__}: {e} | {traceback.format_exc(limit=-2)}")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"verdict": verdict} if rank == 0 else {}


def sweep_one(family: str, timeout: float) -> tuple[str, str]:
    """The verdict of one family, from a fresh 2-process world (killed after ``timeout`` seconds)."""
    with tempfile.TemporaryDirectory(prefix="family_sweep_") as scratch:
        out = Path(scratch) / "verdict.json"
        try:
            done = start_ranks(__file__, ["--role", family, "--out", out], 2, timeout=timeout, capture=True,
                               echo=False)
        except subprocess.TimeoutExpired:
            return ("timeout", f"no verdict within {timeout:.0f} s")
        if not out.exists():  # a crash before the verdict
            lines = (done.stdout + done.stderr).strip().splitlines()
            return ("error", f"exit {done.returncode}, no verdict: {lines[-1] if lines else '?'}")
        return tuple(json.loads(out.read_text())["verdict"])


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = base_parser(__doc__, timeout=150.0)  # here: seconds per family
    p.add_argument("--families", default="", help="comma-separated model types (default: every causal-LM family)")
    add_job_flags(p)
    args = p.parse_args()
    if run_as_job(args, run):
        return
    families = [f for f in args.families.split(",") if f] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = []
    for family in families:
        verdict, detail = sweep_one(family, args.timeout)
        rows.append({"family": family, "verdict": verdict, "detail": detail[:300]})
        print(f"{family:28s} {verdict:8s} {detail[:150]}", flush=True)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in sorted({r["verdict"] for r in rows})}
    print(table([{"verdict": v, "families": n} for v, n in counts.items()]))
    save_results(args.json, {k: v for k, v in vars(args).items() if k not in ("role", "out")}, rows)


if __name__ == "__main__":
    sys.exit(main())
