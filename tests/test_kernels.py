"""Tests of ds_usp.kernels: local attention (out + lse) and its backward against an fp64 reference.

Tolerances: fp32 atol = rtol = 1e-5. bf16 compares the kernel against the fp64 reference evaluated
on the same bf16-rounded inputs; outputs/grads are rounded to bf16 (relative step 2**-8 ~ 4e-3)
and the kernel accumulates with bf16 intermediates, so bf16 uses atol = rtol = 2e-2 for out and
lse and 5e-2 for the gradients (which sum over keys and, for dk/dv, over the q-head group).
"""
from __future__ import annotations

import importlib.util
import math
import sys
import types

import pytest
import torch
from torch import Tensor

from ds_usp.kernels import AttnBackend, available_backends, get_backend, torch_sdpa
from ds_usp.kernels import flash_attn as kernels_flash_attn

CPU = torch.device("cpu")
FWD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
BWD_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
HEADS = [(4, 4), (8, 2), (8, 1)]  # (hq, hkv): MHA, GQA, MQA
HEAD_IDS = ["mha", "gqa", "mqa"]


def reference_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Plain fp64 matmul + softmax attention in bshd; differentiable.

    Args:
        q: (b, sq, hq, d); k, v: (b, sk, hkv, d).
        causal: top-left aligned lower-triangular mask.
        scale: softmax scale.

    Returns:
        out (b, sq, hq, d) and lse (b, hq, sq), both float64.
    """
    groups = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)  # (b, sq, hq, d) -> (b, hq, sq, d)
    kh = k.double().repeat_interleave(groups, dim=2).transpose(1, 2)  # (b, sk, hkv, d) -> (b, hq, sk, d)
    vh = v.double().repeat_interleave(groups, dim=2).transpose(1, 2)  # (b, sk, hkv, d) -> (b, hq, sk, d)
    scores = torch.matmul(qh, kh.transpose(-2, -1)) * scale  # (b, hq, sq, d) @ (b, hq, d, sk) -> (b, hq, sq, sk)
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, hq, sq)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)  # (b, hq, sq, sk) @ (b, hq, sk, d) -> (b, hq, sq, d)
    return out.transpose(1, 2), lse  # (b, hq, sq, d) -> (b, sq, hq, d)


def reference_grads(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """fp64 dq, dk, dv of :func:`reference_attention` for output gradient ``dout`` (autograd)."""
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, _ = reference_attention(qd, kd, vd, causal, scale)
    out.backward(dout.double())
    return qd.grad, kd.grad, vd.grad


def make_qkv(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0,
             device: torch.device = CPU) -> tuple[Tensor, Tensor, Tensor]:
    """Random contiguous bshd q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen)
    k = torch.randn(b, sk, hkv, d, generator=gen)
    v = torch.randn(b, sk, hkv, d, generator=gen)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def assert_close(actual: Tensor, expected: Tensor, tol: float) -> None:
    """Compare in float64 with atol = rtol = tol."""
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


def check_against_reference(backend: AttnBackend, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                            scale: float | None, dout: Tensor | None = None) -> None:
    """Forward (out, lse) and backward (dq, dk, dv) of ``backend`` vs the fp64 reference."""
    ref_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = backend.forward(q, k, v, causal, scale)
    ref_out, ref_lse = reference_attention(q, k, v, causal, ref_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_close(out, ref_out, FWD_TOL[q.dtype])
    assert_close(lse, ref_lse, FWD_TOL[q.dtype])

    if dout is None:
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal, scale)
    ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, dout, causal, ref_scale)
    for got, want, src in ((dq, ref_dq, q), (dk, ref_dk, k), (dv, ref_dv, v)):
        assert got.shape == src.shape and got.dtype == q.dtype
        assert_close(got, want, BWD_TOL[q.dtype])


