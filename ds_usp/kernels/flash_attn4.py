"""Adapter over FlashAttention-4 (the ``flash-attn-4`` wheel, imported as ``flash_attn.cute``): Hopper and Blackwell.

FlashAttention-4 is FlashAttention written in NVIDIA's CuTe DSL: a pure-Python wheel whose kernels are compiled at
run time (on the first call of each kind, then cached). It is imported lazily, inside the functions; importing this
module does nothing. The adapter calls the private ``flash_attn.cute.interface._flash_attn_fwd`` and
``_flash_attn_bwd``: the public ``flash_attn_func`` is an autograd function whose backward starts from the lse it
saved itself, and the ring needs a backward from the merged ``(out, lse)`` of all its blocks (as with flash-attn 2).

What this module relies on, read from the 4.0.0b36 wheel (PyPI's newest; PyPI has 4.0.0b3 to b36 and a 0.0.1
placeholder, all pre-releases) and the ``fa4-v4.0.0.beta0`` and ``fa4-v4.0.0.beta20`` tags of
Dao-AILab/flash-attention (``flash_attn/cute/interface.py``, ``softmax.py``, ``utils.py``,
``flash_bwd_preprocess.py``):

* Layout bshd, ds-usp's own. GQA/MQA natively (``num_head % num_head_kv == 0``); the backward returns dk/dv with
  k/v's heads (summed over each group).
* ``_flash_attn_fwd(q, k, v, ..., softmax_scale=, causal=, softcap=, return_lse=True)`` returns a tuple whose first
  two items are ``out`` (q's dtype) and ``lse``: two items in beta0, four in beta20, five in b36.
* lse: float32, a contiguous ``(b, h, sq)``, natural log with the softmax scale in it (the kernels compute
  ``(max * scale * log2(e) + log2(sum)) * ln(2)``, ``softmax.py`` ``finalize``): ds-usp's convention exactly, so it is
  passed on as it comes (checked: shape and dtype). A row that sees no key gets ``-inf``.
* ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=, softcap=)`` (this order in every version read)
  returns ``(dq, dk, dv)``; it asserts lse ``(b, h, sq)`` float32 and out/dout in q's dtype. It turns an lse of
  ``-inf`` into 0 (``flash_bwd_preprocess.py``), so a row without a key must not reach it; ds-usp gives it full and
  causal blocks with ``sq == sk`` only, where every row has a key.
* softcap: ``softcap * tanh(scale * q.k / softcap)`` (a score_mod applied after the scale, ``utils.py``), ds-usp's.
  The forward reads 0 as none; the backward must get 0.0 (None would build a soft-cap of None).
* causal is bottom-right aligned; ds-usp asks for it only with ``sq == sk``, where it is top-left too.
* dtypes fp16/bf16 (fp8 is forward-only, unused). Head dims (``_validate_head_dims``): on sm90 8 to 256, multiples of
  8; on sm100/sm110 8 to 128 or 256 (and 192 with a value head dim of 128, which ds-usp's equal padded dims never
  are); the sm100 head-dim-256 backward has no softcap. The kernels pick their architecture from the *current* CUDA
  device (``FLASH_ATTENTION_ARCH`` overrides it): the adapter makes the tensors' device current for each call.
* Its imports: ``cutlass`` (nvidia-cutlass-dsl, whose ``nvidia-cutlass-dsl-libs-cu12``/``-cu13`` wheels are about
  92 MB), ``quack`` (quack-kernels), apache-tvm-ffi, torch-c-dlpack-ext, einops.

Where it is used: named (``usp.attn_backend = "flash_attn_4"``), every call is refused by name (ValueError) if FA4
cannot take it (dtype, head dim) or if FA4 has not checked equal to PyTorch's attention on the device for that kind
of call (:func:`agrees`); under ``"auto"`` such a call runs on the torch backend instead (:func:`takes`).

Not run on a GPU by this project: the adapter is tested on CPU against a stand-in of the API above
(tests/test_flash_attn4.py); ``benchmarks/fa4_check.py`` is the GPU check.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_usp.kernels import torch_sdpa
from ds_usp.kernels.flash_attn import _param_names
from ds_usp.log import log_warning

__all__ = ["unavailable_reason", "dtype_reason", "call_reason", "agrees", "disagreement", "takes", "attention_forward",
           "attention_backward", "checked_forward", "checked_backward", "version"]

_DTYPES = (torch.float16, torch.bfloat16)
_ARCHS = {9: "Hopper (sm90)", 10: "Blackwell (sm100)", 11: "Blackwell (sm110)"}  # compute capability major
_HEAD_DIM_MULTIPLE = 8  # 16 bytes of fp16/bf16: FA4's alignment
# "auto" takes FA4 for calls of at least this many query x key pairs: where it would take cuDNN's op (torch_sdpa);
# shorter calls keep PyTorch's flash op, measured the fastest there on an H200
_AUTO_MIN_PAIRS = 16384 * 16384
# What FA4 must declare, by keyword, for the adapter to honour ds-usp's arguments (filtered calls never drop these)
_FWD_NEEDS = ("q", "k", "v", "softmax_scale", "causal", "softcap", "return_lse")
_BWD_NEEDS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap")


@functools.lru_cache(maxsize=16)
def _device_arch(device: torch.device) -> Optional[int]:
    """The compute capability major of a CUDA ``device``; None for any other device (kept per device: every call
    under ``"auto"`` asks)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)[0]


