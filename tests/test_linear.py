"""Hybrid linear attention under USP (Gated DeltaNet: Qwen3.5, Qwen3-Next): exact, or refused by name.

* The state-passing pieces alone, in one process, fp64, against the sequential recurrence: any cut of a sequence
  into segments (document starts included, down to one-token documents and segments shorter than the
  convolution), run in any order from zero, combined by their transitions, equal the recurrence run once per
  document (hypothesis property test).
* The distributed algorithm (:func:`ds_usp.linear.gated_delta_attention`), fp64, on 4 ranks: 4x1 (key heads
  replicated over the Ulysses group), 2x2 zigzag, 1x4 contiguous / zigzag / balanced, packed documents, odd
  lengths: outputs and every input's gradient within 1e-12 of the single-process recurrence.
* One HF Gated DeltaNet layer of each family, fp64 (the family's delta rule replaced by an fp64 one in both runs):
  the wrapped layer under 4x1, 2x2 and 1x4 equals the layer's own forward and backward within 1e-10 (``A_log``:
  1e-6, its gradient is fp32 in the layer itself).
* Tiny random Qwen3.5-text and Qwen3-Next models (transformers' own fp32 kernels, nothing downloaded) through
  ``ds_usp.initialize`` for 3 AdamW steps at 4x1, 2x2 zigzag, 1x4 contiguous and zigzag, and packed documents, odd
  S: per-token losses within 1e-4 of one process each step. Gradients of the first step: every parameter within
  1e-4 relative, or within 3x the drift of the single-process gradient between two chunk sizes of the family's own
  fp32 kernel, whichever is larger (the decay parameters of a layer whose gradient cancels to small values drift
  by up to 6e-2 between chunk sizes 64 and 16 in one process: fp32, not the split).
* Other linear-attention and state-space families are refused by name before any step.
"""
from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_harness import get_topo, reference
from test_models import _sp_token_losses

WORLD_TIMEOUT = 600
K = 4  # convolution kernel


