"""The FlashAttention-4 adapter (ds_usp.kernels.flash_attn4) on CPU, against a stand-in of FA4's API.

The stand-in is installed as ``flash_attn.cute.interface`` and has the signatures of flash-attn-4 4.0.0b36's
``_flash_attn_fwd`` and ``_flash_attn_bwd`` (the parameter names, keyword-only use checked), FA4's preconditions that
the adapter must meet (contiguous inputs, a head dim that is a multiple of 8, lse ``(b, h, sq)`` float32 and out/dout
in q's dtype in the backward) and FA4's conventions: a 5-tuple forward result, lse in natural log with the scale in
it, the soft-cap ``softcap * tanh(scale * q.k / softcap)``, causal bottom-right aligned, GQA with dk/dv summed per kv
head. It computes with torch in float32 on CPU, and also takes fp32 inputs (FA4 does not), so that the adapter's
layouts and lse can be compared with the torch backend at fp32 precision (1e-5). The device check is faked: FA4 runs
on Hopper and Blackwell GPUs only.
"""
from __future__ import annotations

import inspect
import math
import sys
import types

import pytest
import torch
from torch import Tensor

import ds_usp.kernels as kernels
from ds_usp.kernels import flash_attn4 as fa4
from ds_usp.kernels import get_backend, resolve_backend

CPU = torch.device("cpu")
TOL = 1e-5
# flash-attn-4 4.0.0b36's parameters (flash_attn/cute/interface.py), the first ``required`` without a default
FWD_PARAMS = ("q k v qv cu_seqlens_q cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k min_seqlen_k "
              "page_table softmax_scale causal softcap window_size_left window_size_right learnable_sink tile_mn mma_pv_is_rs "
              "intra_wg_overlap num_threads num_splits pack_gqa _arch score_mod mask_mod block_sparse_tensors "
              "return_lse out lse aux_tensors aux_scalars q_descale k_descale v_descale gather_kv_indices "
              "scheduler_metadata seqlen_k_per_split disable_scheduler_metadata gather_bwd_recompute_p").split()
BWD_PARAMS = ("q k v out dout lse softmax_scale causal softcap window_size_left window_size_right m_block_size "
              "n_block_size num_threads pack_gqa num_stages_Q num_stages_dO SdP_swapAB dKV_swapAB dQ_swapAB "
              "AtomLayoutMSdP AtomLayoutNdKV AtomLayoutMdQ V_in_regs cu_seqlens_q cu_seqlens_k seqused_q seqused_k "
              "max_seqlen_q max_seqlen_k deterministic dq dk dv score_mod score_mod_bwd mask_mod aux_tensors "
              "aux_scalars block_sparse_tensors dlse learnable_sink").split()


def _declare(fn, params: list[str], required: int):
    """``fn(**kwargs)`` declaring FA4's parameters (``inspect.signature`` reads ``__signature__``)."""
    fn.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           **({} if i < required else {"default": None})) for i, n in enumerate(params)])
    return fn


def _scores(q: Tensor, k: Tensor, scale: float, softcap: float, causal: bool) -> tuple[Tensor, Tensor]:
    """FA4's scores in float32 (its accumulator), ``(b, hq, sq, sk)``, and the scaled ones before the cap (for the
    backward)."""
    groups = q.shape[2] // k.shape[2]
    raw = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(groups, dim=2)) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    if causal:  # bottom-right aligned: query i meets keys up to i + sk - sq
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return s, raw


def _check_inputs(kw: dict, params: list[str], *tensors: str) -> None:
    """FA4's preconditions that the adapter must meet."""
    assert set(kw) <= set(params), set(kw) - set(params)
    x = [kw[n] for n in tensors]
    assert all(t.is_contiguous() for t in x), "FA4 is given contiguous tensors (the layout its check ran on)"
    assert len({t.dtype for t in x}) == 1 and x[0].dtype in (torch.float16, torch.bfloat16, torch.float32)
    d = kw["q"].shape[-1]
    assert d % 8 == 0 and d <= 256 and kw["q"].shape[2] % kw["k"].shape[2] == 0


