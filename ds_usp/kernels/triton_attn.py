"""Local attention in Triton: flash-attention forward and backward with band and document masks from
indices, GQA without repeating K/V, and a forward that merges into a running ``(out, lse)`` in place.

The contract is :mod:`ds_usp.kernels.torch_sdpa`'s ("bshd" tensors, fp32 natural-log LSE with the
scale included, the backward taking the final ``out``/``lse``), plus the band entries the ring uses:

* ``band_forward(q, k, v, lo, hi, scale, q_doc=None, k_doc=None)``: attention over the pairs with
  ``lo <= j - i <= hi`` (local indices; None: unbounded) and, when given, ``q_doc[i] == k_doc[j]``
  (nondecreasing document ids). The mask is computed from indices in the kernel, never stored;
  key tiles outside the band or outside the query tile's documents are not visited, and only tiles
  that straddle a mask edge evaluate it. Causal is the band ``(None, 0)``.
* ``band_forward_merge_(..., out_acc, lse_acc, ...)``: the same, folded into a running fp32
  ``(out, lse)`` (strided views allowed) in the same kernel pass, exactly as
  ``TorchOps.merge_block_`` would after ``band_forward``.
* ``band_backward``: the gradients given the final ``out``/``lse``.

Rows that see no key get zero output, ``-inf`` LSE and zero gradients. Head dims that are not a power
of two (16..256) are zero-padded (the scores do not change); larger ones are refused. fp16/bf16/fp32
inputs, fp32 accumulation. Triton is imported when a kernel first runs, so ds_usp imports without it;
on CPU tensors the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``, for tests). The choice is
made per tensor, not per process: CUDA tensors get compiled kernels even where ``TRITON_INTERPRET=1`` is set, so a
GPU host runs the interpreted CPU tests and the compiled GPU ones in one process.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Optional

import torch
from torch import Tensor

from ds_usp.upstream.triton import inline_interpreted_helpers, interpreted

__all__ = ["unavailable_reason", "attention_forward", "attention_backward", "band_forward", "band_forward_merge_",
           "band_backward"]

_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None when the Triton kernels can run on ``device``, else why not."""
    device = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton, or the gpu extra)"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "triton needs a CUDA (or ROCm) device; none is available"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "triton runs on CPU tensors only under TRITON_INTERPRET=1 (its interpreter, for tests)"
    return f"triton does not run on {device.type} tensors"