def recurrent_rule(q, k, v, g, beta, state):
    """The gated delta rule token by token, in the inputs' dtype (fp64 here): l2-normed q/k, q scaled by dk^-0.5,
    key heads repeated over their value heads, as transformers' kernels do; ``g`` one log decay per head (Gated
    DeltaNet) or per key channel (``(b, t, nv, dk)``: KDA)."""
    b, t, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    q, k = q.repeat_interleave(nv // nk, 2), k.repeat_interleave(nv // nk, 2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = torch.zeros(b, nv, dk, dv, dtype=q.dtype) if state is None else state.to(q.dtype)
    outs = []
    for i in range(t):
        decay = g[:, i].exp()
        s = s * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        delta = (v[:, i] - (s * k[:, i][..., None]).sum(-2)) * beta[:, i][..., None]
        s = s + k[:, i][..., None] * delta[..., None, :]
        outs.append((s * q[:, i][..., None]).sum(-2))
    return torch.stack(outs, 1), s


def _inputs(seq: int, nk: int, nv: int, dk: int, dv: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, nk, dk, generator=gen, dtype=dtype)
    k = torch.randn(1, seq, nk, dk, generator=gen, dtype=dtype)
    v = torch.randn(1, seq, nv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(1, seq, nv, generator=gen, dtype=dtype)
    beta = torch.rand(1, seq, nv, generator=gen, dtype=dtype)
    w = torch.randn(2 * nk * dk + nv * dv, K, generator=gen, dtype=dtype) * 0.5
    return q, k, v, g, beta, w


def _reference(q, k, v, g, beta, w, docs):
    """Convolution and recurrence over each document from zero, the whole sequence in one process."""
    nk, dk, nv, dv = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    outs, start = [], 0
    for n in docs:
        x = torch.cat([t[:, start:start + n].flatten(2) for t in (q, k, v)], -1)  # (1, n, C)
        y = F.silu(F.conv1d(x.transpose(1, 2), w.unsqueeze(1), None, padding=K - 1, groups=w.shape[0])[..., :n])
        qq, kk, vv = y.transpose(1, 2).split([nk * dk, nk * dk, nv * dv], -1)
        out, _ = recurrent_rule(qq.unflatten(-1, (nk, dk)), kk.unflatten(-1, (nk, dk)), vv.unflatten(-1, (nv, dv)),
                                g[:, start:start + n], beta[:, start:start + n], None)
        outs.append(out)
        start += n
    return torch.cat(outs, 1)


# ---------------------------------------------------------------------------------- one process, fp64


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(st.integers(1, 9), min_size=1, max_size=4), cuts=st.lists(st.integers(1, 30), max_size=6),
       seed=st.integers(0, 99))
def test_segments_combine_to_the_recurrence(docs, cuts, seed):
    """Cut the sequence anywhere (besides document starts), run every segment from zero, combine: exact."""
    from ds_usp.linear.delta import causal_conv, halo_of, initial_states, run_segment, segments, with_initial_state

    seq = sum(docs)
    nk, nv, dk, dv = 1, 2, 3, 2
    q, k, v, g, beta, w = _inputs(seq, nk, nv, dk, dv, seed)
    want = _reference(q, k, v, g, beta, w, docs)
    starts = tuple(sum(docs[:i]) for i in range(len(docs)))
    bounds = sorted({0, seq} | {c for c in cuts if c < seq})
    runs = tuple((a, b - a) for a, b in zip(bounds, bounds[1:]))
    segs = segments(runs, starts, seq)
    x = torch.cat([t.flatten(2) for t in (q, k, v)], -1)
    results, tails = [], []
    for i, seg in enumerate(segs):
        earlier = [] if seg.first else list(tails)
        halo = halo_of(earlier, K) if earlier else x.new_zeros(1, K - 1, x.shape[2])
        y = causal_conv(x[:, seg.start:seg.stop], w, None, halo, F.silu)
        qq, kk, vv = y.split([nk * dk, nk * dk, nv * dv], -1)
        following = i + 1 < len(segs) and not segs[i + 1].first
        results.append(run_segment(recurrent_rule, qq.unflatten(-1, (nk, dk)), kk.unflatten(-1, (nk, dk)),
                                   vv.unflatten(-1, (nv, dv)), g[:, seg.start:seg.stop], beta[:, seg.start:seg.stop],
                                   affine=not seg.first or following))
        tail = x[:, max(seg.start, seg.stop - K + 1):seg.stop]
        tails = ([] if seg.first else tails) + [(seg.first, F.pad(tail, (0, 0, K - 1 - tail.shape[1], 0)),
                                                 seg.length)]
    chain = [(seg.first, run.transition, run.final) for seg, run in zip(segs, results)]
    got = torch.cat([with_initial_state(run, s0) for run, s0 in zip(results, initial_states(chain))], 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_response_and_transition_are_the_affine_map():
    """run_segment's one augmented call: from any S0, outputs = out + response @ S0, final = transition @ S0 + final."""
    from ds_usp.linear.delta import run_segment

    q, k, v, g, beta, _ = _inputs(7, 2, 4, 3, 5, 1)
    s0 = torch.randn(1, 4, 3, 5, dtype=torch.float64)
    want_out, want_final = recurrent_rule(q, k, v, g, beta, s0)
    run = run_segment(recurrent_rule, q, k, v, g, beta, affine=True)
    torch.testing.assert_close(run.out + torch.einsum("btnk,bnkv->btnv", run.response, s0), want_out)
    torch.testing.assert_close(run.transition @ s0 + run.final, want_final)


# ------------------------------------------------------------------------------------ 4 ranks, fp64

SPLITS = [(4, 1, "zigzag", 37, None), (2, 2, "zigzag", 37, None), (1, 4, "contiguous", 37, None),
          (1, 4, "zigzag", 45, None), (2, 2, "zigzag", 37, [10, 2, 25]), (1, 4, "balanced", 37, [10, 2, 25]),
          (1, 4, "zigzag", 45, [1, 1, 1, 40, 2])]


def distributed_case(u: int, r: int, layout: str, seq: int, docs) -> list[float]:
    """On every rank: gated_delta_attention on shards vs the single-process recurrence; the max differences."""
    import ds_usp
    from ds_usp.linear import gated_delta_attention

    topo = get_topo(u, r)
    nk, nv, dk, dv = 2, 4, 4, 3
    q, k, v, g, beta, w = _inputs(seq, nk, nv, dk, dv, seed=seq + u)
    dout = torch.randn(1, seq, nv, dv, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, w)]
    _reference(*leaves, docs or [seq]).backward(dout)
    shard = functools.partial(ds_usp.shard_sequence, topo=topo, dim=1, layout=layout, doc_lens=docs)
    local = [shard(t).requires_grad_() for t in (q, k, v, g, beta)]
    w_local = w.clone().requires_grad_()
    out = gated_delta_attention(*local, w_local, None, topo, recurrent_rule, F.silu, layout=layout, seq_len=seq,
                                doc_lens=docs, native_op=False)
    out.backward(shard(dout))
    gather = functools.partial(ds_usp.gather_sequence, topo=topo, dim=1, layout=layout, seq_len=seq, doc_lens=docs)
    want = _reference(*(t.detach() for t in leaves[:5]), leaves[5].detach(), docs or [seq])
    errors = [float((gather(out.detach()) - want).abs().max())]
    errors += [float((gather(a.grad) - b.grad).abs().max()) for a, b in zip(local, leaves)]
    dw = w_local.grad.clone()
    torch.distributed.all_reduce(dw, group=topo.sp_group)  # what DeepSpeed sums over the ranks
    return errors + [float((dw - leaves[5].grad).abs().max())]


def test_distributed_state_passing_is_exact(world4):
    for case in SPLITS:
        errors = world4.run(distributed_case, *case)[0]
        assert max(errors) < 1e-12, f"{case}: out, dq, dk, dv, dg, dbeta, dw errors {errors}"


def _row_docs(docs, seq: int, batch: int) -> list:
    """Each row's document lengths (``docs``: None, one list for every row, or one list per row)."""
    if docs and isinstance(docs[0], list):
        return docs
    return [docs or [seq]] * batch


def conv_case(u: int, r: int, layout: str, seq: int, docs, kernel: int) -> list[float]:
    """On every rank: sharded_causal_conv on shards vs one conv1d per document over the whole sequence; the output,
    input gradient, filter and bias gradient (summed over the ranks) differences."""
    import ds_usp
    from ds_usp.linear.conv import sharded_causal_conv

    topo = get_topo(u, r)
    g = torch.Generator().manual_seed(seq + kernel)
    x, dout = (torch.randn(2, seq, 6, generator=g, dtype=torch.float64) for _ in range(2))
    w, bias = torch.randn(6, kernel, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
    want = torch.cat([torch.cat([F.conv1d(p.transpose(1, 2), leaves[1][:, None], leaves[2], padding=kernel - 1,
                                          groups=6)[..., :p.shape[1]].transpose(1, 2)
                                 for p in torch.split(leaves[0][i:i + 1], lens, dim=1)], dim=1)  # each doc from 0
                      for i, lens in enumerate(_row_docs(docs, seq, 2))])
    F.silu(want).backward(dout)
    shard = functools.partial(ds_usp.shard_sequence, topo=topo, dim=1, layout=layout, doc_lens=docs)
    local, w_local, b_local = shard(x).requires_grad_(), w.clone().requires_grad_(), bias.clone().requires_grad_()
    out = sharded_causal_conv(local, w_local, b_local, topo, layout=layout, seq_len=seq, doc_lens=docs,
                              activation=F.silu)
    out.backward(shard(dout))
    gather = functools.partial(ds_usp.gather_sequence, topo=topo, dim=1, layout=layout, seq_len=seq, doc_lens=docs)
    errors = [float((gather(out.detach()) - F.silu(want.detach())).abs().max()),
              float((gather(local.grad) - leaves[0].grad).abs().max())]
    for mine, ref in ((w_local, leaves[1]), (b_local, leaves[2])):
        grad = mine.grad.clone()
        torch.distributed.all_reduce(grad, group=topo.sp_group)  # what DeepSpeed sums over the ranks
        errors.append(float((grad - ref.grad).abs().max()))
    return errors


def test_sharded_causal_conv_is_exact(world4):
    """Every split and layout, packed documents (some shorter than the filter), filters longer than a run."""
    for u, r, layout, seq, docs in SPLITS + [(2, 2, "zigzag", 9, None), (1, 4, "contiguous", 11, [3, 1, 7]),
                                             (2, 2, "zigzag", 37, [[10, 27], [5, 5, 3, 24]])]:  # per row
        for kernel in (1, 4, 7):
            errors = world4.run(conv_case, u, r, layout, seq, docs, kernel)[0]
            assert max(errors) < 1e-12, f"{(u, r, layout, seq, docs, kernel)}: out, dx, dw, dbias errors {errors}"


def loop_scan(x, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    """Mamba-1's selective scan, one token at a time, in the inputs' dtype (transformers' signature)."""
    dt = dt if delta_bias is None else dt + delta_bias[..., None]
    dt = F.softplus(dt) if delta_softplus else dt
    h, ys = x.new_zeros(*x.shape[:2], A.shape[-1]), []
    for t in range(x.shape[-1]):
        h = torch.exp(dt[..., t, None] * A) * h + (dt[..., t] * x[..., t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1) + (0 if D is None else x * D[:, None])
    return y * F.silu(z) if z is not None else y


def selective_case(u: int, r: int, layout: str, seq: int, docs) -> list[float]:
    """On every rank: sharded_selective_scan on shards vs the scan run once per document; output and gradients."""
    import ds_usp
    from ds_usp.linear.selective import sharded_selective_scan

    topo = get_topo(u, r)
    g = torch.Generator().manual_seed(seq + u)
    d, n = 6, 3
    x, dt, z, dout = (torch.randn(2, d, seq, generator=g, dtype=torch.float64) for _ in range(4))
    B, C = (torch.randn(2, n, seq, generator=g, dtype=torch.float64) for _ in range(2))
    A = -torch.rand(d, n, generator=g, dtype=torch.float64) - 0.1
    D, bias = (torch.randn(d, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (x, dt, B, C, z, A, D, bias)]
    lx, ldt, lB, lC, lz, lA, lD, lbias = leaves
    rows = []
    for i, lens in enumerate(_row_docs(docs, seq, 2)):
        cuts = torch.tensor(lens).cumsum(0).tolist()
        rows.append(torch.cat([loop_scan(*(t[i:i + 1, ..., a:b] for t in (lx, ldt)), lA, lB[i:i + 1, ..., a:b],
                                         lC[i:i + 1, ..., a:b], lD, lz[i:i + 1, ..., a:b], lbias, True)
                               for a, b in zip([0] + cuts[:-1], cuts)], dim=-1))
    want = torch.cat(rows)
    want.backward(dout)
    shard = functools.partial(ds_usp.shard_sequence, topo=topo, dim=2, layout=layout, doc_lens=docs)
    local = [shard(t).requires_grad_() for t in (x, dt, B, C, z)]
    params = [t.clone().requires_grad_() for t in (A, D, bias)]
    out = sharded_selective_scan(loop_scan, local[0], local[1], params[0], local[2], local[3], params[1], local[4],
                                 params[2], True, topo, layout=layout, seq_len=seq, doc_lens=docs)
    out.backward(shard(dout))
    gather = functools.partial(ds_usp.gather_sequence, topo=topo, dim=2, layout=layout, seq_len=seq, doc_lens=docs)
    errors = [float((gather(out.detach()) - want.detach()).abs().max())]
    errors += [float((gather(a.grad) - b.grad).abs().max()) for a, b in zip(local, (lx, ldt, lB, lC, lz))]
    for mine, ref in zip(params, (lA, lD, lbias)):
        grad = mine.grad.clone()
        torch.distributed.all_reduce(grad, group=topo.sp_group)  # what DeepSpeed sums over the ranks
        errors.append(float((grad - ref.grad).abs().max()))
    return errors


def test_sharded_selective_scan_is_exact(world4):
    """Mamba-1's scan: every split and layout, packed documents (one of a single token)."""
    for case in SPLITS + [(2, 2, "zigzag", 37, [[10, 27], [5, 5, 3, 24]]), (1, 4, "balanced", 37, [[37], [36, 1]])]:
        errors = world4.run(selective_case, *case)[0]
        assert max(errors) < 1e-12, f"{case}: out, dx, ddt, dB, dC, dz, dA, dD, dbias errors {errors}"


def recurrence_case(u: int, r: int, layout: str, seq: int, docs) -> list[float]:
    """On every rank: sharded_linear_recurrence on shards (resets as zero decays at the documents' starts) vs the
    recurrence run once over the whole sequence; output and gradients."""
    import ds_usp
    from ds_usp.linear.selective import sharded_linear_recurrence

    def loop(x, a):
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            ys.append(h)
        return torch.stack(ys, dim=1)

    topo = get_topo(u, r)
    g = torch.Generator().manual_seed(seq + 3 * u)
    x, dout = (torch.randn(2, seq, 5, generator=g, dtype=torch.float64) for _ in range(2))
    a = torch.rand(2, seq, 5, generator=g, dtype=torch.float64)
    a[:, torch.tensor(docs or [seq]).cumsum(0)[:-1]] = 0  # a reset at each document start
    leaves = [t.clone().requires_grad_() for t in (x, a)]
    want = loop(*leaves)
    want.backward(dout)
    shard = functools.partial(ds_usp.shard_sequence, topo=topo, dim=1, layout=layout, doc_lens=docs)
    local = [shard(t).requires_grad_() for t in (x, a)]
    out = sharded_linear_recurrence(loop, *local, topo, layout=layout, seq_len=seq, doc_lens=docs)
    out.backward(shard(dout))
    gather = functools.partial(ds_usp.gather_sequence, topo=topo, dim=1, layout=layout, seq_len=seq, doc_lens=docs)
    return [float((gather(out.detach()) - want.detach()).abs().max())] + \
        [float((gather(m.grad) - w.grad).abs().max()) for m, w in zip(local, leaves)]


def test_sharded_linear_recurrence_is_exact(world4):
    """RecurrentGemma's RG-LRU recurrence: every split and layout, resets inside the sequence."""
    for case in SPLITS:
        errors = world4.run(recurrence_case, *case)[0]
        assert max(errors) < 1e-12, f"{case}: out, dx, da errors {errors}"


# ------------ HF layers and models (qwen3_5, qwen3_next, olmo_hybrid; KDA: kimi_linear; Mamba-2: nemotron_h)

FAMILIES = {"qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
            "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
            "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
            "kimi_linear": "transformers.models.kimi_linear.modeling_kimi_linear",
            "nemotron_h": "transformers.models.nemotron_h.modeling_nemotron_h"}
SEQ = 67


# parameters whose gradient the layer itself computes in fp32: A_log's (-A_log.float().exp()), KDA's forget gate
# (its log decays in fp32) and gated norm (fp32 inside); fp32 rounding, scaled by 1e-4 in the fp64 layer test
FP32_INSIDE = {"kimi_linear": ("forget_gate.", "o_norm.")}
RULES = {"kimi_linear": "chunk_kimi_delta_attention", "nemotron_h": "mamba2_chunk_scan"}


def _rule_name(family: str) -> str:
    """The family's chunked rule, a function of its modeling module."""
    return RULES.get(family, "torch_chunk_gated_delta_rule")


def _config(family: str):
    import transformers

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=K,
                layer_types=["linear_attention"] * 3 + ["full_attention"])
    if family == "nemotron_h":  # Mamba-2 mixers (8 heads in 2 groups, 16-token scan chunks), attention, MLP
        return transformers.NemotronHConfig(
            **{k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "max_position_embeddings", "pad_token_id",
                                    "bos_token_id", "eos_token_id")},
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"], mamba_num_heads=8,
            mamba_head_dim=16, ssm_state_size=16, n_groups=2, expand=2, chunk_size=16, conv_kernel=K)
    if family == "kimi_linear":  # KDA (per-channel decays, output gate g_a/g_b), MLA without RoPE, MoE
        return transformers.KimiLinearConfig(
            **{k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "max_position_embeddings", "pad_token_id", "bos_token_id",
                                    "eos_token_id", "layer_types")},
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            mlp_layer_types=["dense"] + ["sparse"] * 3, linear_num_heads=4, linear_head_dim=16,
            linear_conv_kernel_dim=K)
    if family == "lfm2":  # gated short convolutions (bias on) between attention layers, RoPE
        return transformers.Lfm2Config(
            **{k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                    "pad_token_id", "bos_token_id", "eos_token_id")},
            layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=K, conv_bias=True,
            block_auto_adjust_ff_dim=False)
    if family == "jamba":  # Mamba-1 mixers (dt/B/C norms), attention without positions, MoE every other layer
        return transformers.JambaConfig(
            **{k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "pad_token_id", "bos_token_id",
                                    "eos_token_id")},
            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
            num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=K, use_mamba_kernels=False)
    if family == "recurrent_gemma":  # Griffin: RG-LRU blocks (convolution, gated diagonal recurrence), local MQA
        return transformers.RecurrentGemmaConfig(
            **{k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "pad_token_id", "bos_token_id", "eos_token_id")},
            num_key_value_heads=1, head_dim=16, lru_width=64, conv1d_width=K, attention_window_size=16,
            block_types=["recurrent", "attention"])
    if family == "olmo_hybrid":  # separate q/k/v/g/b/a projections, o_norm / o_proj, beta in [0, 2]
        return transformers.OlmoHybridConfig(**{k: v for k, v in base.items() if k != "head_dim"},
                                             linear_allow_neg_eigval=True)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            decoder_sparse_step=1)
    return transformers.Qwen3_5TextConfig(**base, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.5,
                                                                   "mrope_section": [2, 1, 1]})


