"""Local attention on PyTorch's fused scaled-dot-product-attention ATen ops (CPU and CUDA).

All public functions take and return "bshd" tensors (batch, seq, heads, head_dim); the ATen ops
work on "bhsd", so inputs are passed as ``transpose(1, 2)`` views (no copy) and results are
transposed back.

Facts about the ops that this module relies on (checked on torch 2.13, see tests/test_kernels.py):

* CPU ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) honour arbitrary strides
  of q/k/v/out/dout EXCEPT the last one: an input whose last dim is not unit-stride is read as if
  it were and silently gives wrong results (the public SDPA entry point filters such inputs out
  before dispatching here). Tensors are therefore made last-dim-contiguous first (a no-op for
  the usual seq slices). The returned out/grads are bhsd views of bshd-contiguous memory, so
  transposing back yields contiguous bshd tensors without a copy. lse comes back as a
  (b, h, s)-shaped view of (b, s, h) memory; it is made contiguous (it is small).
* The CPU ops accept hq != hkv (GQA/MQA, forward and backward, dk/dv summed over each q-head
  group) since torch 2.9 (pytorch/pytorch#157893). Older kernels index k/v with the q-head index,
  so on those versions kv heads are expanded before the call and dk/dv summed after.
* CUDA ``_scaled_dot_product_flash_attention`` (fp16/bf16, head_dim % 8 == 0, head_dim <= 256,
  sm80+) supports GQA natively and needs lse as a contiguous (b, h, sq) fp32 tensor in backward.
* CUDA ``_scaled_dot_product_cudnn_attention`` (+ ``_backward``; fp16/bf16, equal q/k/v head dims that are a
  multiple of 8, at most 128) is taken before the flash op where it is there and agrees with it: the first call of
  each dtype, head size, GQA-or-not and causal-or-not runs both ops on a small random problem, forward and
  backward, and compares (:func:`_cudnn_agrees`; ``DS_USP_CUDNN_ATTENTION=0`` turns it off, read once:
  :func:`cudnn_attention_enabled`). It takes GQA natively, returns its lse as (b, h, sq, 1) fp32, wants it back in
  that shape, and a None ``attn_bias`` / ``cum_seq`` in its backward (an undefined tensor: the dense kernel). It gets
  only the layout it was validated on: bhsd views of bshd-contiguous tensors (strided inputs, such as the ring's K/V
  blocks, are copied first). It is taken for calls of at least :data:`_CUDNN_MIN_PAIRS` query-key pairs: measured on
  an H200 (torch 2.11, cuDNN 9.19, heads 32/8 x 64, bf16, causal; docs/benchmarks.md), it ran 1.5x the flash op's
  speed forward and backward at 32K to 128K tokens, as fast at 8K and 16K, and slower below (2K: 0.4 ms forward
  against 0.2).
* CUDA ``_scaled_dot_product_efficient_attention`` (used for everything else, notably fp32)
  requires hq == hkv, returns lse padded along seq to a multiple of 32 (unpadded on ROCm), and
  its backward wants ``out`` packed bshd-contiguous and lse in the padded layout.
* On CUDA, head dims that are not a multiple of 8 are zero-padded to one before either op: the
  memory-efficient op has no fp16/bf16 kernel for them on an H100 (``cutlassF: no kernel found to
  launch``, torch 2.11), and zero columns change neither ``q.k`` nor the output's real columns.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_usp.kernels import band
from ds_usp.kernels.band import math_backward, math_forward

__all__ = ["unavailable_reason", "attention_forward", "attention_backward", "cudnn_attention_enabled", "results_agree"]

_aten = torch.ops.aten

# The CPU flash kernels handle hq != hkv natively from torch 2.9 on (pytorch/pytorch#157893).
_CPU_NATIVE_GQA: bool = torch.__version__ >= "2.9"
# The CUDA memory-efficient kernel pads its lse along seq to this multiple (not on ROCm).
_EFFICIENT_LSE_ALIGN: int = 32
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Head dims the CUDA ops are given are multiples of this (zero-padded otherwise).
_CUDA_HEAD_DIM_ALIGN: int = 8


def unavailable_reason(device: torch.device) -> str | None:
    """Why the torch backend cannot run on ``device``.

    Args:
        device: the device attention will run on.

    Returns:
        None if the backend is usable there, else a one-line reason.
    """
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "torch: CUDA is not available in this torch build"
    return f"torch: no fused attention op wired up for device type {device.type!r} (cpu and cuda only)"


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention output and log-sum-exp with a fused ATen op (soft-capped scores: blocked fp32 math).

    Args:
        q: (b, sq, hq, d) queries.
        k: (b, sk, hkv, d) keys, hq % hkv == 0.
        v: (b, sk, hkv, d) values.
        causal: top-left aligned causal mask (callers guarantee sq == sk).
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none); no fused ATen op has one, so capped attention runs in
            :func:`ds_usp.kernels.band.math_forward` (exact fp32, tiled, never ``sq x sk`` at once).

    Returns:
        out (b, sq, hq, d) in q.dtype and lse (b, hq, sq) float32, contiguous.

    Raises:
        ValueError: on a device other than cpu/cuda.
    """
    if softcap:
        return math_forward(q, k, v, None, 0 if causal else None, scale, softcap)
    if q.device.type == "cuda":
        d = q.shape[-1]
        if d % _CUDA_HEAD_DIM_ALIGN:
            out, lse = attention_forward(*(_pad_head_dim(x) for x in (q, k, v)), causal, scale)
            return out[..., :d].contiguous(), lse
        if _cuda_use_cudnn(q, k, v, causal):
            return _cuda_cudnn_forward(q, k, v, causal, scale)
        if _cuda_use_flash(q):
            return _cuda_flash_forward(q, k, v, causal, scale)
        return _cuda_efficient_forward(q, k, v, causal, scale)
    if q.device.type == "cpu":
        return _cpu_forward(q, k, v, causal, scale, native_gqa=_CPU_NATIVE_GQA)
    raise ValueError(unavailable_reason(q.device))


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention given the final output and log-sum-exp.

    ``out``/``lse`` are used as given (they may be the merge over several KV blocks of which
    k/v is one), so dk/dv are this block's gradients and dq its contribution.

    Args:
        dout: (b, sq, hq, d) gradient of the output.
        q: (b, sq, hq, d) queries.
        k: (b, sk, hkv, d) keys.
        v: (b, sk, hkv, d) values.
        out: (b, sq, hq, d) attention output the softmax statistics belong to.
        lse: (b, hq, sq) log-sum-exp (any float dtype).
        causal: top-left aligned causal mask (sq == sk).
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none; see :func:`attention_forward`).

    Returns:
        dq (b, sq, hq, d), dk (b, sk, hkv, d), dv (b, sk, hkv, d), all in q.dtype.

    Raises:
        ValueError: on a device other than cpu/cuda.
    """
    if softcap:
        return math_backward(dout, q, k, v, out, lse, None, 0 if causal else None, scale, softcap)
    if q.device.type == "cuda":
        d = q.shape[-1]
        if d % _CUDA_HEAD_DIM_ALIGN:
            grads = attention_backward(*(_pad_head_dim(x) for x in (dout, q, k, v, out)), lse, causal, scale)
            return tuple(g[..., :d].contiguous() for g in grads)  # type: ignore[return-value]
        if _cuda_use_cudnn(q, k, v, causal):
            return _cuda_cudnn_backward(dout, q, k, v, out, lse, causal, scale)
        if _cuda_use_flash(q):
            return _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale)
        return _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale)
    if q.device.type == "cpu":
        return _cpu_backward(dout, q, k, v, out, lse, causal, scale, native_gqa=_CPU_NATIVE_GQA)
    raise ValueError(unavailable_reason(q.device))


# ----------------------------------------------------------------------------------------- helpers


def _unit_last_stride(x: Tensor) -> Tensor:
    """``x`` itself if its last dim is unit-stride, else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _bhsd(x: Tensor) -> Tensor:
    """View of a bshd tensor in the bhsd layout the ATen ops take, last dim unit-stride."""
    return _unit_last_stride(x).transpose(1, 2)  # (b, s, h, d) -> (b, h, s, d)