@pytest.fixture(scope="module")
def torch_backend() -> AttnBackend:
    return get_backend("torch", CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_torch_matches_reference(torch_backend, dtype, causal, hq, hkv):
    q, k, v = make_qkv(2, 24, 24, hq, hkv, 16, dtype)
    check_against_reference(torch_backend, q, k, v, causal, scale=None)


@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("sq,sk", [(9, 23), (23, 9)])
def test_torch_different_q_kv_lengths(torch_backend, hq, hkv, sq, sk):
    q, k, v = make_qkv(2, sq, sk, hq, hkv, 16, torch.float32)
    check_against_reference(torch_backend, q, k, v, causal=False, scale=None)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_custom_scale(torch_backend, causal):
    q, k, v = make_qkv(1, 17, 17, 8, 2, 12, torch.float32)
    check_against_reference(torch_backend, q, k, v, causal, scale=0.37)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_non_contiguous_inputs(torch_backend, causal):
    # Seq slices of bigger buffers (what ring/ulysses code passes) ...
    q_buf, k_buf, v_buf = make_qkv(2, 40, 40, 8, 2, 16, torch.float32)
    q, k, v = q_buf[:, 5:25], k_buf[:, 10:30], v_buf[:, 20:40]
    assert not q.is_contiguous() and not k.is_contiguous()
    dout = torch.randn(2, 60, 8, 16)[:, ::3]
    check_against_reference(torch_backend, q, k, v, causal, scale=None, dout=dout)
    # ... and views whose last dim is not unit-stride (the raw CPU op would misread these).
    q2, k2, v2 = (torch.stack([x, -x], dim=-1)[..., 0] for x in (q, k, v))  # same values, last dim stride 2
    assert q2.stride(-1) == 2
    check_against_reference(torch_backend, q2, k2, v2, causal, scale=None, dout=dout)


def test_torch_backward_with_noncontiguous_out_and_lse(torch_backend):
    q, k, v = make_qkv(2, 16, 16, 8, 2, 16, torch.float32)
    out, lse = torch_backend.forward(q, k, v, True)
    dout = torch.randn_like(out)
    expected = torch_backend.backward(dout, q, k, v, out, lse, True)
    out_nc = torch.stack([out, torch.zeros_like(out)], dim=-1)[..., 0]  # same values, last dim stride 2
    assert out_nc.stride(-1) == 2
    lse_nc = lse.transpose(1, 2).contiguous().transpose(1, 2)  # (b, hq, sq) view of (b, sq, hq) memory
    got = torch_backend.backward(dout, q, k, v, out_nc, lse_nc, True)
    for g, e in zip(got, expected):
        assert_close(g, e, 1e-6)


@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_torch_backward_with_merged_lse(torch_backend, hq, hkv):
    """Per-KV-block backward with the full (merged) out/lse reproduces the full gradients."""
    sk, split = 20, 8
    q, k, v = make_qkv(2, 12, sk, hq, hkv, 16, torch.float32)
    scale = 0.3
    out_full, lse_full = reference_attention(q, k, v, False, scale)
    out_full, lse_full = out_full.float(), lse_full.float()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, dout, False, scale)

    dq_sum = torch.zeros_like(ref_dq)
    for lo, hi in ((0, split), (split, sk)):
        dq, dk, dv = torch_backend.backward(dout, q, k[:, lo:hi], v[:, lo:hi], out_full, lse_full, False, scale)
        dq_sum += dq.double()
        assert_close(dk, ref_dk[:, lo:hi], 1e-5)
        assert_close(dv, ref_dv[:, lo:hi], 1e-5)
    assert_close(dq_sum, ref_dq, 1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
def test_cpu_expanded_kv_path(causal, hq, hkv):
    """The expand-kv-heads fallback (used on torch < 2.9) agrees with the reference."""
    q, k, v = make_qkv(2, 16, 16, hq, hkv, 16, torch.float32)
    out, lse = torch_sdpa._cpu_forward(q, k, v, causal, 0.25, native_gqa=False)
    ref_out, ref_lse = reference_attention(q, k, v, causal, 0.25)
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)
    dout = torch.randn_like(q)
    grads = torch_sdpa._cpu_backward(dout, q, k, v, out, lse, causal, 0.25, native_gqa=False)
    for got, want in zip(grads, reference_grads(q, k, v, dout, causal, 0.25)):
        assert_close(got, want, 1e-5)


