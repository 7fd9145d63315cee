"""Local (single-process, non-communicating) attention kernels returning output and log-sum-exp.

Conventions shared by every backend:

* q: (b, sq, hq, d); k: (b, sk, hkv, d); v: (b, sk, hkv, dv) ("bshd"), hq % hkv == 0 (GQA/MQA: q head i
  uses kv head i // (hq // hkv)); dv may differ from d (MLA: :class:`AttnBackend` zero-pads to one head dim
  for the fused kernels and cuts the output back). Inputs may be non-contiguous views.
* softcap > 0: the scores are ``softcap * tanh(scale q.k / softcap)`` (Gemma 2); 0 means none. The
  torch backend computes capped blocks in exact blocked math (:func:`ds_usp.kernels.band.math_forward`),
  flash-attn and Triton in their kernels.
* lse: float32 (b, hq, sq), natural log, softmax scale included: logsumexp_k(scale * q.k).
* causal=True is the top-left aligned lower-triangular mask and needs sq == sk;
  causal=False is full attention and allows sq != sk.
* ``backward`` uses the (out, lse) it is given as the final softmax statistics, so ring attention
  can call it per KV block with the globally merged out/lse.

Backends, selected with :func:`get_backend` (``usp.attn_backend``; :func:`resolve_backend` keeps its answer per
setting, device and dtype for the hot path):

* "torch": PyTorch's fused SDPA ATen ops (:mod:`ds_usp.kernels.torch_sdpa`); CPU and CUDA, fp32/bf16/fp16.
* "flash_attn": flash-attn 2.x (:mod:`ds_usp.kernels.flash_attn`); CUDA, fp16/bf16. Supported but untested on a
  GPU so far: the adapter is tested on CPU against stand-ins of flash-attn's private API only.
* "flash_attn_4": FlashAttention-4 (:mod:`ds_usp.kernels.flash_attn4`, the ``flash-attn-4`` wheel, CuTe DSL kernels
  compiled at run time); Hopper and Blackwell (sm100/sm110) CUDA GPUs, fp16/bf16. Each kind of call (dtype, head dim,
  GQA, mask, soft-cap) runs on it only once it has checked equal to PyTorch's attention on the device
  (:func:`ds_usp.kernels.flash_attn4.agrees`); named, any other call is refused by name. Not run on a GPU of this
  project yet: tested on CPU against a stand-in of its API (tests/test_flash_attn4.py).
* "triton": ds-usp's own Triton kernels (:mod:`ds_usp.kernels.triton_attn`); fp16/bf16/fp32, head dims up to 256;
  CUDA/ROCm tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter, for tests); band and document
  masks computed in the kernel, the ring's LSE merge fused into the forward (``band_forward_merge_``), and a band
  backward in one call.
* "auto": per call, the first backend of :data:`AUTO_ORDER` (fastest first) that is installed, can take the call
  and has checked equal on the device for its kind; "torch" takes the rest (on CUDA, cuDNN's attention op for long
  calls where it agrees with PyTorch's own FlashAttention-2 op, that op otherwise; measured on an H100 and an H200).
  Never "flash_attn", which has not run on a GPU of this project (docs/config.md says why), nor "triton" (no GPU
  measurement shows it faster).

:func:`available_backends` says which of the four can run on a device, and why not.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_usp.config import BACKEND_CHOICES
from ds_usp.kernels import band as _band
from ds_usp.kernels import flash_attn as _flash_attn
from ds_usp.kernels import flash_attn4 as _fa4  # imports flash_attn.cute only when asked whether it can run
from ds_usp.kernels import torch_sdpa as _torch_sdpa
from ds_usp.kernels import triton_attn as _triton  # imports triton itself only when a kernel first runs

__all__ = ["AUTO_ORDER", "AttnBackend", "AutoCandidate", "BACKEND_CHOICES", "available_backends", "backward_pieces",
           "forward_pieces", "get_backend", "resolve_backend"]

ForwardFn = Callable[[Tensor, Tensor, Tensor, bool, float, float], tuple[Tensor, Tensor]]
BackwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float, float],
                      tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class AttnBackend:
    """A local attention implementation: forward returning (out, lse) and the matching backward.

    Attributes:
        name: "torch", "flash_attn", "flash_attn_4" or "triton"; "auto(...)" for :func:`get_backend`'s per-call
            choice among several.
        forward_fn: kernel forward on validated inputs with a resolved float scale.
        backward_fn: kernel backward on validated inputs with a resolved float scale.
        masked_forward: ``(q, k, v, keep, scale, softcap)``: attention of a small tile with an explicit
            ``(sq, sk)`` bool mask (band edges); default: exact fp32 math (:mod:`ds_usp.kernels.band`).
        masked_backward: its gradients.
        band_forward_merge_: ``(q, k, v, lo, hi, scale, out_acc, lse_acc, softcap=...)``: the attention of the band
            ``lo <= k - q <= hi`` folded in place into a running fp32 ``(out, lse)``, mask from indices, in one
            pass; None when the backend has none (then :func:`forward_pieces` and the separate merge run).
        band_backward: ``(dout, q, k, v, out, lse, lo, hi, scale, softcap=...) -> (dq, dk, dv)`` of any band in one
            call; None: :func:`backward_pieces` cuts the band.
    """

    name: str
    forward_fn: ForwardFn = field(repr=False)
    backward_fn: BackwardFn = field(repr=False)
    masked_forward: Callable[..., tuple[Tensor, Tensor]] = field(default=_band.masked_forward, repr=False)
    masked_backward: Callable[..., tuple[Tensor, Tensor, Tensor]] = field(default=_band.masked_backward, repr=False)
    band_forward_merge_: Optional[Callable[..., None]] = field(default=None, repr=False)
    band_backward: Optional[Callable[..., tuple[Tensor, Tensor, Tensor]]] = field(default=None, repr=False)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None = None,
                softcap: float = 0.0) -> tuple[Tensor, Tensor]:
        """Attention output and log-sum-exp.

        Args:
            q: (b, sq, hq, d) queries.
            k: (b, sk, hkv, d) keys, hq % hkv == 0.
            v: (b, sk, hkv, dv) values.
            causal: top-left aligned causal mask; requires sq == sk.
            scale: softmax scale; None means 1/sqrt(d).
            softcap: attention logit soft-cap (0: none).

        Returns:
            out (b, sq, hq, dv) in q.dtype (bshd) and lse (b, hq, sq) float32.

        Raises:
            ValueError: on inconsistent shapes/dtypes/devices, or causal with sq != sk.
        """
        _check_qkv(q, k, v, causal)
        dv, d = v.shape[-1], _common_dim(q, v)
        out, lse = self.forward_fn(_pad_to(q, d), _pad_to(k, d), _pad_to(v, d), causal, _resolve_scale(scale, q),
                                   float(softcap))
        return out[..., :dv], lse

    def masked(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float,
               softcap: float = 0.0) -> tuple[Tensor, Tensor]:
        """:attr:`masked_forward` on one head dim (see :meth:`forward`)."""
        dv, d = v.shape[-1], _common_dim(q, v)
        out, lse = self.masked_forward(_pad_to(q, d), _pad_to(k, d), _pad_to(v, d), keep, scale, float(softcap))
        return out[..., :dv], lse

    def masked_grads(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, keep: Tensor,
                     scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """:attr:`masked_backward` on one head dim (see :meth:`backward`)."""
        dk_, dv_, d = q.shape[-1], v.shape[-1], _common_dim(q, v)
        dq, dk, dv = self.masked_backward(*(_pad_to(x, d) for x in (dout, q, k, v, out)), lse, keep, scale,
                                          float(softcap))
        return dq[..., :dk_], dk[..., :dk_], dv[..., :dv_]

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float | None = None, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients w.r.t. q, k, v given the final output and log-sum-exp.

        ``out``/``lse`` are taken as the final softmax statistics and are not recomputed from k/v,
        so with the merged out/lse of several KV blocks this returns the block's dk/dv and its
        contribution to dq (the dq contributions of all blocks sum to the full dq).

        Args:
            dout: (b, sq, hq, dv) gradient of the output.
            q: (b, sq, hq, d) queries.
            k: (b, sk, hkv, d) keys.
            v: (b, sk, hkv, dv) values.
            out: (b, sq, hq, dv) attention output the statistics belong to.
            lse: (b, hq, sq) log-sum-exp matching ``out`` (float32).
            causal: top-left aligned causal mask; requires sq == sk.
            scale: softmax scale; None means 1/sqrt(d).
            softcap: attention logit soft-cap (0: none).

        Returns:
            dq (b, sq, hq, d), dk (b, sk, hkv, d), dv (b, sk, hkv, dv), in q.dtype, bshd; dk/dv are
            summed over each q-head group for GQA/MQA.

        Raises:
            ValueError: on inconsistent shapes/dtypes/devices, or causal with sq != sk.
        """
        _check_qkv(q, k, v, causal)
        b, sq, hq, _ = q.shape
        for label, t in (("dout", dout), ("out", out)):
            if t.shape != (*q.shape[:3], v.shape[-1]):
                raise ValueError(f"{label} must have shape {(*q.shape[:3], v.shape[-1])} (q's with v's head dim), "
                                 f"got {tuple(t.shape)}")
        if lse.shape != (b, hq, sq):
            raise ValueError(f"lse must have shape (b, hq, sq) = {(b, hq, sq)}, got {tuple(lse.shape)}")
        dk_, dv_, d = q.shape[-1], v.shape[-1], _common_dim(q, v)
        dq, dk, dv = self.backward_fn(*(_pad_to(x, d) for x in (dout, q, k, v, out)), lse, causal,
                                      _resolve_scale(scale, q), float(softcap))
        return dq[..., :dk_], dk[..., :dk_], dv[..., :dv_]


