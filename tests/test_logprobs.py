"""Per-token log-probs through lm_head in chunks on a sharded sequence (ds_usp.integration.step.logprobs), the piece the
RL and preference trainers share, against one process over the whole sequence.

Every (U, R) of 4 ranks and both layouts; two rows of 37 tokens (padding needed), ignored targets, a temperature, a
soft-capped logits tail, chunks smaller than a shard; values (per token and per sequence, entropies too) and the
gradients of hidden states and lm_head equal the reference within fp32 rounding (rtol 1e-5, atol 1e-6).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_harness import get_topo

B, S, H, V = 2, 37, 16, 50
TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, S, H, generator=g)
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
        head.bias.copy_(torch.randn(V, generator=g) * 0.1)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = -100
    labels[1, 30:] = -100
    coef = torch.tensor([0.7, -1.3])
    return hidden, head, labels, coef


def _reference(temperature: float, softcap: float):
    hidden, head, labels, coef = _inputs()
    hidden.requires_grad_()
    logits = F.linear(hidden, head.weight, head.bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logp = (logits / temperature).log_softmax(-1)
    valid = labels != -100
    picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * valid
    ent = -(logp.exp() * logp).sum(-1) * valid
    loss = (picked.sum(-1) * coef).sum() + 0.1 * ent.sum()
    loss.backward()
    return picked.detach(), ent.detach(), hidden.grad, head.weight.grad, head.bias.grad


def sharded(u: int, r: int, layout: str, temperature: float, softcap: float) -> str:
    """On every rank: the same computation on this rank's shard; compares with the reference itself."""
    import torch.distributed as dist

    import ds_usp
    from ds_usp.integration.step.logprobs import sequence_sums, token_logprobs
    from ds_usp.integration.step.loss import LogitsTail

    topo = get_topo(u, r)
    want = _reference(temperature, softcap)
    hidden, head, labels, coef = _inputs()
    local = ds_usp.shard_sequence(hidden, topo, layout=layout).requires_grad_()
    local_labels = ds_usp.shard_sequence(labels, topo, layout=layout, pad_value=-100)
    logp, ent, *_ = token_logprobs(local, head, local_labels, temperature=temperature, chunk=5,
                                   tail=LogitsTail(softcap=softcap))
    loss = (sequence_sums(logp, topo) * coef).sum() + 0.1 * sequence_sums(ent, topo).sum()
    loss.backward()
    gather = lambda x: ds_usp.gather_sequence(x, topo, layout=layout, seq_len=S)  # noqa: E731
    torch.testing.assert_close(gather(logp.detach()), want[0], **TOL)
    torch.testing.assert_close(gather(ent.detach()), want[1], **TOL)
    torch.testing.assert_close(sequence_sums(logp.detach(), topo), want[0].sum(-1), **TOL)
    torch.testing.assert_close(gather(local.grad), want[2], **TOL)
    for got, ref in ((head.weight.grad, want[3]), (head.bias.grad, want[4])):
        dist.all_reduce(got, group=topo.sp_group)  # each rank's share of the head's gradient
        torch.testing.assert_close(got, ref, **TOL)
    return "ok"


@pytest.mark.parametrize("u,r,layout,temperature,softcap", [(4, 1, "zigzag", 1.0, 0.0), (2, 2, "zigzag", 0.7, 5.0),
                                                           (1, 4, "contiguous", 1.3, 0.0)])
def test_sharded_logprobs_equal_one_process(world4, u, r, layout, temperature, softcap):
    assert world4.run(sharded, u, r, layout, temperature, softcap) == ["ok"] * 4


def test_bad_arguments_are_refused():
    from ds_usp.integration.step.logprobs import token_logprobs

    hidden, head, labels, _ = _inputs()
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(hidden, head, labels[:, :-1])
    with pytest.raises(ValueError, match="must be positive"):
        token_logprobs(hidden, head, labels, temperature=0.0)


# ---- TRL's fused LM head call under SP ---------------------------------------------------------------------------

def _padded_batch():
    """Rows as TRL builds them: left-padded prompts, right-padded completions, labels on the completions only."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 60, (3, 29), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, 25:] = 0  # right padding
    mask[2, :2] = 0
    mask[2, 27:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :12] = -100  # the prompt is not scored
    return ids, mask, labels


def fused_head(u: int, r: int, layout: str) -> str:
    """On every rank: TRL's fused head on the plain model in this process vs ds-usp's on the shards."""
    import copy

    from trl.trainer.utils import add_fused_lm_head
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ds_usp
    from ds_usp.integration.step.logprobs import FUSED_HEAD_ATTR, FusedHead

    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model = copy.deepcopy(plain)
    ds_usp.hf.register_usp_attention()
    model.config._attn_implementation = "usp"
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    add_fused_lm_head(plain, temperature=0.8, outputs=outputs)
    add_fused_lm_head(model, temperature=0.8, outputs=outputs)
    ids, mask, labels = _padded_batch()
    coef = torch.tensor([[0.5], [-1.0], [2.0]])
    want = plain(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    ((want.log_probs * coef).sum() + 0.1 * want.entropy.sum()).backward()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "sequence_parallel": "usp",
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "sequence_parallel_size": u * r, "usp": {"ulysses_degree": u, "ring_degree": r, "layout": layout}}
    engine, *_ = ds_usp.initialize(model=model, config=config)
    setattr(model, FUSED_HEAD_ATTR, FusedHead(temperature=0.8))
    got = engine(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    engine.backward((got.log_probs * coef).sum() + 0.1 * got.entropy.sum())  # sums the ranks' shares
    try:  # a VLM's inputs would be dropped by the text decoder: refused by name instead
        engine(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, pixel_values=torch.ones(1))
        raise AssertionError("visual inputs were accepted")
    except ValueError as err:
        assert "pixel_values" in str(err), err
    for name in outputs + ("label_mask", "loss"):
        a, b = getattr(got, name), getattr(want, name)
        if name == "is_top1":
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a.detach(), b.detach(), **TOL, msg=lambda m: f"{name}: {m}")
    grads = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return "ok"


@pytest.mark.parametrize("u,r,layout", [(2, 2, "zigzag"), (1, 4, "contiguous"), (4, 1, "zigzag")])
def test_fused_head_equals_trl_in_one_process(world4, u, r, layout):
    pytest.importorskip("trl")
    assert world4.run(fused_head, u, r, layout) == ["ok"] * 4