# ------------------------------------------------------------------------------------------ public API


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention output ``(b, sq, hq, d)`` in q's dtype and LSE ``(b, hq, sq)`` fp32; causal is top-left."""
    return band_forward(q, k, v, None, 0 if causal else None, scale, softcap=softcap)


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` given the final ``out``/``lse`` (dk/dv summed over each q-head group)."""
    return band_backward(dout, q, k, v, out, lse, None, 0 if causal else None, scale, softcap=softcap)


def band_forward(q: Tensor, k: Tensor, v: Tensor, lo: Optional[int], hi: Optional[int], scale: float,
                 q_doc: Optional[Tensor] = None, k_doc: Optional[Tensor] = None,
                 softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention over the band ``lo <= j - i <= hi`` (and equal documents): ``(out, lse)``; ``softcap`` > 0 caps
    the scores at ``softcap * tanh(scores / softcap)``."""
    b, sq, hq, d = q.shape
    out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    _forward(q, k, v, lo, hi, scale, q_doc, k_doc, out, lse, merge=False, softcap=softcap)
    return out, lse


def band_forward_merge_(q: Tensor, k: Tensor, v: Tensor, lo: Optional[int], hi: Optional[int], scale: float,
                        out_acc: Tensor, lse_acc: Tensor, q_doc: Optional[Tensor] = None,
                        k_doc: Optional[Tensor] = None, softcap: float = 0.0) -> None:
    """The band's attention merged in place into ``out_acc`` (fp32 bshd) and ``lse_acc`` (fp32 bhs), one pass."""
    if out_acc.dtype != torch.float32 or lse_acc.dtype != torch.float32:
        raise ValueError(f"the running out/lse must be float32, got {out_acc.dtype} and {lse_acc.dtype}")
    if out_acc.shape != q.shape or lse_acc.shape != (q.shape[0], q.shape[2], q.shape[1]):
        raise ValueError(f"running out {tuple(out_acc.shape)} / lse {tuple(lse_acc.shape)} do not match q "
                         f"{tuple(q.shape)}")
    _forward(q, k, v, lo, hi, scale, q_doc, k_doc, out_acc, lse_acc, merge=True, softcap=softcap)


def band_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lo: Optional[int],
                  hi: Optional[int], scale: float, q_doc: Optional[Tensor] = None,
                  k_doc: Optional[Tensor] = None, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`band_forward` given the final ``out``/``lse``."""
    _check(q, k, v, q_doc, k_doc)
    kern = _kernels(q.device.type == "cpu")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dp = _padded_dim(d)
    # delta_i = sum_d dout * out (fp32): the softmax-backward row term, (b, sq, hq) -> (b, hq, sq)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    lse = lse.float().contiguous()
    q, k, v, dout = (_pad(_unit_last(x), dp) for x in (q, k, v, dout))
    dq = torch.empty(b, sq, hq, dp, dtype=torch.float32, device=q.device)
    dk = torch.empty(b, sk, hkv, dp, dtype=torch.float32, device=q.device)
    dv = torch.empty(b, sk, hkv, dp, dtype=torch.float32, device=q.device)
    qd, kd, has_doc = _docs(q_doc, k_doc, q.device)
    lo_, hi_ = _band(lo, hi, sq, sk)
    cfg = _config(q.device, backward=True)
    common = dict(nq=sq, nk=sk, hq=hq, groups=hq // hkv, scale_log2=scale * _LOG2E, softcap=float(softcap) or 1.0,
                  lo=lo_, hi=hi_, HAS_DOC=has_doc, HAS_SOFTCAP=bool(softcap), IEEE=_ieee(q), BLOCK_D=dp)
    kern.bwd_dkdv[(_cdiv(sk, cfg["BN"]), b * hkv)](
        q, k, v, dout, lse, delta, dk, dv, qd, kd, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *dout.stride()[:3], *lse.stride(), *delta.stride(), *dk.stride()[:3], *dv.stride()[:3],
        BLOCK_M=cfg["BM"], BLOCK_N=cfg["BN"], num_warps=cfg["warps"], num_stages=cfg["stages"], **common)
    kern.bwd_dq[(_cdiv(sq, cfg["BM"]), b * hq)](
        q, k, v, dout, lse, delta, dq, qd, kd, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *dout.stride()[:3], *lse.stride(), *delta.stride(), *dq.stride()[:3],
        BLOCK_M=cfg["BM"], BLOCK_N=cfg["BN"], num_warps=cfg["warps"], num_stages=cfg["stages"], **common)
    return tuple(x[..., :d].to(t.dtype) for x, t in ((dq, q), (dk, k), (dv, v)))  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------ helpers

_LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(q: Tensor, k: Tensor, v: Tensor, q_doc: Optional[Tensor], k_doc: Optional[Tensor]) -> None:
    if q.dtype not in _DTYPES:
        raise ValueError(f"the triton backend supports float16, bfloat16 and float32, got {q.dtype}")
    if q.shape[-1] > _MAX_HEAD_DIM:
        raise ValueError(f"the triton backend supports head dims up to {_MAX_HEAD_DIM}, got {q.shape[-1]}")
    if (q_doc is None) != (k_doc is None):
        raise ValueError("q_doc and k_doc go together: give both or neither")
    if q_doc is not None and (q_doc.shape != (q.shape[1],) or k_doc.shape != (k.shape[1],)):
        raise ValueError(f"q_doc/k_doc must have lengths sq={q.shape[1]} and sk={k.shape[1]}, got "
                         f"{tuple(q_doc.shape)} and {tuple(k_doc.shape)}")
    reason = unavailable_reason(q.device)
    if reason is not None:
        raise ValueError(f"usp.attn_backend='triton' cannot run here: {reason}")


def _ieee(q: Tensor) -> bool:
    """fp32 products in the dot: for fp32 inputs, and for bf16 in the interpreter (its bf16 dot is wrong)."""
    return q.dtype == torch.float32 or (q.device.type == "cpu" and q.dtype == torch.bfloat16)


def _padded_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _pad(x: Tensor, dp: int) -> Tensor:
    return x if x.shape[-1] == dp else torch.nn.functional.pad(x, (0, dp - x.shape[-1]))


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _docs(q_doc: Optional[Tensor], k_doc: Optional[Tensor], device: torch.device) -> tuple[Tensor, Tensor, bool]:
    if q_doc is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return dummy, dummy, False
    return q_doc.to(device, torch.int32).contiguous(), k_doc.to(device, torch.int32).contiguous(), True


def _band(lo: Optional[int], hi: Optional[int], sq: int, sk: int) -> tuple[int, int]:
    """The band as plain integers: an absent edge becomes one no pair reaches."""
    return (-(sq + 1) if lo is None else int(lo)), ((sk + 1) if hi is None else int(hi))


def _config(device: torch.device, backward: bool = False) -> dict:
    """Tile sizes: in the interpreter 32x32 (its cost is per program and per tile step, not per element: against
    16x16, tests/test_triton.py took 31 s instead of 59, test_packed's Triton cases 176 s instead of 250; the tests'
    shapes still span several tiles, partial ones included). On a GPU, the fastest of ``benchmarks/triton_attn.py
    --sweep`` on an H100 (d=128, bf16, S=16384; docs/benchmarks.md): forward 128x64 tiles (the fused ring step
    17.9 ms against 21.0 with 64x64, plain forward within 2%), backward 64x64; 4 warps, 3 stages."""
    if device.type == "cpu":
        return dict(BM=32, BN=32, warps=1, stages=1)
    return dict(BM=64 if backward else 128, BN=64, warps=4, stages=3)


def _forward(q: Tensor, k: Tensor, v: Tensor, lo: Optional[int], hi: Optional[int], scale: float,
             q_doc: Optional[Tensor], k_doc: Optional[Tensor], out: Tensor, lse: Tensor, merge: bool,
             softcap: float = 0.0) -> None:
    _check(q, k, v, q_doc, k_doc)
    kern = _kernels(q.device.type == "cpu")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dp = _padded_dim(d)
    q, k, v = (_pad(_unit_last(x), dp) for x in (q, k, v))
    target = out if dp == d and out.stride(-1) == 1 else torch.zeros(b, sq, hq, dp, dtype=out.dtype,
                                                                        device=out.device)
    if merge and target is not out:
        target[..., :d] = out
    qd, kd, has_doc = _docs(q_doc, k_doc, q.device)
    lo_, hi_ = _band(lo, hi, sq, sk)
    cfg = _config(q.device)
    kern.fwd[(_cdiv(sq, cfg["BM"]), b * hq)](
        q, k, v, target, lse, qd, kd, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *target.stride()[:3],
        *lse.stride(), nq=sq, nk=sk, hq=hq, groups=hq // hkv, scale_log2=scale * _LOG2E,
        softcap=float(softcap) or 1.0, lo=lo_, hi=hi_, HAS_DOC=has_doc, HAS_SOFTCAP=bool(softcap), MERGE=merge,
        IEEE=_ieee(q), BLOCK_M=cfg["BM"], BLOCK_N=cfg["BN"],
        BLOCK_D=dp, num_warps=cfg["warps"], num_stages=cfg["stages"])
    if target is not out:
        out.copy_(target[..., :d])


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> Any:
    """The @triton.jit kernels, defined on first use (triton is imported here, not with ds_usp): Triton decides
    between interpreter and compiler when a function is decorated, so each mode gets its own copy of the module."""
    spec = importlib.util.find_spec("ds_usp.kernels._triton_kernels")
    module = importlib.util.module_from_spec(spec)
    with interpreted(interpret):
        spec.loader.exec_module(module)
    if interpret:
        inline_interpreted_helpers(module)
    return module