def _fp64_rule(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
    """The family's rule signature over :func:`recurrent_rule` (fp64)."""
    out, final = recurrent_rule(q, k, v, g, beta, initial_state)
    return out, final if output_final_state else None


def _fp64_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
               dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """mamba2_chunk_scan's signature over the SSD recurrence token by token, in the inputs' dtype (fp64 here)."""
    dt = dt if dt_bias is None else dt + dt_bias
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    b, t, h, p = hidden_states.shape
    B, C = (x.repeat_interleave(h // x.shape[2], 2) for x in (B, C))
    s = torch.zeros(b, h, p, B.shape[-1], dtype=hidden_states.dtype) if initial_states is None else initial_states
    outs = []
    for i in range(t):  # A: one per head
        s = s * (A * dt[:, i]).exp()[..., None, None] + (dt[:, i, :, None] * hidden_states[:, i])[..., None] * \
            B[:, i, :, None, :]
        outs.append((s * C[:, i, :, None, :]).sum(-1))
    out = torch.stack(outs, 1) + (0 if D is None else D[..., None] * hidden_states)
    return (out, s) if return_final_states else out


def _fp64_gated_norm(self, hidden_states, gate=None):
    """The Mamba-2 gated group norm without its fp32 round trip (fp32 rounding would hide what the test checks)."""
    x = hidden_states if gate is None else hidden_states * F.silu(gate)
    x = x.unflatten(-1, (-1, self.group_size))
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)


def layer_case(family: str, u: int, r: int, layout: str, docs, detail: bool = False) -> float:
    """On every rank: one GDN / KDA / Mamba-2 layer in fp64, wrapped vs its own forward on the whole sequence; max
    difference."""
    import ds_usp
    from ds_usp.integration.models.attention import USPContext, attach
    from ds_usp.integration.models.hybrid import is_linear_attention, wrap_linear_layers

    module = importlib.import_module(FAMILIES[family])
    saved = getattr(module, _rule_name(family))
    setattr(module, _rule_name(family), _fp64_scan if family == "nemotron_h" else _fp64_rule)
    norm = getattr(module, "NemotronHRMSNormGated", None)
    saved_norm = norm.forward if norm else None
    if norm:
        norm.forward = _fp64_gated_norm
    try:
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
        layer = next(m for m in model.modules() if is_linear_attention(m)).double()
        twin = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
        mine = next(m for m in twin.modules() if is_linear_attention(m)).double()
        mine.load_state_dict(layer.state_dict())
        topo = get_topo(u, r)
        attach(mine, USPContext(topo=topo, layout=layout, native_op=False))
        wrap_linear_layers(mine)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(1, SEQ, 64, generator=gen, dtype=torch.float64)
        dout = torch.randn(1, SEQ, 64, generator=gen, dtype=torch.float64)
        want, start = [], 0
        xr = x.clone().requires_grad_()
        for n in docs or [SEQ]:  # the layer's own forward, one document at a time
            want.append(layer(xr[:, start:start + n]))
            start += n
        torch.cat(want, 1).backward(dout)
        shard = functools.partial(ds_usp.shard_sequence, topo=topo, dim=1, layout=layout, doc_lens=docs)
        xl = shard(x).requires_grad_()
        cu = ds_usp.data.cu_seq_lens([docs] if docs else None, 1, SEQ, "cpu")
        out = mine(xl, cu_seq_lens_q=cu)
        out.backward(shard(dout))
        gather = functools.partial(ds_usp.gather_sequence, topo=topo, dim=1, layout=layout, seq_len=SEQ, doc_lens=docs)
        errors = [float((gather(out.detach()) - torch.cat(want, 1).detach()).abs().max()),
                  float((gather(xl.grad) - xr.grad).abs().max())]
        for (name, p), (_, q) in zip(layer.named_parameters(), mine.named_parameters()):
            grad = q.grad.clone()
            torch.distributed.all_reduce(grad, group=topo.sp_group)
            scale = 1e-4 if name.startswith(FP32_INSIDE.get(family, ("A_log",))) else 1.0
            errors.append(scale * float((grad - p.grad).abs().max() / p.grad.abs().max()))
        return errors if detail else max(errors)
    finally:
        setattr(module, _rule_name(family), saved)
        if norm:
            norm.forward = saved_norm


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_layer_is_exact_in_fp64(world4, family):
    for u, r, layout, docs in ((2, 2, "zigzag", None), (1, 4, "zigzag", [20, 30, 17]), (4, 1, "zigzag", None)):
        err = world4.run(layer_case, family, u, r, layout, docs)[0]
        assert err < 1e-10, f"{family} {u}x{r} {layout} docs={docs}: {err:.2e}"


def _drift(family: str) -> dict:
    """Per parameter: the relative difference of the single-process first-step gradient between chunk sizes 64 and 16
    of the family's own fp32 kernel (how much fp32 alone moves each gradient)."""
    from transformers import AutoModelForCausalLM

    module = importlib.import_module(FAMILIES[family])
    saved = getattr(module, _rule_name(family))
    grads = []
    for chunk in (64, 16):
        # the chunk size forced even where the layer passes its own (Mamba-2's chunk_size=self.chunk_size)
        setattr(module, _rule_name(family), lambda *a, _c=chunk, **k: saved(*a, **{**k, "chunk_size": _c}))
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
            ids = _batch(0, False)["input_ids"]
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        finally:
            setattr(module, _rule_name(family), saved)
    return {n: float((grads[0][n] - grads[1][n]).norm() / grads[0][n].norm().clamp_min(1e-30)) for n in grads[0]}


def _batch(step: int, packed: bool) -> dict:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(3, 128, (1, SEQ), generator=g)
    batch = {"input_ids": ids}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in (20, 30, SEQ - 50)]).unsqueeze(0)
    return batch