def _bshd(x: Tensor) -> Tensor:
    """View of a bhsd op result back in bshd."""
    return x.transpose(1, 2)  # (b, h, s, d) -> (b, s, h, d)


def _expand_kv_heads(x: Tensor, groups: int) -> Tensor:
    """Repeat each kv head ``groups`` times so q head i meets kv head i // groups."""
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=2)  # (b, sk, hkv, d) -> (b, sk, hkv * groups, d)


def _sum_kv_groups(grad: Tensor, groups: int) -> Tensor:
    """Inverse of :func:`_expand_kv_heads` for gradients: sum each group of expanded heads."""
    if groups == 1:
        return grad
    b, s, h, d = grad.shape
    return grad.reshape(b, s, h // groups, groups, d).sum(dim=3)  # (b, s, hkv * g, d) -> (b, s, hkv, d)


# --------------------------------------------------------------------------------------------- CPU


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                 native_gqa: bool) -> tuple[Tensor, Tensor]:
    groups = 1 if native_gqa else q.shape[2] // k.shape[2]
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(_expand_kv_heads(k, groups)), _bhsd(_expand_kv_heads(v, groups)), 0.0, causal,
        scale=scale)
    # lse: (b, hq, sq) view of (b, sq, hq) memory; fp64 inputs give an fp64 lse.
    return _bshd(out), lse.to(torch.float32).contiguous()