def available_backends(device: torch.device | str) -> dict[str, str | None]:
    """Which concrete backends can run on ``device``.

    Args:
        device: the device attention will run on.

    Returns:
        {"torch": ..., "flash_attn": ..., "flash_attn_4": ..., "triton": ...}, each None if usable, else the reason.
    """
    device = torch.device(device)
    return {
        "torch": _torch_sdpa.unavailable_reason(device),
        "flash_attn": _flash_attn.unavailable_reason(device),
        "flash_attn_4": _fa4.unavailable_reason(device),
        "triton": _triton.unavailable_reason(device),
    }


@dataclass(frozen=True)
class AutoCandidate:
    """A backend that ``"auto"`` runs a call on, ahead of "torch" (which takes every call no candidate takes).

    Attributes:
        name: its ``usp.attn_backend`` value (a key of :func:`available_backends`).
        dtype_reason: why it cannot take inputs of a dtype, or None.
        takes: ``(q, k, v, causal, softcap) -> bool``: whether it runs this call: it can take it, the call is long
            enough for it to be the faster, and it has checked equal to the reference on the device for the call's
            kind (checked once per kind, then remembered).
        forward_fn: its kernel forward.
        backward_fn: its kernel backward.
        basis: why it stands where it does in :data:`AUTO_ORDER`: measured (where, on what) or declared (by whom).
    """

    name: str
    dtype_reason: Callable[[torch.dtype], Optional[str]] = field(repr=False)
    takes: Callable[[Tensor, Tensor, Tensor, bool, float], bool] = field(repr=False)
    forward_fn: ForwardFn = field(repr=False)
    backward_fn: BackwardFn = field(repr=False)
    basis: str = ""


