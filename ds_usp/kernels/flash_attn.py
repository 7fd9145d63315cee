"""Adapter over flash-attn 2.x's internal ``_flash_attn_forward`` / ``_flash_attn_backward``.

flash_attn is imported lazily inside the functions; importing this module does nothing.
All flash-attn version differences are handled here:

* the window argument is ``window_size=(l, r)`` before 2.6.3 and ``window_size_left`` /
  ``window_size_right`` from 2.6.3 on; ``alibi_slopes`` (2.4+), ``softcap`` (2.6+) and
  ``deterministic`` (2.4+) exist only in some versions. Arguments are passed by keyword, filtered
  to the parameters the installed function declares.
* ``_flash_attn_forward`` returns ``(out, q, k, v, out_padded, lse, S_dmask, rng_state)`` before
  2.6.3 and ``(out_padded, lse, S_dmask, rng_state)`` from 2.6.3 on.
* from 2.6.3 the kernels require head_dim % 8 == 0 (earlier ones padded internally); the head dim
  is zero-padded here for every version, which leaves scores, lse and the unpadded grads unchanged.
* from 2.7 (torch >= 2.4) the functions are ``torch.library`` custom ops whose Python signature is
  kept in ``_init_fn``; ``_flash_attn_backward`` writes dq/dk/dv into the buffers it is given
  (all 2.x versions do), so they are preallocated here.

Inputs/outputs are bshd, which is flash-attn's native layout; flash-attn supports GQA/MQA
natively and returns lse as a contiguous (b, h, sq) float32 tensor.

Untested on a GPU so far: flash-attn has not been installed on a GPU host of this project (PyPI has no
binary wheel of it, and building it from source was out of reach there), so these version rules are tested
only on CPU, against stand-ins of the 2.5 and 2.7 private APIs (tests/test_kernels.py); the CUDA tests of this
backend skip without it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["unavailable_reason", "attention_forward", "attention_backward"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIM_MULTIPLE = 8
_MAX_HEAD_DIM = 256
# Parameter lists of flash-attn >= 2.6.3, used when the installed functions hide their signature
# (flash-attn >= 2.7 on torch < 2.4 wraps them in an undecorated ``inner(*args, **kwargs)``).
_LATEST_FORWARD_PARAMS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
                          "window_size_right", "softcap", "alibi_slopes", "return_softmax")
_LATEST_BACKWARD_PARAMS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
                           "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
                           "alibi_slopes", "deterministic", "rng_state")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the flash_attn backend cannot run on ``device``.

    Args:
        device: the device attention will run on.

    Returns:
        None if flash-attn 2.x imports and ``device`` is CUDA, else a one-line reason.
    """
    if device.type != "cuda":
        return f"flash_attn needs a CUDA device (got {device.type})"
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "flash_attn":
            return "flash_attn: not installed"
        return f"flash_attn: import failed ({exc})"
    except Exception as exc:  # broken builds raise ImportError/OSError/RuntimeError (ABI, missing CUDA libs)
        return f"flash_attn: import failed ({type(exc).__name__}: {exc})"
    version = str(getattr(flash_attn, "__version__", "unknown"))
    if not version.startswith("2."):
        return f"flash_attn: version {version} is not supported (need 2.x)"
    if not all(hasattr(flash_attn_interface, n) for n in ("_flash_attn_forward", "_flash_attn_backward")):
        return f"flash_attn: version {version} lacks _flash_attn_forward/_flash_attn_backward"
    return None


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention output and log-sum-exp with flash-attn.

    Args:
        q: (b, sq, hq, d) queries, fp16/bf16 on CUDA.
        k: (b, sk, hkv, d) keys, hq % hkv == 0.
        v: (b, sk, hkv, d) values.
        causal: causal mask (callers guarantee sq == sk, so top-/bottom-left alignment agree).
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none), flash-attn's own ``softcap`` (2.6+).

    Returns:
        out (b, sq, hq, d) in q.dtype and lse (b, hq, sq) float32.

    Raises:
        ValueError: for dtypes or head dims flash-attn does not support.
        RuntimeError: if the installed flash-attn has an unknown ``_flash_attn_forward`` signature.
    """
    _check_supported(q, softcap)
    from flash_attn import flash_attn_interface

    head_dim = q.shape[-1]
    args = {
        "q": _pad_head_dim(q), "k": _pad_head_dim(k), "v": _pad_head_dim(v),
        "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
        "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
        "softcap": float(softcap), "alibi_slopes": None, "return_softmax": False,
    }
    res = _call(flash_attn_interface._flash_attn_forward, args, _LATEST_FORWARD_PARAMS)
    out, lse = (res[0], res[5]) if len(res) == 8 else (res[0], res[1])  # 8-tuple before 2.6.3
    return out[..., :head_dim], lse


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention with flash-attn, given the final output and log-sum-exp.

    Args:
        dout: (b, sq, hq, d) gradient of the output.
        q: (b, sq, hq, d) queries.
        k: (b, sk, hkv, d) keys.
        v: (b, sk, hkv, d) values.
        out: (b, sq, hq, d) output the softmax statistics belong to (may be a merge over KV blocks).
        lse: (b, hq, sq) log-sum-exp matching ``out``.
        causal: causal mask (sq == sk).
        scale: softmax scale.
        softcap: attention logit soft-cap (0: none).

    Returns:
        dq (b, sq, hq, d), dk (b, sk, hkv, d), dv (b, sk, hkv, d), all in q.dtype.

    Raises:
        ValueError: for dtypes or head dims flash-attn does not support.
        RuntimeError: if the installed flash-attn has an unknown ``_flash_attn_backward`` signature.
    """
    _check_supported(q, softcap)
    from flash_attn import flash_attn_interface

    head_dim = q.shape[-1]
    qp, kp, vp = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
    dq = torch.empty(qp.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(kp.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(vp.shape, dtype=v.dtype, device=v.device)
    args = {
        "dout": _pad_head_dim(dout), "q": qp, "k": kp, "v": vp, "out": _pad_head_dim(out),
        "softmax_lse": lse.to(torch.float32).contiguous(), "dq": dq, "dk": dk, "dv": dv,
        "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
        "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
        "softcap": float(softcap), "alibi_slopes": None, "deterministic": False, "rng_state": None,
    }
    _call(flash_attn_interface._flash_attn_backward, args, _LATEST_BACKWARD_PARAMS)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


def _check_supported(q: Tensor, softcap: float = 0.0) -> None:
    """Reject inputs the flash-attn kernels cannot take, with a message naming the alternative."""
    if softcap:
        from flash_attn import flash_attn_interface

        names, _ = _param_names(flash_attn_interface._flash_attn_forward, _LATEST_FORWARD_PARAMS)
        if "softcap" not in names:
            raise ValueError("this flash-attn has no softcap (2.6 added it) and the model soft-caps its attention "
                             "scores: upgrade flash-attn or use usp.attn_backend='torch'")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"flash_attn supports only float16/bfloat16 inputs, got {q.dtype}; "
                         "use usp.attn_backend='torch' for other dtypes")
    if q.shape[-1] > _MAX_HEAD_DIM:
        raise ValueError(f"flash_attn supports head_dim <= {_MAX_HEAD_DIM}, got {q.shape[-1]}; "
                         "use usp.attn_backend='torch'")


def _pad_head_dim(x: Tensor) -> Tensor:
    """Zero-pad the last dim to a multiple of 8 and make it unit-stride, as the kernels require."""
    pad = -x.shape[-1] % _HEAD_DIM_MULTIPLE
    if pad:
        return F.pad(x, (0, pad))  # (b, s, h, d) -> (b, s, h, round_up(d, 8))
    return x if x.stride(-1) == 1 else x.contiguous()


def _param_names(fn: Callable[..., Any], fallback: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(all parameter names, required parameter names) of a flash-attn function."""
    target = getattr(fn, "_init_fn", fn)  # torch.library CustomOpDef keeps the Python function here
    params = list(inspect.signature(target).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return fallback, fallback
    return tuple(p.name for p in params), tuple(p.name for p in params if p.default is p.empty)


def _call(fn: Callable[..., Any], candidates: dict[str, Any], fallback: tuple[str, ...]) -> Any:
    """Call ``fn`` with the subset of ``candidates`` its signature declares, by keyword."""
    names, required = _param_names(fn, fallback)
    missing = [n for n in required if n not in candidates]
    if missing:
        import flash_attn

        raise RuntimeError(f"unsupported flash_attn {getattr(flash_attn, '__version__', '?')}: "
                           f"{getattr(fn, '__name__', fn)} needs unknown arguments {missing}")
    return fn(**{n: candidates[n] for n in names if n in candidates})