def _reference_run(family: str, packed: bool) -> dict:
    """model_case's single-process run: per step the per-token losses (0 after each document's last token) and the
    mean loss, one document at a time, then 3 AdamW steps; the first step's nonzero gradients."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    run = {"tokens": [], "loss": [], "grad": {}}
    lens = [20, 30, SEQ - 50] if packed else [SEQ]
    for step in range(3):
        batch = _batch(step, packed)
        per_token, start = [], 0
        for n in lens:
            ids = batch["input_ids"][:, start:start + n]
            logits = ref(input_ids=ids, use_cache=False).logits[0, :-1]
            per_token += [F.cross_entropy(logits, ids[0, 1:], reduction="none"), torch.zeros(1)]
            start += n
        per_token = torch.cat(per_token)
        want = per_token.sum() / (SEQ - len(lens))
        opt.zero_grad()
        want.backward()
        if step == 0:
            run["grad"] = {name: p.grad.clone() for name, p in ref.named_parameters()
                           if p.grad is not None and p.grad.norm() > 0}
        opt.step()
        run["tokens"].append(per_token.detach())
        run["loss"].append(float(want))
    return run


def model_case(family: str, u: int, r: int, layout: str, packed: bool, memory: bool, stage: int = 2) -> dict:
    """On every rank: the model through ds_usp.initialize, 3 AdamW steps; on rank 0 the differences from one process
    (:func:`_reference_run`, computed once per family and packing)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    import ds_usp

    ds_usp.hf.register_usp_attention()
    want = reference(("test_linear", family, packed), _reference_run, family, packed)
    torch.manual_seed(0)  # the reference's weights
    weights = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager").state_dict()
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="usp")
    model.load_state_dict(weights)
    usp = {"ulysses_degree": u, "ring_degree": r, "layout": layout, "native_op": False}
    if memory:  # the whole memory stack on, at this size: chunked loss, tiled MLP, selective checkpointing
        usp.update(chunked_loss=True, tiled_mlp=True, activation_checkpointing="selective", tile_mib=0.01)
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},  # ZeRO-3: every parameter
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "sequence_parallel": "usp", "sequence_parallel_size": u * r, "usp": usp})
    report = {"token": [], "grad": {}}
    for step in range(3):
        shard = ds_usp.shard_batch(_batch(step, packed), engine.usp.topo, layout=engine.usp.layout)
        got = _sp_token_losses(engine, shard)  # through the gathered logits
        out = engine(**shard)
        engine.backward(out.loss)
        if want is not None:
            report["token"].append(float((got - want["tokens"][step]).abs().max()))
            report["token"].append(abs(float(out.loss) - want["loss"][step]))  # and through the SP loss
        if step == 0:
            for name, q in engine.module.named_parameters():
                full = deepspeed.utils.safe_get_full_grad(q)  # (collective under ZeRO-3: every rank, every one)
                if want is not None and name in want["grad"]:
                    p = want["grad"][name]
                    report["grad"][name] = float((full - p).norm() / p.norm())
            assert want is None or report["grad"].keys() == want["grad"].keys(), "parameter names differ"
        engine.step()
    return report