# "auto"'s backends ahead of "torch", fastest first: a call runs on the first that is usable on the device and takes
# it, else on "torch". The order is one of speed, measured where a GPU of this project measured it, else declared.
AUTO_ORDER: tuple[AutoCandidate, ...] = (
    AutoCandidate("flash_attn_4", _fa4.dtype_reason, _fa4.takes, _fa4.attention_forward, _fa4.attention_backward,
                  basis="declared from published figures, not measured by ds-usp: FlashAttention-4's paper (arXiv "
                        "2603.05451) reports up to 1.3x cuDNN 9.13 on a B200 (bf16); on Hopper FA4 runs FA3's "
                        "algorithm, whose paper (arXiv 2407.08608) has its bf16 forward at 16K on an H100 at 1.09x "
                        "(head dim 128) and 1.2x (64) the cuDNN of mid 2024. Taken only where cuDNN's op would be "
                        "(16K x 16K query-key pairs on); benchmarks/fa4_check.py measures both on a GPU"),
)


def get_backend(name: str, device: torch.device | str, dtype: Optional[torch.dtype] = None) -> AttnBackend:
    """Resolve the ``usp.attn_backend`` setting to a backend for ``device`` and ``dtype``.

    Args:
        name: "auto", "torch", "flash_attn", "flash_attn_4" or "triton". "auto" runs each call on the first backend
            of :data:`AUTO_ORDER` usable here that takes it (installed, able to, and checked equal on the device),
            else on torch; never flash_attn (never run on a GPU of this project: docs/config.md) nor triton (no GPU
            measurement shows it faster yet: docs/benchmarks.md); name either to use it.
        device: the device attention will run on.
        dtype: the inputs' dtype (None: not known yet, not checked).

    Returns:
        The backend ("auto" where no candidate of :data:`AUTO_ORDER` is usable: the torch backend itself).

    Raises:
        ValueError: naming ``usp.attn_backend``, the value and the reason, plus the values usable
            on ``device``, if ``name`` is unknown or cannot run there.
    """
    device = torch.device(device)
    reasons = available_backends(device)
    usable = [n for n, r in reasons.items() if r is None]
    usable_here = ", ".join(repr(n) for n in (["auto"] if usable else []) + usable) or "none"
    if name not in BACKEND_CHOICES:
        raise ValueError(f"usp.attn_backend={name!r} is not a known attention backend (choose from "
                         f"{', '.join(map(repr, BACKEND_CHOICES))}); usable on {device}: {usable_here}")
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if reasons["flash_attn"] is None and not half:
        reasons["flash_attn"] = f"flash-attn supports float16 and bfloat16 only, the inputs are {dtype}"
    if "flash_attn_4" in reasons and reasons["flash_attn_4"] is None and dtype is not None:
        reasons["flash_attn_4"] = _fa4.dtype_reason(dtype)
    chosen = "torch" if name == "auto" else name
    if reasons.get(chosen, f"{chosen} is not listed by available_backends") is not None:
        resolved = f" (resolved to {chosen!r})" if chosen != name else ""
        raise ValueError(f"usp.attn_backend={name!r}{resolved} cannot be used on {device}: "
                         f"{reasons.get(chosen, 'not listed')}; usable on {device}: {usable_here}")
    if name == "auto":
        return _auto_backend(reasons, dtype)
    if chosen == "flash_attn":
        return AttnBackend("flash_attn", _flash_attn.attention_forward, _flash_attn.attention_backward)
    if chosen == "flash_attn_4":
        return AttnBackend("flash_attn_4", _fa4.checked_forward, _fa4.checked_backward, _torch_sdpa.masked_forward,
                           _torch_sdpa.masked_backward)
    if chosen == "triton":
        return AttnBackend("triton", _triton.attention_forward, _triton.attention_backward,
                           band_forward_merge_=_triton.band_forward_merge_, band_backward=_triton.band_backward)
    return _torch_backend()