def _cpu_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, native_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    groups = 1 if native_gqa else q.shape[2] // k.shape[2]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernel's accumulate type
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(_expand_kv_heads(k, groups)), _bhsd(_expand_kv_heads(v, groups)),
        _bhsd(out), lse.to(lse_dtype), 0.0, causal, scale=scale)
    return _bshd(dq), _sum_kv_groups(_bshd(dk), groups), _sum_kv_groups(_bshd(dv), groups)


# -------------------------------------------------------------------------------------------- CUDA


def _pad_head_dim(x: Tensor) -> Tensor:
    """``x`` with its last dim zero-padded to a multiple of :data:`_CUDA_HEAD_DIM_ALIGN`."""
    return F.pad(x, (0, -x.shape[-1] % _CUDA_HEAD_DIM_ALIGN))


def _cuda_use_flash(q: Tensor) -> bool:
    """Whether the CUDA FlashAttention-2 op applies (else the memory-efficient op is used)."""
    head_dim = q.shape[-1]
    return (q.dtype in _FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _unused_rng_state(device: torch.device) -> Tensor:
    """Placeholder philox seed/offset: only read by the kernels when dropout_p > 0."""
    return torch.zeros((), dtype=torch.int64, device=device)


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = _aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]  # (b, hq, sq, d), (b, hq, sq) fp32
    return _bshd(out), lse.contiguous()


def _cuda_flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                         scale: float) -> tuple[Tensor, Tensor, Tensor]:
    rng = _unused_rng_state(q.device)
    # cum_seq_q/k undefined (None) selects the dense (non-varlen) kernel; GQA is handled inside.
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.to(torch.float32).contiguous(), None, None,
        q.shape[1], k.shape[1], 0.0, causal, rng, rng, scale=scale)
    return _bshd(dq), _bshd(dk), _bshd(dv)


_CUDNN_MAX_HEAD_DIM = 128
_CUDNN_MIN_PAIRS = 16384 * 16384  # query x key lengths from which cuDNN's op is taken (below it, the flash op's)


@functools.cache
def cudnn_attention_enabled() -> bool:
    """Whether cuDNN's attention op may be taken at all: ``DS_USP_CUDNN_ATTENTION`` is not ``"0"``.

    The variable is read once, at the first long CUDA call (not on every kernel call); a change of it later in the
    process takes effect after ``cudnn_attention_enabled.cache_clear()``.
    """
    return os.environ.get("DS_USP_CUDNN_ATTENTION", "1") != "0"