def test_torch_output_layout(torch_backend):
    """Outputs are bshd with the documented dtypes; fp64 inputs still give a float32 lse."""
    q, k, v = make_qkv(2, 10, 10, 4, 2, 8, torch.float64)
    out, lse = torch_backend.forward(q, k, v, False)
    assert out.dtype == torch.float64 and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (2, 4, 10)
    dq, dk, dv = torch_backend.backward(torch.ones_like(out), q, k, v, out, lse, False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
    ref_out, ref_lse = reference_attention(q, k, v, False, 1 / math.sqrt(8))
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)


def test_causal_needs_equal_lengths(torch_backend):
    q, k, v = make_qkv(1, 8, 12, 4, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="causal"):
        torch_backend.forward(q, k, v, True)
    with pytest.raises(ValueError, match="causal"):
        torch_backend.backward(q, q, k, v, q, torch.zeros(1, 4, 8), True)


@pytest.mark.parametrize("bad", ["heads", "head_dim", "kv_mismatch", "ndim"])
def test_shape_validation(torch_backend, bad):
    hq = 6 if bad == "heads" else 4  # 6 q heads cannot share 4 kv heads
    q, k, v = make_qkv(1, 8, 8, hq, 4, 8, torch.float32)
    if bad == "head_dim":
        k = k[..., :4]
        v = v[..., :4]
    elif bad == "kv_mismatch":
        v = v[:, :4]
    elif bad == "ndim":
        q = q[0]
    with pytest.raises(ValueError):
        torch_backend.forward(q, k, v, False)


def test_backward_validates_out_and_lse(torch_backend):
    q, k, v = make_qkv(1, 8, 8, 4, 2, 8, torch.float32)
    out, lse = torch_backend.forward(q, k, v, False)
    with pytest.raises(ValueError, match="lse"):
        torch_backend.backward(out, q, k, v, out, lse.transpose(1, 2), False)  # (b, hq, sq) -> (b, sq, hq)
    with pytest.raises(ValueError, match="out"):
        torch_backend.backward(out, q, k, v, out[:, :4], lse, False)


def test_available_backends_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it for the interpreter tests
    reasons = available_backends(CPU)
    assert set(reasons) == {"torch", "flash_attn", "flash_attn_4", "triton"}
    assert reasons["torch"] is None
    assert "CUDA" in reasons["flash_attn"] and "CUDA" in reasons["flash_attn_4"]
    assert "triton" in reasons["triton"]


def test_get_backend_auto_and_torch_on_cpu():
    assert get_backend("auto", CPU).name == "torch"
    assert get_backend("torch", "cpu").name == "torch"