def _torch_backend() -> AttnBackend:
    """The torch backend, with the kernels the module holds now (made per resolution, which
    :func:`resolve_backend` caches: a kernel replaced in the module, as a test's counter does, is the one taken)."""
    return AttnBackend("torch", _torch_sdpa.attention_forward, _torch_sdpa.attention_backward,
                       _torch_sdpa.masked_forward, _torch_sdpa.masked_backward)


def _auto_backend(reasons: dict[str, Optional[str]], dtype: Optional[torch.dtype]) -> AttnBackend:
    """"auto" on a device where ``reasons`` (:func:`available_backends`) holds: the torch backend when no candidate of
    :data:`AUTO_ORDER` is usable for ``dtype``, else one that runs each call on the first candidate taking it."""
    fast = tuple(c for c in AUTO_ORDER if reasons.get(c.name, "not listed") is None
                 and (dtype is None or c.dtype_reason(dtype) is None))
    if not fast:
        return _torch_backend()
    return AttnBackend(f"auto({' > '.join([c.name for c in fast] + ['torch'])})",
                       functools.partial(_auto_forward, fast), functools.partial(_auto_backward, fast),
                       _torch_sdpa.masked_forward, _torch_sdpa.masked_backward)


def _auto_kernels(fast: tuple[AutoCandidate, ...], q: Tensor, k: Tensor, v: Tensor, causal: bool,
                  softcap: float) -> tuple[ForwardFn, BackwardFn]:
    """The kernels of the first candidate in ``fast`` that takes this call; the torch backend's if none does (the
    forward and the backward of a call ask with the same tensors' shapes, so they get the same kernels)."""
    for candidate in fast:
        if candidate.takes(q, k, v, causal, softcap):
            return candidate.forward_fn, candidate.backward_fn
    return _torch_sdpa.attention_forward, _torch_sdpa.attention_backward