def _interface() -> Any:
    """``flash_attn.cute.interface`` (imports the CuTe DSL)."""
    from flash_attn.cute import interface

    return interface


def version() -> str:
    """The installed flash-attn-4's version (its ``__version__`` reads another distribution name: 0.0.0)."""
    from importlib import metadata

    try:
        return metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return "unknown"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the flash_attn_4 backend cannot run on ``device``.

    Args:
        device: the device attention will run on.

    Returns:
        None if FA4 imports and ``device`` is a Hopper or Blackwell (sm100/sm110) CUDA device, else a one-line reason.
    """
    arch = _device_arch(device)
    if arch is None:
        return f"flash_attn_4 needs a Hopper or Blackwell CUDA device (got {device.type})"
    if arch not in _ARCHS:
        return (f"flash_attn_4 runs here only on {', '.join(_ARCHS.values())} GPUs; this one has compute "
                f"capability {arch}.x (FA4's sm80 and sm120 paths are not taken)")
    try:
        iface = _interface()
    except ModuleNotFoundError as exc:
        if (exc.name or "") in ("flash_attn", "flash_attn.cute"):
            return "flash_attn_4: not installed (pip install flash-attn-4, or ds-usp's fa4 extra)"
        return f"flash_attn_4: import failed ({exc})"
    except Exception as exc:  # a broken install raises ImportError/OSError/RuntimeError (missing CUDA libs, ABI)
        return f"flash_attn_4: import failed ({type(exc).__name__}: {exc})"
    missing = [n for n in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(iface, n)]
    if missing:
        return f"flash_attn_4: version {version()} lacks {', '.join(missing)}"
    return None


def dtype_reason(dtype: torch.dtype) -> str | None:
    """Why FA4 cannot take inputs of ``dtype`` (it runs fp16 and bf16), or None."""
    return None if dtype in _DTYPES else f"flash_attn_4 supports float16 and bfloat16 only, the inputs are {dtype}"


def call_reason(q: Tensor, softcap: float = 0.0) -> str | None:
    """Why FA4 cannot take a call with these queries (dtype, head dim on this architecture, soft-cap), or None.

    Args:
        q: ``(b, sq, hq, d)``; ``d`` is the head dim of q, k and v (AttnBackend pads them to one).
        softcap: attention logit soft-cap (0: none).
    """
    reason = dtype_reason(q.dtype)
    if reason is not None:
        return reason
    arch, d = _device_arch(q.device), _padded(q.shape[-1])
    if arch not in _ARCHS:
        return unavailable_reason(q.device)
    if arch == 9 and d > 256:
        return f"flash_attn_4 on Hopper supports head dims up to 256, got {q.shape[-1]}"
    if arch != 9 and not (d <= 128 or d == 256):
        return f"flash_attn_4 on Blackwell supports head dims up to 128 and 256, got {q.shape[-1]}"
    if arch != 9 and d == 256 and softcap:
        return "flash_attn_4's Blackwell backward of head dim 256 has no softcap, and the model soft-caps its scores"
    return None


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention output and log-sum-exp with FA4 (no checks: :func:`checked_forward` is the backend's entry).

    Args:
        q: (b, sq, hq, d) queries, fp16/bf16 on a Hopper or Blackwell GPU.
        k: (b, sk, hkv, d) keys, hq % hkv == 0.
        v: (b, sk, hkv, d) values.
        causal: causal mask (callers guarantee sq == sk).
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none).

    Returns:
        out (b, sq, hq, d) in q.dtype and lse (b, hq, sq) float32, natural log.

    Raises:
        RuntimeError: if the installed FA4's forward does not declare an argument ds-usp needs, or returns an lse
            of another shape or dtype.
    """
    d = q.shape[-1]
    with _on(q):
        res = _call(_interface()._flash_attn_fwd, _FWD_NEEDS,
                    q=_packed(q), k=_packed(k), v=_packed(v), softmax_scale=float(scale), causal=bool(causal),
                    softcap=float(softcap), return_lse=True)
    out, lse = res[0], res[1]  # (b, sq, hq, d), (b, hq, sq) fp32; the rest (FA4's saved values) is not used
    b, sq, hq, _ = q.shape
    if lse is None or lse.shape != (b, hq, sq) or lse.dtype != torch.float32:
        got = None if lse is None else (tuple(lse.shape), lse.dtype)
        raise RuntimeError(f"flash_attn_4 {version()} returned lse {got}, not ({b}, {hq}, {sq}) float32")
    return out[..., :d], lse


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention with FA4, given the final output and log-sum-exp (which may be a merge over blocks).

    Args:
        dout: (b, sq, hq, d) gradient of the output.
        q: (b, sq, hq, d) queries.
        k: (b, sk, hkv, d) keys.
        v: (b, sk, hkv, d) values.
        out: (b, sq, hq, d) output the statistics belong to.
        lse: (b, hq, sq) log-sum-exp matching ``out``, natural log.
        causal: causal mask (sq == sk).
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none).

    Returns:
        dq (b, sq, hq, d), dk (b, sk, hkv, d), dv (b, sk, hkv, d) in q.dtype.
    """
    d = q.shape[-1]
    with _on(q):
        dq, dk, dv = _call(_interface()._flash_attn_bwd, _BWD_NEEDS,
                           q=_packed(q), k=_packed(k), v=_packed(v), out=_packed(out.to(q.dtype)),
                           dout=_packed(dout.to(q.dtype)), lse=lse.to(torch.float32).contiguous(),
                           softmax_scale=float(scale), causal=bool(causal), softcap=float(softcap))[:3]
    return dq[..., :d], dk[..., :d], dv[..., :d]


def agrees(device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool, causal: bool, softcap: float) -> bool:
    """Whether FA4 checked equal to PyTorch's attention on ``device`` for this kind of call (:func:`disagreement`)."""
    return disagreement(device, dtype, head_dim, gqa, causal, softcap) is None