@pytest.mark.parametrize("name", ["triton", "flash_attn", "flash_attn_4", "bogus"])
def test_get_backend_rejects_unusable_on_cpu(name, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        get_backend(name, CPU)
    msg = str(info.value)
    assert "usp.attn_backend" in msg and repr(name) in msg
    assert "'torch'" in msg  # lists what is usable here
    if name == "triton":
        assert "TRITON_INTERPRET" in msg or "not installed" in msg
    if name in ("flash_attn", "flash_attn_4"):
        assert "CUDA" in msg


# ------------------------------------------------- flash_attn adapter against fake flash-attn APIs


class _CustomOpLike:
    """Mimics a torch.library CustomOpDef: opaque ``__call__``, Python function in ``_init_fn``."""

    def __init__(self, fn):
        self._init_fn = fn

    def __call__(self, *args, **kwargs):
        return self._init_fn(*args, **kwargs)


def _fake_flash_attn_interface(style: str, seen: dict) -> types.ModuleType:
    """A CPU stand-in for flash_attn.flash_attn_interface with one version's private API.

    "v2.5": window_size tuple, 8-tuple forward result; "v2.7": window_size_left/right, 4-tuple
    result, functions wrapped like torch.library custom ops. Both compute with the torch backend and
    record the head dim they were called with.
    """
    def fwd(q, k, v, causal, softmax_scale):
        seen["head_dim"] = q.shape[-1]
        return torch_sdpa.attention_forward(q, k, v, causal, softmax_scale)

    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale):
        for buf, grad in zip((dq, dk, dv), torch_sdpa.attention_backward(dout, q, k, v, out, softmax_lse, causal,
                                                                         softmax_scale)):
            buf.copy_(grad)
        return torch.empty(0)

    iface = types.ModuleType("flash_attn.flash_attn_interface")
    if style == "v2.5":
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                return_softmax):
            assert window_size == (-1, -1) and dropout_p == 0.0
            out, lse = fwd(q, k, v, causal, softmax_scale)
            return out, q, k, v, out, lse, None, None

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size, alibi_slopes, deterministic, rng_state=None):
            return bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale)

        iface._flash_attn_forward, iface._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    else:
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, return_softmax):
            assert (window_size_left, window_size_right) == (-1, -1) and softcap == 0.0
            out, lse = fwd(q, k, v, causal, softmax_scale)
            return out, lse, None, None

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                 rng_state=None):
            return bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale)

        iface._flash_attn_forward = _CustomOpLike(_flash_attn_forward)
        iface._flash_attn_backward = _CustomOpLike(_flash_attn_backward)
    return iface


@pytest.mark.parametrize("style", ["v2.5", "v2.7"])
@pytest.mark.parametrize("d", [16, 12])  # 12: the adapter pads to 16 for the kernel
def test_flash_attn_adapter_with_fake_api(monkeypatch, style, d):
    seen: dict = {}
    package = types.ModuleType("flash_attn")
    package.__version__ = "2.5.8" if style == "v2.5" else "2.7.4.post1"
    package.flash_attn_interface = _fake_flash_attn_interface(style, seen)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", package.flash_attn_interface)
    backend = AttnBackend("flash_attn", kernels_flash_attn.attention_forward, kernels_flash_attn.attention_backward)
    q, k, v = make_qkv(2, 12, 12, 8, 2, d, torch.bfloat16)
    check_against_reference(backend, q, k, v, causal=True, scale=0.3)
    assert seen["head_dim"] == 16
    with pytest.raises(ValueError, match="float16/bfloat16"):
        backend.forward(q.float(), k.float(), v.float(), False)


# ------------------------------------------------------------------------------------------- GPU

CUDA_TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}  # TF32 may be on for fp32 matmuls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("d", [64, 20])  # 20: not a multiple of 8 -> zero-padded to 24 on CUDA
def test_torch_cuda_matches_reference(dtype, causal, hq, hkv, d):
    backend = get_backend("torch", "cuda")
    q_buf, k_buf, v_buf = make_qkv(2, 150, 150, hq, hkv, d, dtype, device=torch.device("cuda"))
    q, k, v = q_buf[:, 3:103], k_buf[:, 50:150], v_buf[:, :100]  # non-contiguous seq slices, sq = sk = 100
    _check_cuda(backend, q, k, v, causal, CUDA_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["torch", "flash_attn"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_cuda_merged_lse_and_cross_lengths(backend_name, dtype, hq, hkv):
    if available_backends("cuda")[backend_name] is not None:
        pytest.skip(available_backends("cuda")[backend_name])
    backend = get_backend(backend_name, "cuda")
    q, k, v = make_qkv(2, 70, 130, hq, hkv, 64, dtype, device=torch.device("cuda"))
    tol = CUDA_TOL[dtype]
    _check_cuda(backend, q, k, v, False, tol)
    out_full, lse_full = backend.forward(q, k, v, False, 0.2)
    dout = torch.randn_like(q)
    ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, dout, False, 0.2)
    dq_sum = torch.zeros_like(ref_dq)
    for lo, hi in ((0, 64), (64, 130)):
        dq, dk, dv = backend.backward(dout, q, k[:, lo:hi], v[:, lo:hi], out_full, lse_full, False, 0.2)
        dq_sum += dq.double()
        assert_close(dk, ref_dk[:, lo:hi], tol)
        assert_close(dv, ref_dv[:, lo:hi], tol)
    assert_close(dq_sum, ref_dq, tol)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn not installed")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("d", [64, 20])
def test_flash_attn_matches_reference(causal, hq, hkv, d):
    backend = get_backend("flash_attn", "cuda")
    q, k, v = make_qkv(2, 100, 100, hq, hkv, d, torch.bfloat16, device=torch.device("cuda"))
    _check_cuda(backend, q, k, v, causal, CUDA_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8)], ids=["gqa", "mha"])