def make_standin(calls: list, wrong: str | None = None, fwd_params: list[str] = FWD_PARAMS) -> types.ModuleType:
    """A module with FA4's ``_flash_attn_fwd``/``_flash_attn_bwd``; ``calls`` records ``(which, q's shape)``.

    ``wrong``: "log2" returns the lse in base 2, "layout" returns it as ``(b, sq, h)``, "raises" fails the backward
    as FA4's assertions do.
    """
    def _flash_attn_fwd(**kw):
        _check_inputs(kw, fwd_params, "q", "k", "v")
        q, k, v = kw["q"], kw["k"], kw["v"]
        calls.append(("fwd", tuple(q.shape)))
        s, _ = _scores(q, k, kw["softmax_scale"], kw.get("softcap") or 0.0, kw["causal"])
        lse = torch.logsumexp(s, dim=-1)  # (b, hq, sq), natural log
        groups = q.shape[2] // k.shape[2]
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v.float().repeat_interleave(groups, dim=2))
        if wrong == "log2":
            lse = lse / math.log(2)
        if wrong == "layout":
            lse = lse.transpose(1, 2).contiguous()
        return out.to(q.dtype), lse, None, None, None

    def _flash_attn_bwd(**kw):
        _check_inputs(kw, BWD_PARAMS, "q", "k", "v", "out", "dout")
        q, k, v, out, dout, lse = (kw[n] for n in ("q", "k", "v", "out", "dout", "lse"))
        calls.append(("bwd", tuple(q.shape)))
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        assert kw["softcap"] is not None, "FA4's backward reads None as a soft-cap"
        if wrong == "raises":
            raise AssertionError("the kernel asserts")
        scale, cap, groups = kw["softmax_scale"], kw["softcap"], q.shape[2] // k.shape[2]
        s, raw = _scores(q, k, scale, cap, kw["causal"])
        p = torch.exp(s - lse[..., None])  # (b, hq, sq, sk) from the lse given
        ke, ve = (x.float().repeat_interleave(groups, dim=2) for x in (k, v))
        dp = torch.einsum("bqhd,bkhd->bhqk", dout.float(), ve)
        ds = p * (dp - (dout.float() * out.float()).sum(-1).transpose(1, 2)[..., None])
        if cap:
            ds = ds * (1 - torch.tanh(raw / cap) ** 2)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
        b, sk, hkv, d = k.shape
        dk = (torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale).reshape(b, sk, hkv, groups, d).sum(3)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout.float()).reshape(b, sk, hkv, groups, -1).sum(3)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    iface = types.ModuleType("flash_attn.cute.interface")
    iface._flash_attn_fwd = _declare(_flash_attn_fwd, fwd_params, 3)
    iface._flash_attn_bwd = _declare(_flash_attn_bwd, BWD_PARAMS, 6)
    return iface


def install(monkeypatch, iface: types.ModuleType, arch: int = 9) -> None:
    """Put the stand-in where ``from flash_attn.cute import interface`` finds it, on a faked GPU of ``arch``."""
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    package.cute, cute.interface = cute, iface
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface", iface)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fa4, "_device_arch", lambda device: arch)


@pytest.fixture(autouse=True)
def fresh_checks():
    """Every test starts and ends with no remembered check or backend."""
    fa4.disagreement.cache_clear()
    resolve_backend.cache_clear()
    yield
    fa4.disagreement.cache_clear()
    resolve_backend.cache_clear()