def _cuda_use_cudnn(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """Whether cuDNN's attention op runs this call: it is long enough, applies (see the module docstring) and agreed
    with the flash op on this device for these dtypes, head size, GQA and mask (:func:`_cudnn_agrees`, once per
    kind)."""
    d = q.shape[-1]
    if (q.shape[1] * k.shape[1] < _CUDNN_MIN_PAIRS or q.dtype not in _FLASH_DTYPES
            or k.shape[-1] != d or v.shape[-1] != d or d % 8 or d > _CUDNN_MAX_HEAD_DIM
            or not cudnn_attention_enabled()
            or not hasattr(_aten, "_scaled_dot_product_cudnn_attention") or not _cuda_use_flash(q)):
        return False
    return _cudnn_agrees(q.device.index or 0, q.dtype, d, q.shape[2] != k.shape[2], causal)


def _packed_bhsd(x: Tensor) -> Tensor:
    """The bhsd view of a bshd-contiguous copy of ``x`` (no copy when it is one already): the only layout cuDNN's op
    gets, the one :func:`_cudnn_agrees` validated it on. The ring hands the kernels strided views (a K/V block is a
    slice of ``cat([k, v])``, a part of it a slice of that); the aten op is called without SDPA's layout checks."""
    return x.contiguous().transpose(1, 2)  # (b, s, h, d) -> (b, h, s, d)


def _cuda_cudnn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = _aten._scaled_dot_product_cudnn_attention(_packed_bhsd(q), _packed_bhsd(k), _packed_bhsd(v), None, True,
                                                     0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]  # (b, hq, sq, d), (b, hq, sq, 1) fp32
    b, sq, h, _ = q.shape
    return _bshd(out), lse.reshape(b, h, sq).contiguous()


def _cuda_cudnn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                         scale: float) -> tuple[Tensor, Tensor, Tensor]:
    rng = _unused_rng_state(q.device)
    # attn_bias and cum_seq_q/k None: undefined tensors, the dense kernel without a bias; GQA is handled inside
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        *(_packed_bhsd(x) for x in (dout, q, k, v, out)), lse.to(torch.float32).contiguous().unsqueeze(-1),
        rng, rng, None, None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return _bshd(dq), _bshd(dk), _bshd(dv)


@functools.lru_cache(maxsize=None)
def _cudnn_agrees(device: int, dtype: torch.dtype, head_dim: int, gqa: bool, causal: bool) -> bool:
    """Whether cuDNN's op gives the flash op's output, lse and gradients (to the dtype's rounding) on a small random
    problem of this kind: 2 x 320 queries against 320 keys, 4 query heads on 2 or 4 kv heads. An op that raises or
    differs is not used (the flash op is)."""
    g = torch.Generator(device=f"cuda:{device}").manual_seed(0)
    q, dout = (torch.randn(2, 320, 4, head_dim, device=f"cuda:{device}", dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 320, 2 if gqa else 4, head_dim, device=f"cuda:{device}", dtype=dtype, generator=g)
            for _ in range(2))
    scale = head_dim ** -0.5
    try:
        out, lse = _cuda_cudnn_forward(q, k, v, causal, scale)
        grads = _cuda_cudnn_backward(dout, q, k, v, out, lse, causal, scale)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    ref_out, ref_lse = _cuda_flash_forward(q, k, v, causal, scale)
    ref_grads = _cuda_flash_backward(dout, q, k, v, ref_out, ref_lse, causal, scale)
    return results_agree((out, lse, *grads), (ref_out, ref_lse, *ref_grads))