def test_cudnn_attention_is_taken_where_it_agrees_and_matches_flash_at_length(causal, hq, hkv, monkeypatch,
                                                                             request):
    """On a GPU whose torch has cuDNN's attention, the torch backend takes it for bf16 (its first call checked it
    against the flash op) from 16K tokens on, and there its output, lse and gradients equal the flash op's to bf16
    rounding; ``DS_USP_CUDNN_ATTENTION=0`` turns it off, and shorter calls keep the flash op (faster there)."""
    from ds_usp.kernels import torch_sdpa

    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        pytest.skip("this torch has no cuDNN attention op")
    q, k, v = make_qkv(1, 16384, 16384, hq, hkv, 64, torch.bfloat16, device=torch.device("cuda"))
    dout = torch.randn_like(q)
    assert torch_sdpa._cuda_use_cudnn(q, k, v, causal)
    assert not torch_sdpa._cuda_use_cudnn(q[:, :8192], k[:, :8192], v[:, :8192], causal)
    got = torch_sdpa.attention_forward(q, k, v, causal, 0.125)
    got_grads = torch_sdpa.attention_backward(dout, q, k, v, *got, causal, 0.125)
    monkeypatch.setenv("DS_USP_CUDNN_ATTENTION", "0")
    assert torch_sdpa._cuda_use_cudnn(q, k, v, causal)  # read once: a later change needs the cache cleared
    torch_sdpa.cudnn_attention_enabled.cache_clear()
    request.addfinalizer(torch_sdpa.cudnn_attention_enabled.cache_clear)  # read again, as the environment is then
    assert not torch_sdpa._cuda_use_cudnn(q, k, v, causal)
    want = torch_sdpa.attention_forward(q, k, v, causal, 0.125)
    want_grads = torch_sdpa.attention_backward(dout, q, k, v, *want, causal, 0.125)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got, *got_grads), (*want, *want_grads)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        diff, size = float((a.float() - b.float()).abs().max()), float(b.float().abs().max())
        assert diff <= 2e-2 * size + 1e-3, (name, diff, size)


def _check_cuda(backend: AttnBackend, q: Tensor, k: Tensor, v: Tensor, causal: bool, tol: float) -> None:
    """Forward + backward of a CUDA backend vs the fp64 reference with one tolerance."""
    out, lse = backend.forward(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref_out, ref_lse = reference_attention(q, k, v, causal, scale)
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, tol)
    dout = torch.randn_like(q)
    grads = backend.backward(dout, q, k, v, out, lse, causal)
    for got, want, src in zip(grads, reference_grads(q, k, v, dout, causal, scale), (q, k, v)):
        assert got.shape == src.shape and got.dtype == q.dtype
        assert_close(got, want, tol)