def _auto_forward(fast: tuple[AutoCandidate, ...], q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """The forward of :func:`_auto_backend`: on the kernels of :func:`_auto_kernels`."""
    return _auto_kernels(fast, q, k, v, causal, softcap)[0](q, k, v, causal, scale, softcap)


def _auto_backward(fast: tuple[AutoCandidate, ...], dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                   lse: Tensor, causal: bool, scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`_auto_backend`: on the kernels of :func:`_auto_kernels`."""
    return _auto_kernels(fast, q, k, v, causal, softcap)[1](dout, q, k, v, out, lse, causal, scale, softcap)


@functools.lru_cache(maxsize=64)
def resolve_backend(name: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> AttnBackend:
    """:func:`get_backend`, decided once per setting, device and dtype: what a layer and a ring step call.

    :func:`get_backend` asks every backend whether it can run (flash-attn's import, Triton's spec, the environment)
    each time; here the answer of the first call is kept (a bounded cache; a refusal is not kept, so it is raised
    again), so a layer call after the first does no lookup. ``resolve_backend.cache_clear()`` forgets the answers.

    Args:
        name: the ``usp.attn_backend`` setting (see :func:`get_backend`).
        device: the device attention runs on (a ``torch.device``: a hashable key).
        dtype: the inputs' dtype (None: not checked).

    Returns:
        The backend (the same object for the same arguments).

    Raises:
        ValueError: as :func:`get_backend`.
    """
    return get_backend(name, device, dtype)


def _common_dim(q: Tensor, v: Tensor) -> int:
    """The head dim q/k and v are brought to for the fused kernels: the larger of the two."""
    return max(q.shape[-1], v.shape[-1])


def _pad_to(x: Tensor, d: int) -> Tensor:
    """``x`` with its last dim zero-padded to ``d`` (zero columns change neither ``q.k`` nor the real outputs)."""
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


def _resolve_scale(scale: float | None, q: Tensor) -> float:
    """``scale`` as a float, defaulting to 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """Validate the bshd shapes, GQA grouping, dtypes and devices of q, k, v."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, seq, heads, head_dim), got {q.dim()}-D, {k.dim()}-D, "
                         f"{v.dim()}-D")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same batch, length and heads, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v batch and head_dim must match q: q {tuple(q.shape)}, k {tuple(k.shape)}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if causal and sq != k.shape[1]:
        raise ValueError(f"causal attention needs equal q and kv lengths, got sq={sq}, sk={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def forward_pieces(backend: AttnBackend, q: Tensor, k: Tensor, v: Tensor, lo: Optional[int], hi: Optional[int],
                   scale: float, softcap: float = 0.0) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """Attention of the band ``lo <= k - q <= hi`` (local indices) of a rectangle, as merge-ready pieces.

    A full rectangle (``lo = hi = None``) or a square causal one (``lo = None, hi = 0``) is one call of
    the backend's fused kernel; any other band is cut by :func:`ds_usp.kernels.band.band_pieces`.

    Args:
        backend: the local kernel.
        q: ``(b, sq, hq, d)``.
        k: ``(b, sk, hkv, d)``.
        v: ``(b, sk, hkv, dv)``.
        lo: lower band edge (None: none).
        hi: upper band edge (None: none).
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none).

    Yields:
        ``(query rows, out, lse)`` per piece: merge each into the running result at those rows.
    """
    nq, nk = q.shape[1], k.shape[1]
    if lo is None and (hi is None or (hi == 0 and nq == nk)):
        yield slice(0, nq), *backend.forward(q, k, v, hi == 0, scale, softcap)
        return
    for piece in _band.band_pieces(nq, nk, lo, hi):
        qs, ks = piece.q, piece.k
        if piece.kind == "mask":
            keep = _band.band_mask(qs.stop - qs.start, ks.stop - ks.start, piece.lo, piece.hi, q.device)
            yield qs, *backend.masked(q[:, qs], k[:, ks], v[:, ks], keep, scale, softcap)
        else:
            yield qs, *backend.forward(q[:, qs], k[:, ks], v[:, ks], piece.kind == "causal", scale, softcap)


def backward_pieces(backend: AttnBackend, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    lo: Optional[int], hi: Optional[int], scale: float,
                    softcap: float = 0.0) -> Iterator[tuple[slice, slice, Tensor, Tensor, Tensor]]:
    """Gradients of :func:`forward_pieces` given the final ``out``/``lse`` of the query rows.

    Yields:
        ``(query rows, key rows, dq, dk, dv)`` per piece: add each into the accumulators at those rows.
    """
    nq, nk = q.shape[1], k.shape[1]
    if lo is None and (hi is None or (hi == 0 and nq == nk)):
        yield slice(0, nq), slice(0, nk), *backend.backward(dout, q, k, v, out, lse, hi == 0, scale, softcap)
        return
    if backend.band_backward is not None:  # the kernel masks from indices: one call for any band
        d = _common_dim(q, v)
        dq, dk, dv = backend.band_backward(*(_pad_to(x, d) for x in (dout, q, k, v, out)), lse, lo, hi, scale,
                                           softcap=softcap)
        yield slice(0, nq), slice(0, nk), dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
        return
    for piece in _band.band_pieces(nq, nk, lo, hi):
        qs, ks = piece.q, piece.k
        args = (dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs])
        if piece.kind == "mask":
            keep = _band.band_mask(qs.stop - qs.start, ks.stop - ks.start, piece.lo, piece.hi, q.device)
            yield qs, ks, *backend.masked_grads(*args, keep, scale, softcap)
        else:
            yield qs, ks, *backend.backward(*args, piece.kind == "causal", scale, softcap)