MODEL_CASES = [(4, 1, "zigzag", False, False), (2, 2, "zigzag", False, False), (1, 4, "contiguous", False, False),
               (1, 4, "zigzag", False, False), (2, 2, "zigzag", True, False), (2, 2, "zigzag", False, True, 3)]
# the last: the memory stack on, under ZeRO-3 (the layers read their convolution filters outside its forward)


# Jamba's Mamba-1 and LFM2's convolutions work over the SP group whatever U and R (test_sharded_* runs every split
# and layout): packed documents at 1x4, and the memory stack under ZeRO-3 at 2x2
NO_HEADS_CASES = [(1, 4, "contiguous", True, False), MODEL_CASES[-1]]
# RecurrentGemma's own convolution runs across packed documents (its RG-LRU resets at each): its packed rows are not
# the per-document reference, so its 1x4 case is unpacked
RG_CASES = [MODEL_CASES[2], MODEL_CASES[-1]]


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["jamba", "lfm2", "recurrent_gemma"])
def test_hybrid_models_train_exactly(world4, family):
    drift = _drift(family) if family in FAMILIES else {}  # Jamba, LFM2, RecurrentGemma: nothing chunked to drift
    cases = MODEL_CASES if family in FAMILIES else RG_CASES if family == "recurrent_gemma" else NO_HEADS_CASES
    for case in cases:
        report = world4.run(model_case, family, *case)[0]
        what = f"{family} {case[0]}x{case[1]} {case[2]} packed={case[3]} memory={case[4]} zero={(case + (2,))[5]}"
        assert max(report["token"]) < 1e-4, f"{what}: loss differences per step {report['token']}"
        bad = {n: (e, drift.get(n, 0)) for n, e in report["grad"].items() if not e < max(1e-4, 3 * drift.get(n, 0))}
        assert report["grad"] and not bad, f"{what}: gradients off (relative error, fp32 drift): {bad}"


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("family,config", [
    ("MiniMaxConfig", dict(layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                           num_experts_per_tok=2)),
    ("xLSTMConfig", dict(embedding_dim=64, num_heads=4, num_blocks=2)),
])
def test_other_recurrent_families_are_refused_by_name(family, config):
    import transformers

    import ds_usp
    from ds_usp.integration.models.hybrid import is_linear_attention
    from ds_usp.integration.models.checks import check_model

    ds_usp.hf.register_usp_attention()
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, family)(**{**base, **config}),
                                                          attn_implementation="usp")
    with pytest.raises(ValueError, match=rf"{type(model).__name__} mixes tokens along the sequence outside attention"):
        check_model(model, handled=is_linear_attention)