def test_cudnn_switch_is_read_once(monkeypatch, request):
    """``DS_USP_CUDNN_ATTENTION`` is read at the first long CUDA call, not on every kernel call (issue 63); a later
    change of it takes effect after ``cudnn_attention_enabled.cache_clear()``."""
    request.addfinalizer(torch_sdpa.cudnn_attention_enabled.cache_clear)
    monkeypatch.setenv("DS_USP_CUDNN_ATTENTION", "0")
    torch_sdpa.cudnn_attention_enabled.cache_clear()
    assert not torch_sdpa.cudnn_attention_enabled()
    monkeypatch.setenv("DS_USP_CUDNN_ATTENTION", "1")
    assert not torch_sdpa.cudnn_attention_enabled()  # kept
    torch_sdpa.cudnn_attention_enabled.cache_clear()
    assert torch_sdpa.cudnn_attention_enabled()


def test_auto_never_picks_flash_attn(monkeypatch):
    """"auto" takes torch even where flash-attn imports (it has never run on a GPU of this project); an explicit
    choice still gets it, and is refused for fp32 inputs (flash-attn runs fp16/bf16 only)."""
    import ds_usp.kernels as kernels

    monkeypatch.setattr(kernels, "available_backends", lambda device: {"torch": None, "flash_attn": None,
                                                                        "triton": None})
    for dtype in (torch.bfloat16, torch.float16, torch.float32, None):
        assert get_backend("auto", "cuda", dtype).name == "torch"
    assert get_backend("flash_attn", "cuda", torch.bfloat16).name == "flash_attn"
    with pytest.raises(ValueError, match="supports float16 and bfloat16 only, the inputs are torch.float32"):
        get_backend("flash_attn", "cuda", torch.float32)


# ------------------------------------------------------------------------------------------- bands


@pytest.mark.parametrize("nq,nk", [(5, 5), (7, 3), (3, 9), (40, 40), (37, 51), (1, 1)])
def test_band_pieces_hold_each_allowed_pair_once(nq, nk):
    """The cut of a band rectangle into full, causal and masked pieces covers exactly its pairs, once each."""
    from ds_usp.kernels.band import band_mask, band_pieces

    for lo in (None, -20, -5, -1, 0, 2):
        for hi in (None, -3, 0, 1, 4, 30):
            if lo is not None and hi is not None and lo > hi:
                continue
            cover = torch.zeros(nq, nk, dtype=torch.int)
            for piece in band_pieces(nq, nk, lo, hi, tile=8):
                rows, cols = piece.q.stop - piece.q.start, piece.k.stop - piece.k.start
                if piece.kind == "full":
                    keep = torch.ones(rows, cols, dtype=torch.bool)
                elif piece.kind == "causal":
                    assert rows == cols
                    keep = torch.ones(rows, cols, dtype=torch.bool).tril()
                else:
                    keep = band_mask(rows, cols, piece.lo, piece.hi, CPU)
                cover[piece.q, piece.k] += keep.int()
            assert torch.equal(cover, band_mask(nq, nk, lo, hi, CPU).int()), (lo, hi)


@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_masked_tiles_fused_cpu_kernel_matches_math(hq, hkv):
    """The CPU fused kernel with an additive mask gives the exact math's out, lse and grads, empty rows included."""
    from ds_usp.kernels import band

    q, k, v = make_qkv(2, 12, 9, hq, hkv, 16, torch.float32)
    keep = band.band_mask(12, 9, -4, 2, CPU)
    keep[3] = False  # a row that sees nothing
    out, lse = torch_sdpa.masked_forward(q, k, v, keep, 0.3)
    want_out, want_lse = band.masked_forward(q, k, v, keep, 0.3)
    assert torch.isneginf(lse[:, :, 3]).all() and (out[:, 3] == 0).all()
    assert_close(out, want_out, 1e-5)
    assert_close(lse.masked_fill(lse.isinf(), 0), want_lse.masked_fill(want_lse.isinf(), 0), 1e-5)
    dout = torch.randn_like(q)
    for got, want in zip(torch_sdpa.masked_backward(dout, q, k, v, out, lse, keep, 0.3),
                         band.masked_backward(dout, q, k, v, want_out, want_lse, keep, 0.3)):
        assert_close(got, want, 1e-5)