@pytest.fixture
def calls(monkeypatch) -> list:
    """The right stand-in on a faked Hopper GPU, fp32 allowed; the list of its calls."""
    seen: list = []
    install(monkeypatch, make_standin(seen))
    monkeypatch.setattr(fa4, "_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    return seen


def qkv(b: int, s: int, hq: int, hkv: int, d: int, dv: int | None = None, sk: int | None = None, seed: int = 0,
        dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random bshd q, k, v and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    sk, dv = sk or s, dv or d
    return (torch.randn(b, s, hq, d, generator=g).to(dtype), torch.randn(b, sk, hkv, d, generator=g).to(dtype),
            torch.randn(b, sk, hkv, dv, generator=g).to(dtype), torch.randn(b, s, hq, dv, generator=g).to(dtype))


def assert_same(got: tuple, want: tuple, tol: float = TOL) -> None:
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("hq,hkv,causal,d,dv,sk,cap", [
    (4, 4, False, 16, 16, None, 0.0), (8, 2, True, 16, 16, None, 0.0), (8, 2, False, 12, 12, None, 0.0),
    (4, 4, True, 16, 24, None, 0.0), (8, 2, False, 16, 16, 40, 0.0), (8, 2, True, 16, 16, None, 5.0),
    (4, 4, False, 16, 16, None, 5.0), (8, 2, True, 64, 64, None, 0.0), (6, 2, True, 128, 128, None, 0.0)],
    ids=["mha-full", "gqa-causal", "gqa-d12-padded", "mha-causal-mla-dv24", "gqa-sq-ne-sk", "gqa-causal-softcap",
         "mha-full-softcap", "gqa-causal-d64", "gqa-causal-d128"])
def test_adapter_equals_torch_backend(calls, hq, hkv, causal, d, dv, sk, cap):
    """Out, lse (FA4's (b, h, sq) natural log, passed on as ds-usp's) and dq, dk, dv through the named backend equal
    the torch backend's to 1e-5 in fp32: padded head dims (12 -> 16), a value head dim of its own, GQA, sq != sk,
    soft-capped scores, and the head dims the GPU check runs (64: the 1.5B Llama shape's, 32 / 8 heads scaled to 8 /
    2; 128: Llama-3.2 3B's, 24 / 8 scaled to 6 / 2)."""
    q, k, v, dout = qkv(2, 24, hq, hkv, d, dv, sk)
    backend, ref = get_backend("flash_attn_4", CPU, torch.float32), get_backend("torch", CPU)
    assert backend.name == "flash_attn_4"
    out, lse = backend.forward(q, k, v, causal, 0.3, cap)
    ref_out, ref_lse = ref.forward(q, k, v, causal, 0.3, cap)
    assert_same((out, lse), (ref_out, ref_lse))
    assert_same(backend.backward(dout, q, k, v, out, lse, causal, 0.3, cap),
                ref.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3, cap))
    assert ("fwd", (2, 24, hq, max(d, dv) + (-max(d, dv) % 8))) in calls  # the padded call ran on the stand-in


def test_backward_from_a_merged_lse(calls):
    """Ring attention's use: each K/V block's forward on FA4, the blocks merged by log-sum-exp, each block's backward
    from the merged out/lse; summed, the gradients equal the torch backend's over the whole sequence."""
    q, k, v, dout = qkv(1, 32, 8, 2, 16)
    backend, ref = get_backend("flash_attn_4", CPU, torch.float32), get_backend("torch", CPU)
    blocks = [slice(0, 12), slice(12, 32)]
    parts = [backend.forward(q, k[:, b], v[:, b], False, 0.25) for b in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(l - lse).transpose(1, 2)[..., None] for o, l in parts)
    grads = [backend.backward(dout, q, k[:, b], v[:, b], out, lse, False, 0.25) for b in blocks]
    ref_out, ref_lse = ref.forward(q, k, v, False, 0.25)
    ref_dq, ref_dk, ref_dv = ref.backward(dout, q, k, v, ref_out, ref_lse, False, 0.25)
    assert_same((out, lse), (ref_out, ref_lse))
    assert_same((grads[0][0] + grads[1][0], torch.cat([g[1] for g in grads], 1), torch.cat([g[2] for g in grads], 1)),
                (ref_dq, ref_dk, ref_dv))


def test_auto_takes_fa4_only_after_it_checked_equal(calls, monkeypatch):
    """"auto" with FA4 usable runs a long enough call on it only after the small forward and backward of its kind
    (2 x 320) checked equal, once; shorter calls stay on the torch backend; results equal the torch backend's."""
    monkeypatch.setattr(fa4, "_AUTO_MIN_PAIRS", 48 * 48)
    auto, ref = get_backend("auto", CPU, torch.float32), get_backend("torch", CPU)
    assert auto.name == "auto(flash_attn_4 > torch)"
    q, k, v, dout = qkv(1, 48, 4, 2, 16)
    out, lse = auto.forward(q, k, v, True)
    assert calls == [("fwd", (2, 320, 4, 16)), ("bwd", (2, 320, 4, 16)), ("fwd", (1, 48, 4, 16))]
    grads = auto.backward(dout, q, k, v, out, lse, True)
    assert calls[3:] == [("bwd", (1, 48, 4, 16))]  # the check is not run again
    ref_out, ref_lse = ref.forward(q, k, v, True)
    assert_same((out, lse, *grads), (ref_out, ref_lse, *ref.backward(dout, q, k, v, ref_out, ref_lse, True)))
    auto.forward(q[:, :40], k[:, :40], v[:, :40], True)  # 40 x 40 pairs: below the threshold
    assert len(calls) == 4
    auto.forward(q, k[:, :, :1].expand(-1, -1, 4, -1), v[:, :, :1].expand(-1, -1, 4, -1), True)  # MHA: a new kind
    assert calls[4:] == [("fwd", (2, 320, 4, 16)), ("bwd", (2, 320, 4, 16)), ("fwd", (1, 48, 4, 16))]
    assert get_backend("auto", CPU, torch.float64) == get_backend("torch", CPU)  # a dtype FA4 cannot take


@pytest.mark.parametrize("wrong", ["log2", "layout", "raises"])
def test_an_fa4_that_differs_is_not_used(monkeypatch, wrong, caplog):
    """A stand-in with its lse in base 2, its lse in another layout, or a backward that raises: the check rejects it,
    "auto" runs the call on the torch backend (and says so), the named backend refuses it by name."""
    seen: list = []
    install(monkeypatch, make_standin(seen, wrong))
    monkeypatch.setattr(fa4, "_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setattr(fa4, "_AUTO_MIN_PAIRS", 0)
    q, k, v, _ = qkv(1, 16, 4, 4, 16)
    got = get_backend("auto", CPU, torch.float32).forward(q, k, v, False)
    assert_same(got, get_backend("torch", CPU).forward(q, k, v, False))
    assert ("fwd", (1, 16, 4, 16)) not in seen and seen[0] == ("fwd", (2, 320, 4, 16))
    with pytest.raises(ValueError, match="usp.attn_backend='flash_attn_4' cannot run this call: it did not check "
                                         "equal on a small forward and backward"):
        get_backend("flash_attn_4", CPU).forward(q, k, v, False)
    assert not fa4.agrees(CPU, torch.float32, 16, False, False, 0.0)


def test_what_fa4_cannot_take_is_refused_by_name(calls, monkeypatch):
    """fp32 (FA4 runs fp16/bf16), head dims over Hopper's 256 or Blackwell's 128 (but 256), Blackwell's head dim 256
    with a soft-cap, an FA4 whose forward has no softcap: refused by name when named; "auto" runs them on torch."""
    monkeypatch.setattr(fa4, "_AUTO_MIN_PAIRS", 0)
    monkeypatch.setattr(fa4, "_DTYPES", (torch.float16, torch.bfloat16))
    with pytest.raises(ValueError, match="float16 and bfloat16 only, the inputs are torch.float32"):
        get_backend("flash_attn_4", CPU, torch.float32)
    monkeypatch.setattr(fa4, "_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    named, auto = get_backend("flash_attn_4", CPU), get_backend("auto", CPU)
    for arch, d, cap, why in ((9, 264, 0.0, "on Hopper supports head dims up to 256, got 264"),
                              (10, 160, 0.0, "on Blackwell supports head dims up to 128 and 256, got 160"),
                              (10, 256, 30.0, "head dim 256 has no softcap")):
        monkeypatch.setattr(fa4, "_device_arch", lambda device, arch=arch: arch)
        q, k, v, _ = qkv(1, 8, 2, 2, d)
        with pytest.raises(ValueError, match=f"usp.attn_backend='flash_attn_4' cannot run this call: .*{why}"):
            named.forward(q, k, v, True, None, cap)
        assert_same(auto.forward(q, k, v, True, None, cap), get_backend("torch", CPU).forward(q, k, v, True, None, cap))
    assert not calls
    install(monkeypatch, make_standin(calls, fwd_params=[p for p in FWD_PARAMS if p != "softcap"]))
    q, k, v, _ = qkv(1, 8, 2, 2, 16)
    with pytest.raises(ValueError, match=r"has an unknown signature \(lacks or requires \['softcap'\]\)"):
        named.forward(q, k, v, True)


def test_where_fa4_is_unavailable(monkeypatch):
    """Not a Hopper/Blackwell CUDA device, an sm80 GPU, not installed: each reason names it; named on CPU, the
    refusal lists what is usable."""
    assert fa4.unavailable_reason(CPU) == "flash_attn_4 needs a Hopper or Blackwell CUDA device (got cpu)"
    with pytest.raises(ValueError, match="usp.attn_backend='flash_attn_4' cannot be used on cpu: flash_attn_4 needs "
                                         "a Hopper or Blackwell CUDA device.*usable on cpu: 'auto', 'torch'"):
        get_backend("flash_attn_4", CPU)
    monkeypatch.setattr(fa4, "_device_arch", lambda device: 8)
    assert "compute capability 8.x" in fa4.unavailable_reason(CPU)
    monkeypatch.setattr(fa4, "_device_arch", lambda device: 9)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable
    assert fa4.unavailable_reason(CPU).startswith("flash_attn_4: not installed (pip install flash-attn-4")
    assert kernels.available_backends(CPU)["flash_attn_4"].startswith("flash_attn_4: not installed")
    assert get_backend("auto", CPU).name == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_fa4_on_a_gpu_equals_torch(d):
    """Where FA4 is installed on a Hopper or Blackwell GPU: it checks equal for bf16 causal GQA at head dim ``d``, and
    the named backend's out, lse and gradients at 4K tokens equal the torch backend's to bf16 rounding (the test
    :func:`ds_usp.kernels.torch_sdpa.results_agree` applies)."""
    device = torch.device("cuda")
    reason = fa4.unavailable_reason(device)
    if reason is not None:
        pytest.skip(reason)
    assert fa4.agrees(device, torch.bfloat16, d, True, True, 0.0), fa4.disagreement(device, torch.bfloat16, d, True,
                                                                                      True, 0.0)
    q, k, v, dout = (x.to(device) for x in qkv(1, 4096, 16, 4, d, dtype=torch.bfloat16))
    named, ref = get_backend("flash_attn_4", device, torch.bfloat16), get_backend("torch", device, torch.bfloat16)
    out, lse = named.forward(q, k, v, True)
    ref_out, ref_lse = ref.forward(q, k, v, True)
    grads = named.backward(dout, q, k, v, out, lse, True)
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, True)
    from ds_usp.kernels.torch_sdpa import results_agree

    assert results_agree((out, lse, *grads), (ref_out, ref_lse, *ref_grads))


def test_the_gpu_check_dry_runs(tmp_path):
    """``benchmarks/fa4_check.py --dry-run`` (CPU, a tiny shape, the torch backend standing in for both kernels) writes
    a row per kernel with its times, its errors against the exact rows and, for FA4's, the ring's merge error."""
    import json

    import fa4_check

    fa4_check.main(["--dry-run", "--seqs", "64", "--head-dims", "16", "--out", str(tmp_path / "fa4.json")])
    saved = json.loads((tmp_path / "fa4.json").read_text())
    assert saved["dry_run"] and saved["provenance"]["command"]
    assert [(r["kernel"], r["head_dim"], r["seq"]) for r in saved["rows"]] == [("cudnn", 16, 64),
                                                                                ("flash_attn_4", 16, 64)]
    for row in saved["rows"]:
        assert max(row["err_out"], row["err_lse"], row["err_dq"]) < 1e-5 and row["fwd_ms"] > 0 and row["bwd_ms"] > 0
    assert saved["rows"][1]["merge_err"] < 1e-5 and saved["rows"][1]["err_dk_vs_cudnn"] == 0