def test_linear_heads_the_degree_cannot_split_are_refused():
    from ds_usp.linear import check_linear_heads

    check_linear_heads(2, 4, 4)  # key heads replicated over 2 ranks each
    with pytest.raises(ValueError, match=r"linear-attention heads \(3 key, 6 value\) and ulysses_degree \(4\)"):
        check_linear_heads(3, 6, 4)


# ------------------------------------------------------------------------------------ bytes on the wire


def metered_layer(u: int, r: int, layout: str, seq: int) -> tuple:
    """On every rank: one gated_delta_attention forward and backward under the byte meter (after a warm-up)."""
    import ds_usp
    from ds_usp.linear import gated_delta_attention
    from ds_usp.instruments.meters import CommCounter

    topo = get_topo(u, r)
    q, k, v, g, beta, w = _inputs(seq, 2, 4, 4, 3, seed=1, dtype=torch.float32)
    local = [ds_usp.shard_sequence(t, topo, dim=1, layout=layout) for t in (q, k, v, g, beta)]

    def run(counter=None):
        leaves = [t.clone().requires_grad_() for t in local]
        out = gated_delta_attention(*leaves, w, None, topo, recurrent_rule, F.silu, layout=layout, native_op=False)
        return leaves, out

    leaves, out = run()
    out.sum().backward()
    counter = CommCounter()
    with counter.phase("fwd"):
        leaves, out = run()
    with counter.phase("bwd"):
        out.sum().backward()
    return counter.volume("fwd"), counter.volume("bwd")


@pytest.mark.parametrize("u,r,layout,segments", [(4, 1, "zigzag", 1), (2, 2, "zigzag", 2), (1, 4, "contiguous", 1)])
def test_linear_bytes_match_the_closed_form(world4, u, r, layout, segments):
    from ds_usp.cost import linear_bytes

    fwd, bwd = world4.run(metered_layer, u, r, layout, 48)[0]
    want_fwd, want_bwd = linear_bytes(1, 48, 2, 4, 4, 3, K, u, r, 4, segments)
    assert (fwd.all_to_all, fwd.ring, fwd.other) == (want_fwd.all_to_all, want_fwd.ring, want_fwd.other)
    assert (bwd.all_to_all, bwd.ring, bwd.other) == (want_bwd.all_to_all, want_bwd.ring, want_bwd.other)