# ------------------------------------------------------------------------------ cuDNN's layout (CPU)


class _CudnnStandIn:
    """``torch.ops.aten`` with cuDNN's two attention ops replaced by the CPU flash ops, recording the shape, strides
    and bhsd-over-bshd-contiguity of every tensor they receive."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple, tuple, bool]] = []

    def __getattr__(self, name: str):
        return getattr(torch.ops.aten, name)

    def _record(self, op: str, *xs: Tensor) -> None:
        # what _cudnn_agrees validated: bhsd views of bshd-contiguous tensors
        self.seen += [(op, tuple(x.shape), x.stride(), x.transpose(1, 2).is_contiguous()) for x in xs]

    def _scaled_dot_product_cudnn_attention(self, q, k, v, attn_bias, compute_lse, dropout_p, is_causal,
                                            return_debug_mask, scale=None):
        self._record("forward", q, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse.unsqueeze(-1)  # lse as cuDNN's: (b, h, sq, 1)

    def _scaled_dot_product_cudnn_attention_backward(self, dout, q, k, v, out, lse, seed, offset, attn_bias,
                                                     cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale=None):
        self._record("backward", dout, q, k, v, out)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.squeeze(-1), 0.0, is_causal, scale=scale)


def test_cudnn_gets_only_the_layout_it_was_validated_on(monkeypatch):
    """The ring hands the kernel strided K/V blocks (slices of ``cat([k, v])``, and of those the parts a mask keeps);
    cuDNN's aten op, called without SDPA's layout checks, was validated (:func:`torch_sdpa._cudnn_agrees`) on bhsd
    views of bshd-contiguous tensors only. With the cuDNN path forced on CPU (its two ops stood in for by the CPU
    flash ops), every tensor it receives in a ring's forward and backward has that layout, and the ring's results
    equal the CPU torch backend's."""
    from ds_usp.attention.masks import MaskSpec
    from ds_usp.attention.ring import RingSpec, ring_backward, ring_forward
    from ds_usp.native import TorchOps

    stand_in = _CudnnStandIn()
    monkeypatch.setattr(torch_sdpa, "_aten", stand_in)
    handed = []  # whether the K/V the ring handed the kernel entry were contiguous

    def forward(q, k, v, causal, scale, softcap=0.0):
        handed.append(k.is_contiguous() and v.is_contiguous())
        return torch_sdpa._cuda_cudnn_forward(q, k, v, causal, scale)

    def backward(dout, q, k, v, out, lse, causal, scale, softcap=0.0):
        handed.append(k.is_contiguous() and v.is_contiguous())
        return torch_sdpa._cuda_cudnn_backward(dout, q, k, v, out, lse, causal, scale)

    cudnn = AttnBackend("torch", forward, backward)
    q, k, v = make_qkv(2, 24, 24, 4, 2, 8, torch.float32, device=CPU)
    dout = torch.randn_like(q)
    spec = RingSpec(group=None, ranks=(0,), rank=0, layout="contiguous", padded_len=24)
    mask = MaskSpec(causal=True, seq_len=21)  # padding: the block is cut, the loop over K/V blocks runs
    results = []
    for backend in (cudnn, get_backend("torch", CPU)):
        out, lse = ring_forward(q, k, v, spec, mask, 0.3, backend, TorchOps())
        results.append((out, lse, *ring_backward(dout, q, k, v, out, lse, spec, mask, 0.3, backend, TorchOps())))
    assert handed and not any(handed), "the ring handed the kernel contiguous K/V: the strided case is not tested"
    assert {op for op, *_ in stand_in.seen} == {"forward", "backward"}
    strided = [(op, shape, stride) for op, shape, stride, packed in stand_in.seen if not packed]
    assert not strided, f"cuDNN's op received layouts it was not validated on: {strided}"
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