def results_agree(got: tuple[Tensor, ...], want: tuple[Tensor, ...]) -> bool:
    """Whether a kernel's ``(out, lse, dq, dk, dv)`` equal a reference's to fp16/bf16 rounding: each finite and
    within ``rel * max|want| + 1e-3`` of it, ``rel`` 1e-3 for the lse, 2e-2 for out, 3e-2 for the gradients (the
    test by which a kernel is taken on a device: :func:`_cudnn_agrees`, :func:`ds_usp.kernels.flash_attn4.agrees`)."""
    if len(got) != 5 or len(want) != 5:
        return False
    for a, b, rel in zip(got, want, (2e-2, 1e-3, 3e-2, 3e-2, 3e-2)):
        if a.shape != b.shape:
            return False
        a, b = a.float(), b.float()
        if not bool(torch.isfinite(a).all()) or float((a - b).abs().max()) > rel * float(b.abs().max()) + 1e-3:
            return False
    return True


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    groups = q.shape[2] // k.shape[2]
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        _bhsd(q), _bhsd(_expand_kv_heads(k, groups)), _bhsd(_expand_kv_heads(v, groups)), None, True, 0.0, causal,
        scale=scale)
    # lse: (b, hq, round_up(sq, 32)) -> (b, hq, sq)
    return _bshd(out), lse[..., : q.shape[1]].contiguous()


def _cuda_efficient_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    groups = q.shape[2] // k.shape[2]
    lse = lse.to(torch.float32).contiguous()
    if torch.version.hip is None:
        pad = -lse.shape[-1] % _EFFICIENT_LSE_ALIGN
        lse = F.pad(lse, (0, pad))  # (b, hq, sq) -> (b, hq, round_up(sq, 32)), the layout forward returns
    rng = _unused_rng_state(q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(_expand_kv_heads(k, groups)), _bhsd(_expand_kv_heads(v, groups)), None,
        _bhsd(out.contiguous()), lse, rng, rng, 0.0, [True, True, True, False], causal, scale=scale)
    return _bshd(dq), _sum_kv_groups(_bshd(dk), groups), _sum_kv_groups(_bshd(dv), groups)


# ----------------------------------------------------------------------------- masked tiles (CPU)


def masked_forward(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float,
                   softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention with an explicit ``(sq, sk)`` bool mask, rows with no key at ``lse = -inf`` and zero output.

    On CPU the fused kernel takes the mask as an additive bias (it returns ``lse = 0`` for a row with no
    key, which is fixed here); elsewhere the exact fp32 math of :mod:`ds_usp.kernels.band`.

    Args:
        q: ``(b, sq, hq, d)``.
        k: ``(b, sk, hkv, d)``.
        v: ``(b, sk, hkv, d)``.
        keep: ``(sq, sk)`` bool, True where the pair meets.
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none; then the math path).

    Returns:
        out ``(b, sq, hq, d)`` in q's dtype and lse ``(b, hq, sq)`` fp32.
    """
    if q.device.type != "cpu" or not _CPU_NATIVE_GQA or softcap:
        return band.masked_forward(q, k, v, keep, scale, softcap)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, False, attn_mask=_bias(keep, q.dtype), scale=scale)
    empty = ~keep.any(dim=1)  # (sq,) rows that see no key (filled whether any is: no host read of the mask)
    lse = lse.to(torch.float32).masked_fill(empty, float("-inf")).contiguous()
    return _bshd(out).masked_fill(empty[:, None, None], 0), lse


def masked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, keep: Tensor,
                    scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`masked_forward` given the final ``out``/``lse`` of the rows.

    Returns:
        dq, dk, dv in the inputs' dtypes.
    """
    if q.device.type != "cpu" or not _CPU_NATIVE_GQA or softcap:
        return band.masked_backward(dout, q, k, v, out, lse, keep, scale, softcap)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse.to(lse_dtype).masked_fill(torch.isneginf(lse), float("inf"))  # a row that sees nothing: p = 0, not NaN
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, False,
        attn_mask=_bias(keep, q.dtype), scale=scale)
    return _bshd(dq), _bshd(dk), _bshd(dv)


def _bias(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """``(sq, sk)`` bool -> additive ``(1, 1, sq, sk)`` bias: 0 where kept, -inf elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))[None, None]