@functools.lru_cache(maxsize=None)
def disagreement(device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool, causal: bool,
                 softcap: float) -> str | None:
    """How FA4 differs from PyTorch's attention (the torch backend) on a small random problem of this kind on
    ``device``, or None where it gives the same output, lse and gradients to the dtype's rounding
    (:func:`ds_usp.kernels.torch_sdpa.results_agree`): 2 x 320 queries against 320 keys, 4 query heads on 2 (GQA) or
    4 kv heads. Checked once per kind (``disagreement.cache_clear()`` forgets); an FA4 that raises (its argument
    checks are assertions) or differs is not used, and a warning says so once."""
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(2, 320, 4, head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 320, 2 if gqa else 4, head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    scale = head_dim ** -0.5
    kind = (f"{dtype}, head dim {head_dim}, {'GQA' if gqa else 'MHA'}, {'causal' if causal else 'full'}"
            + (f", softcap {softcap}" if softcap else ""))
    try:
        out, lse = attention_forward(q, k, v, causal, scale, softcap)
        grads = attention_backward(dout, q, k, v, out, lse, causal, scale, softcap)
    except Exception as exc:  # its checks are assertions; the CuTe DSL's compile errors have classes of their own
        reason = f"it raised {type(exc).__name__}: {exc}"
    else:
        ref_out, ref_lse = torch_sdpa.attention_forward(q, k, v, causal, scale, softcap)
        ref_grads = torch_sdpa.attention_backward(dout, q, k, v, ref_out, ref_lse, causal, scale, softcap)
        same = torch_sdpa.results_agree((out, lse, *grads), (ref_out, ref_lse, *ref_grads))
        reason = None if same else "its output, lse or gradients differ from PyTorch's attention"
    if reason is None:
        return None
    reason = f"flash_attn_4 {version()} on {device} for {kind}: {reason}"
    log_warning(f"{reason}; such calls run on the torch backend under usp.attn_backend='auto'")
    return reason


def _disagreement_for(q: Tensor, k: Tensor, causal: bool, softcap: float) -> str | None:
    """:func:`disagreement` for the kind of this call (device, dtype, padded head dim, GQA or not, mask, soft-cap)."""
    return disagreement(q.device, q.dtype, _padded(q.shape[-1]), q.shape[2] != k.shape[2], bool(causal),
                        float(softcap))


def takes(q: Tensor, k: Tensor, v: Tensor, causal: bool, softcap: float = 0.0) -> bool:
    """Whether ``"auto"`` runs this call on FA4: it is long enough (:data:`_AUTO_MIN_PAIRS`), FA4 can take it
    (:func:`call_reason`) and has checked equal on the device for its kind (:func:`agrees`)."""
    return (q.shape[1] * k.shape[1] >= _AUTO_MIN_PAIRS and call_reason(q, softcap) is None
            and _disagreement_for(q, k, causal, softcap) is None)


def _refuse_unfit(q: Tensor, k: Tensor, causal: bool, softcap: float) -> None:
    """Raise ValueError, by name, when FA4 cannot take this call or has not checked equal for its kind."""
    reason = call_reason(q, softcap)
    if reason is None:
        differs = _disagreement_for(q, k, causal, softcap)
        reason = None if differs is None else f"it did not check equal on a small forward and backward ({differs})"
    if reason is not None:
        raise ValueError(f"usp.attn_backend='flash_attn_4' cannot run this call: {reason}; "
                         "use usp.attn_backend='auto' or 'torch'")


def checked_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                    softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """:func:`attention_forward` of a call FA4 can take and has checked equal for; else ValueError by name."""
    _refuse_unfit(q, k, causal, softcap)
    return attention_forward(q, k, v, causal, scale, softcap)


def checked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                     scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attention_backward` of a call FA4 can take and has checked equal for; else ValueError by name."""
    _refuse_unfit(q, k, causal, softcap)
    return attention_backward(dout, q, k, v, out, lse, causal, scale, softcap)


def _on(x: Tensor) -> contextlib.AbstractContextManager:
    """``x``'s CUDA device made current: FA4 picks its kernels by the current device's architecture."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _padded(d: int) -> int:
    """Head dim ``d`` rounded up to FA4's alignment."""
    return d + (-d % _HEAD_DIM_MULTIPLE)


def _packed(x: Tensor) -> Tensor:
    """``x`` zero-padded along its head dim to FA4's alignment, as a contiguous tensor: the one layout
    :func:`agrees` checked (the ring hands the kernels strided views of its K/V messages)."""
    pad = -x.shape[-1] % _HEAD_DIM_MULTIPLE
    return F.pad(x, (0, pad)) if pad else x.contiguous()


def _call(fn: Callable[..., Any], needs: tuple[str, ...], **kwargs: Any) -> Any:
    """Call ``fn`` by keyword with the arguments it declares; RuntimeError if it lacks one ds-usp needs honoured."""
    names, required = _param_names(fn, needs)
    lacking = [n for n in needs if n not in names] + [n for n in required if n not in kwargs]
    if lacking:
        raise RuntimeError(f"flash_attn_4 {version()}: {getattr(fn, '__name__', fn)} has an unknown signature "
                           f"(lacks or requires {lacking}); ds-usp's adapter knows 4.0.0b0 to 4.0.0b36")
    return fn(**{n: kwargs[n] for n in names if n in kwargs})
