"""Packed documents and sliding windows through USP, against single-process SDPA with the explicit mask.

Every case shards q, k, v (and the output gradient), runs ``ds_usp.usp_attention`` with ``doc_lens``
and/or ``window`` forward and backward, gathers, and compares output, dq, dk, dv with
``F.scaled_dot_product_attention`` over the whole sequence given the boolean block-diagonal (and
banded) mask, fp32, atol = rtol = 1e-5 (bf16: 3e-2 relative to the largest gradient). Worlds of 4
((U, R) = (4, 1), (2, 2), (1, 4)) and 8 ((2, 4)); layouts contiguous, zigzag and balanced; documents
from 1 to 40 per row including length-1 ones and ones that cross shard and ring boundaries; windows
1, 17, 256 and longer than the sequence; GQA; padding (lengths that need it); two rows with
different documents; hypothesis draws random mixes. Rows of padding and queries that see nothing get
zero output and zero gradient.

Work skipped: a kernel-call and byte count shows that blocks no pair crosses are not computed and that
the ring stops when its tail is not needed. Balance: the ``"balanced"`` layout's per-rank causal work
on a long-tail mix of documents is within 1.15 of the mean where zigzag's is not.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_harness import get_topo





WORLD_TIMEOUT = 300


def reference_mask(seq: int, docs: list[list[int]], causal: bool, window, chunk=None, spans=None) -> torch.Tensor:
    """``(b, 1, S, S)`` bool: the explicit mask the single-process reference uses (``chunk``: chunks of that many
    tokens counted from each document's start, as HF's chunked mask with packed position ids; ``spans``: per row,
    bidirectional ``(start, end)`` spans whose queries also see their span's later keys, as HF's blockwise overlay
    under a sliding window)."""
    rows = []
    pos = torch.arange(seq)
    for i, lens in enumerate(docs):
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        keep = doc.unsqueeze(1) == doc.unsqueeze(0)
        if chunk is not None:
            start = torch.repeat_interleave(torch.tensor([0] + lens[:-1]).cumsum(0), torch.tensor(lens))
            piece = (pos - start) // chunk
            keep &= piece.unsqueeze(1) == piece.unsqueeze(0)
        diff = pos.unsqueeze(0) - pos.unsqueeze(1)  # k - q
        later = diff <= (0 if causal else seq) if window is None else diff <= window[1]  # the right bound
        for a, b in (spans[i] if spans else ()):
            inside = (pos >= a) & (pos < b)
            later |= inside.unsqueeze(1) & inside.unsqueeze(0)
        keep &= later
        if window is not None:
            keep &= diff >= -window[0]
        rows.append(keep)
    return torch.stack(rows).unsqueeze(1)


def compare(u: int, r: int, layout: str, seq: int, docs: list[list[int]], causal: bool, window, hq: int, hkv: int,
            dtype_name: str = "float32", seed: int = 0, per_row_docs: bool = True, attn_backend: str = "auto",
            chunk=None, spans=None) -> int:
    """On every rank: one case against the reference; returns the number of kernel forward calls of this rank."""
    import ds_usp
    from ds_usp.kernels import band, torch_sdpa

    dtype = getattr(torch, dtype_name)
    topo = get_topo(u, r)
    b, d = len(docs), 8
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, seq, h, d, generator=g) for h in (hq, hkv, hkv, hq))
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    doc_lens = docs if per_row_docs else docs[0]
    shard = lambda x, pad=0.0: ds_usp.shard_sequence(x, topo, layout=layout, pad_value=pad, doc_lens=doc_lens)  # noqa
    ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
    calls = [0]
    originals = (torch_sdpa.attention_forward, band.masked_forward)

    def counting(fn):
        def counted(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)
        return counted

    from ds_usp.kernels import resolve_backend

    torch_sdpa.attention_forward, band.masked_forward = (counting(fn) for fn in originals)
    resolve_backend.cache_clear()  # the backends resolved now hold the counting kernels, and after, the originals
    try:  # count the forward's kernel calls: fused ones and masked band edges
        out = ds_usp.usp_attention(ql, kl, vl, topo, causal=causal, layout=layout, seq_len=seq, doc_lens=doc_lens,
                                   window=window, attn_backend=attn_backend, chunk=chunk, spans=spans)
    finally:
        torch_sdpa.attention_forward, band.masked_forward = originals
        resolve_backend.cache_clear()
    out.backward(shard(dout, 1.0))  # a gradient on padding too: it must not leak anywhere
    got = [ds_usp.gather_sequence(x.detach(), topo, layout=layout, seq_len=seq, doc_lens=doc_lens)
           for x in (out, ql.grad, kl.grad, vl.grad)]
    keep = reference_mask(seq, docs, causal, window, chunk, spans)
    qr, kr, vr = (x.float().clone().requires_grad_() for x in (q, k, v))
    rep = hq // hkv
    # (b, s, h, d) -> (b, h, s, d) for SDPA, and back
    ref = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.repeat_interleave(rep, 2).transpose(1, 2),
                                         vr.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=keep).transpose(1, 2)
    ref.backward(dout.float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for name, g_, want in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), qr.grad, kr.grad, vr.grad)):
        assert torch.isfinite(g_).all(), name
        scale = want.abs().max().clamp_min(1.0)
        torch.testing.assert_close(g_.float() / scale, want / scale, **tol,
                                   msg=lambda m: f"{name} {u}x{r} {layout} S={seq} docs={docs} causal={causal} "
                                                 f"window={window} chunk={chunk} spans={spans}: {m}")
    return calls[0]


def _mix(seq: int, count: int, rng: random.Random) -> list[int]:
    """``count`` positive lengths summing to ``seq`` (some of length 1)."""
    cuts = sorted(rng.sample(range(1, seq), count - 1)) if count > 1 else []
    return [b - a for a, b in zip([0] + cuts, cuts + [seq])]


FIXED = [  # (u, r, layout, seq, docs, causal, window, hq, hkv)
    (2, 2, "zigzag", 96, [[10, 1, 40, 30, 15]], True, None, 4, 2),
    (1, 4, "balanced", 96, [[10, 1, 40, 30, 15]], True, None, 4, 4),
    (4, 1, "contiguous", 93, [[1] * 13 + [80]], True, None, 4, 1),  # padded; 13 one-token documents
    (1, 4, "zigzag", 100, [[50, 50], [1, 98, 1]], False, None, 4, 2),  # two rows, different documents, non-causal
    (2, 2, "balanced", 100, [[50, 50], [1, 98, 1]], True, None, 4, 2),
    (1, 4, "contiguous", 128, [[128]], True, (17, 0), 4, 2),  # window only
    (2, 2, "zigzag", 128, [[64, 64]], True, (1, 0), 4, 4),  # window 1: a token and the one before it
    (1, 4, "balanced", 128, [[30, 60, 38]], False, (17, 5), 4, 2),  # non-causal window, documents
    (4, 1, "zigzag", 128, [[128]], True, (256, 0), 4, 4),  # window longer than the sequence
    (2, 2, "contiguous", 120, [[7] * 15 + [15]], True, (17, 0), 4, 2),
    (1, 4, "zigzag", 96, [[10, 1, 40, 30, 15]], True, None, 4, 2, "bfloat16"),
    # chunked attention (Llama 4): chunks from each document's start; the balanced layout keeps placing the
    # batch's documents, not the chunks
    (2, 2, "zigzag", 101, [[101]], True, None, 4, 2, "float32", 0, True, "auto", 16),
    (1, 4, "balanced", 100, [[50, 50], [1, 98, 1]], True, None, 4, 2, "float32", 0, True, "auto", 7),
    (4, 1, "contiguous", 96, [[10, 1, 40, 30, 15]], False, None, 4, 4, "float32", 0, True, "auto", 12),
    (1, 4, "zigzag", 128, [[128]], True, (9, 0), 4, 2, "float32", 0, True, "auto", 32),  # window and chunks
]
# bidirectional spans (Gemma 3's image blocks, PaliGemma's prefix): spans that cross shard and ring boundaries, with
# windows (the left bound still holds inside a span), documents, two rows with their own spans, odd lengths
SPANS = [
    (2, 2, "zigzag", 101, [[101]], True, None, 4, 2, dict(spans=[[(3, 40), (60, 90)]])),
    (1, 4, "contiguous", 96, [[96]], True, (9, 0), 4, 1, dict(spans=[[(10, 60)]])),
    (4, 1, "zigzag", 96, [[30, 66]], True, (17, 0), 4, 4, dict(spans=[[(0, 30), (31, 80)]])),
    (1, 4, "balanced", 100, [[50, 50], [1, 98, 1]], True, None, 4, 2,
     dict(spans=[[(20, 45), (50, 51)], [(1, 99)]])),
    (2, 2, "contiguous", 99, [[99]], False, (5, 3), 4, 2, dict(spans=[[(40, 70)]])),
    (1, 4, "zigzag", 96, [[96]], True, None, 4, 2, dict(spans=[[(24, 72)]], dtype_name="bfloat16")),
]


def run_fixed() -> int:
    for case in FIXED:
        compare(*case)
    for case in SPANS:
        compare(*case[:9], **case[9])
    return len(FIXED) + len(SPANS)


def test_fixed_cases_world4(world4):
    assert world4.run(run_fixed) == [len(FIXED) + len(SPANS)] * 4


def run_fixed_triton() -> int:
    from ds_usp.kernels import triton_attn

    reason = triton_attn.unavailable_reason(torch.device("cpu"))
    assert reason is None, reason  # conftest runs the kernels in Triton's interpreter
    for case in FIXED:
        rest = dict(zip(("dtype_name", "seed", "per_row_docs", "attn_backend", "chunk"), case[9:]))
        # no torch kernel ran: every block went through triton
        assert compare(*case[:9], **{**rest, "attn_backend": "triton"}) == 0
    for case in SPANS:
        assert compare(*case[:9], **{**case[9], "attn_backend": "triton"}) == 0
    return len(FIXED) + len(SPANS)


def test_fixed_cases_triton_world4(world4):
    """The same cases with attn_backend="triton" (interpreter on CPU): fused merge and in-kernel band masks."""
    pytest.importorskip("triton", reason="triton is installed with the dev extra")
    assert world4.run(run_fixed_triton) == [len(FIXED) + len(SPANS)] * 4


def run_many(u: int, r: int, seed: int) -> int:
    """Random document mixes (1 to 40 per row) and windows, every layout, on one split."""
    rng = random.Random(seed)
    n = 0
    for layout in ("contiguous", "zigzag", "balanced"):
        for count in (1, 2, 7, 40):
            seq = rng.choice([160, 203, 256])
            docs = [_mix(seq, count, rng)]
            window = rng.choice([None, (17, 0), (256, 0), (5, 3)])
            causal = window is None or window[1] == 0 if rng.random() < 0.8 else False
            if not causal and window is not None and window[1] == 0:
                window = (window[0], 2)
            compare(u, r, layout, seq, docs, causal, window, 4, rng.choice([1, 2, 4]), seed=rng.randrange(1 << 16),
                    chunk=rng.choice([None, None, None, 5, 33]))
            n += 1
    return n


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2), (1, 4)])
def test_random_mixes_world4(world4, u, r):
    assert world4.run(run_many, u, r, 10 * u + r) == [12] * 4


def test_random_mixes_world8(world8):
    assert world8.run(run_many, 2, 4, 99) == [12] * 8


@st.composite
def packed_cases(draw):
    u, r = draw(st.sampled_from([(4, 1), (2, 2), (1, 4)]))
    seq = draw(st.integers(8, 150))
    count = draw(st.integers(1, min(40, seq)))
    cuts = sorted(draw(st.lists(st.integers(1, seq - 1), min_size=count - 1, max_size=count - 1, unique=True))) \
        if count > 1 else []
    docs = [b - a for a, b in zip([0] + cuts, cuts + [seq])]
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, (1, 0), (17, 0), (256, 0), (3, 2)]))
    if window is not None and causal:
        window = (window[0], 0)
    return dict(u=u, r=r, layout=draw(st.sampled_from(["contiguous", "zigzag", "balanced"])), seq=seq,
                docs=[docs], causal=causal, window=window, hq=4, hkv=draw(st.sampled_from([1, 2, 4])),
                seed=draw(st.integers(0, 1 << 16)), per_row_docs=draw(st.booleans()))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=packed_cases())
def test_property_packed_matches_reference(world4, case):
    world4.run(compare, **case)


# ---- work skipped --------------------------------------------------------------------------------------------------

def skipped_work() -> list:
    """Documents aligned with the ring pieces (contiguous 1x4): each rank needs only its own block."""
    from ds_usp.instruments.meters import measure_attention

    topo = get_topo(1, 4)
    results = []
    for docs, window in (([16, 16, 16, 16], None), ([64], (15, 0)), ([64], None)):
        calls = compare(1, 4, "contiguous", 64, [docs], True, window, 4, 2)
        g = torch.Generator().manual_seed(topo.rank)
        q, k, v, dout = (torch.randn(1, 16, h, 8, generator=g) for h in (4, 2, 2, 4))
        fwd, bwd, _ = measure_attention(topo, q, k, v, dout, layout="contiguous", seq_len=64, doc_lens=docs,
                                        window=window)
        results.append((calls, fwd.ring, bwd.ring))
    return results


def test_masked_blocks_and_ring_tail_are_skipped(world4):
    per_rank = world4.run(skipped_work)
    for rank, ((aligned_calls, aligned_fwd, aligned_bwd), (win_calls, win_fwd, _), (full_calls, full_fwd, _)) \
            in enumerate(per_rank):
        assert aligned_calls == 1 and aligned_fwd == 0 and aligned_bwd == 0, per_rank  # own block only, no hop
        assert full_calls == rank + 1 and full_fwd > 0  # causal, one document: rank r computes r + 1 blocks
        # a 15-token window over 16-token pieces: only this block and the one before (cut into band pieces)
        assert (win_calls == 1) == (rank == 0) and win_calls <= 3
        assert 0 < win_fwd < full_fwd  # one hop instead of three


# ---- balance -------------------------------------------------------------------------------------------------------

def _work(layout: str, docs: list[int], ring: int) -> list[int]:
    """Allowed causal (query, key) pairs per ring rank, from the block parts the ring computes."""
    from ds_usp.attention.masks import MaskSpec, RowMask, block_parts
    from ds_usp.sharding import normalize_docs, piece_runs, segment_bounds

    seq = sum(docs)
    starts = normalize_docs(docs, 1, seq)
    spec = MaskSpec(causal=True, seq_len=seq, docs=starts)
    pieces = [piece_runs(seq, ring, r, layout, segment_bounds(starts, seq, seq)) for r in range(ring)]
    work = []
    for me in range(ring):
        pairs = 0
        for src in range(ring):
            for part in block_parts(spec, RowMask(starts[0]), pieces[me], pieces[src]):
                nq, nk = part.q.stop - part.q.start, part.k.stop - part.k.start
                pairs += nq * (nq + 1) // 2 if part.causal else nq * nk
        work.append(pairs)
    return work


def test_balanced_layout_balances_packed_rows():
    rng = random.Random(0)
    seq, ring = 16384, 4
    for _ in range(5):
        docs, total = [], 0
        while total < seq:  # a long-tail mix: lognormal lengths, median ~400 tokens
            docs.append(min(max(1, int(rng.lognormvariate(6.0, 1.3))), seq - total))
            total += docs[-1]
        zig, bal = _work("zigzag", docs, ring), _work("balanced", docs, ring)
        assert sum(zig) == sum(bal) == sum(d * (d + 1) // 2 for d in docs)  # the parts hold exactly the pairs
        assert max(bal) / (sum(bal) / ring) <= 1.15, (bal, docs)
    assert max(zig) / (sum(zig) / ring) > 1.15  # the last mix: zigzag alone does not balance it


# ---- HF: packed rows and sliding windows ---------------------------------------------------------------------------

PACKED_DOCS = [40, 1, 100, 60, 49]  # 250 tokens: one 1-token document, documents across shard and ring boundaries


def _packed_batch(index: int) -> dict:
    """A packed row the way DataCollatorWithFlattening builds it: positions restart at 0, labels -100 at doc starts."""
    from test_training import SEQ, VOCAB

    g = torch.Generator().manual_seed(2000 + index)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    positions = torch.cat([torch.arange(n) for n in PACKED_DOCS]).unsqueeze(0)
    labels = ids.clone()
    labels[positions == 0] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def packed_reference(steps: int) -> tuple[list[float], dict]:
    """Single-process training on the packed rows (HF's sdpa masks per document from the restarting positions)."""
    from test_training import CLIP, LR, MOMENTUM, _llama

    model = _llama("sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(**_packed_batch(step), use_cache=False).loss  # HF masks packed rows only without a KV cache
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_packed(stage: int, u: int, r: int, layout: str, steps: int,
                 readme_loop: bool = False) -> tuple[list[float], dict]:
    """On every rank: ds_usp.initialize, packed rows through shard_batch and ``engine(**shard)``; ``readme_loop``:
    the README's loop literally, ``engine(input_ids=..., position_ids=..., shift_labels=...)``, which passes no
    document boundaries (ds-usp finds them from the restarting positions)."""
    import ds_usp
    from test_training import _ds_config, _llama, _params

    ds_usp.hf.register_usp_attention()
    cfg = _ds_config(stage, u * r, u, r, layout)
    model = _llama("usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(steps):
        shard = ds_usp.shard_batch(_packed_batch(step), engine.usp.topo, layout=engine.usp.layout)
        if readme_loop:
            out = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                         shift_labels=shard["shift_labels"])
        else:
            out = engine(**shard)
        loss = out.loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, _params(engine, stage)


def test_reference_masks_documents():
    """The reference itself: HF's sdpa on the packed row gives the documents' own outputs, one by one.

    Only with ``use_cache=False``: with a KV cache (HF builds one in training when ``config.use_cache`` is
    true) HF does not apply its per-document mask and the documents see each other (checked too).
    """
    from test_training import _llama

    model = _llama("sdpa")
    batch = _packed_batch(0)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        assert (leaky[:, 41:] - packed[:, 41:]).abs().max() > 0.1
        start = 0
        for n in PACKED_DOCS:
            alone = model(input_ids=batch["input_ids"][:, start:start + n], use_cache=False).logits
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


@pytest.mark.parametrize("stage,u,r,layout,readme_loop", [(2, 2, 2, "zigzag", False), (3, 1, 4, "balanced", False),
                                                          (3, 4, 1, "contiguous", False), (2, 2, 2, "zigzag", True),
                                                          (1, 1, 4, "contiguous", True)])
def test_hf_packed_training_equals_single_process(world4, stage, u, r, layout, readme_loop):
    from test_training import TOL

    steps = 3
    want_losses, want_params = packed_reference(steps)
    results = world4.run(train_packed, stage, u, r, layout, steps, readme_loop)
    losses, params = results[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TOL)
    for name, value in params.items():
        torch.testing.assert_close(value, want_params[name], **TOL, msg=lambda m: f"{name}: {m}")


def readme_loop_balanced() -> str:
    """On every rank: the README's loop on packed rows under the "balanced" layout (whose shards are placed by the
    documents it is not given): refused by name."""
    import ds_usp
    from test_training import _ds_config, _llama

    ds_usp.hf.register_usp_attention()
    model = _llama("usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(),
                                   config=_ds_config(2, 4, 2, 2, "balanced"))
    shard = ds_usp.shard_batch(_packed_batch(0), engine.usp.topo, layout="balanced")
    with pytest.raises(ValueError, match="balanced") as caught:
        engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"], shift_labels=shard["shift_labels"])
    return str(caught.value)


def test_readme_loop_on_packed_rows_refused_under_balanced(world4):
    messages = world4.run(readme_loop_balanced)
    assert len(set(messages)) == 1 and "cu_seq_lens_q" in messages[0]


def mistral_window(layout: str) -> float:
    """One forward+backward of a tiny Mistral with a 16-token sliding window through "usp" (2x2) vs sdpa."""
    import transformers

    import ds_usp
    from ds_usp.integration.models.attention import USPContext, attach
    from test_training import TOL, VOCAB, _batch

    ds_usp.hf.register_usp_attention()
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                     sliding_window=16)
    batch = _batch(3)
    torch.manual_seed(0)
    ref_model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    ref = ref_model(**batch).loss
    ref.backward()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="usp", dtype=torch.float32)
    topo = get_topo(2, 2)
    attach(model, USPContext(topo=topo, layout=layout))
    shard = ds_usp.shard_batch(batch, topo, layout=layout)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                   cu_seq_lens_q=shard["cu_seq_lens_q"]).logits
    loss = ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    for (name, p), (_, rp) in zip(model.named_parameters(), ref_model.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=topo.sp_group)  # what DeepSpeed sums over the SP ranks
        torch.testing.assert_close(grad, rp.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return float(ref)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_hf_sliding_window(world4, layout):
    assert len(set(world4.run(mistral_window, layout))) == 1


def test_spans_are_checked_before_any_collective():
    from ds_usp.attention.checks import check_spans

    assert check_spans(None, 2, 10, None) is None
    assert check_spans([(0, 0)], 2, 10, None) is None  # empty spans only: none
    assert check_spans([(5, 8), (1, 3)], 2, 10, None) == (((1, 3), (5, 8)),) * 2
    assert check_spans(torch.tensor([[[1, 3], [0, 0]], [[2, 9], [0, 0]]]), 2, 10, None) == (((1, 3),), ((2, 9),))
    with pytest.raises(ValueError, match=r"spans row 0: \(1, 5\) and the span starting at 3 overlap"):
        check_spans([(1, 5), (3, 6)], 1, 10, None)
    with pytest.raises(ValueError, match=r"crosses the document boundary at 4"):
        check_spans([[(2, 6)]], 1, 10, ((0, 4),))
    with pytest.raises(ValueError, match=r"0 <= start <= end <= 10"):
        check_spans([(2, 11)], 1, 10, None)
    with pytest.raises(ValueError, match="spans has 3 rows, the batch has 2"):
        check_spans([[(1, 2)], [], []], 2, 10, None)
    with pytest.raises(ValueError, match="spans row 1: 7 is not a list of"):
        check_spans([[(1, 2)], 7], 2, 10, None)


def test_valid_keys_are_checked_sorted_and_merged():
    from ds_usp.attention.checks import check_keys

    assert check_keys(None, 2, 10) is None
    assert check_keys([(0, 10)], 2, 10) is None  # every key valid: none
    assert check_keys([(0, 4), (2, 6), (0, 0), (8, 9)], 1, 10) == (((0, 6), (8, 9)),)
    assert check_keys([[(6, 9), (0, 3)], [(3, 6), (0, 3)]], 2, 10) == (((0, 3), (6, 9)), ((0, 6),))
    assert check_keys(torch.tensor([[[0, 3], [0, 0]], [[5, 10], [0, 0]]]), 2, 10) == (((0, 3),), ((5, 10),))
    with pytest.raises(ValueError, match=r"keys row 1: no valid key at all"):
        check_keys([[(0, 4)], [(3, 3)]], 2, 10)
    with pytest.raises(ValueError, match=r"keys row 0: \(1, 2.0\) is not \(start, end\)"):
        check_keys([(1, 2.0)], 1, 10)
    with pytest.raises(ValueError, match="keys row 0: 5 is not a list of"):
        check_keys([5], 1, 10)
    with pytest.raises(ValueError, match="keys has 3 rows, the batch has 2"):
        check_keys([[(0, 2)], [(0, 2)], [(0, 2)]], 2, 10)
