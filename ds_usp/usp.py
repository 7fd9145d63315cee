"""USP attention: Ulysses all-to-all inside, ring across; plus sequence sharding helpers.

    topo = ds_usp.USPTopology.build(ulysses_degree=2, ring_degree=2)
    q_loc = ds_usp.shard_sequence(q, topo, dim=1, layout="zigzag")
    out_loc = ds_usp.usp_attention(q_loc, k_loc, v_loc, topo, causal=True, layout="zigzag")
    out = ds_usp.gather_sequence(out_loc, topo, dim=1, layout="zigzag")

Tensors are ``(batch, seq, heads, head_dim)``. When the global length is not a multiple of the
layout's shard count, :func:`shard_sequence` pads it at the end; pass the real length as
``seq_len=`` to :func:`usp_attention` and :func:`gather_sequence` so padding is masked out and cut.
All inputs are checked before any collective runs.
"""
from __future__ import annotations

import math
import struct
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_usp.comm import all_gather_rows, backend_device_type, gather_seq
from ds_usp.kernels import get_backend
from ds_usp.layout import LAYOUTS, check_layout, padded_length, resolve_seq_len, shard_positions
from ds_usp.native import check_native_op, resolve_native_op
from ds_usp.ring import RingSpec, ring_attention_piece
from ds_usp.topology import USPTopology
from ds_usp.ulysses import check_heads, out_head_to_seq, qkv_seq_to_head

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local sequence length "
                         f"and head_dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[1] == 0:
        raise ValueError("the local sequence is empty")
    check_heads(q.shape[2], k.shape[2], topo.ulysses_degree)
    check_device(q.device, topo)


def check_device(device: torch.device, topo: USPTopology) -> None:
    """Refuse tensors the USP groups' backend cannot move (NCCL needs CUDA tensors, gloo CPU ones).

    Args:
        device: the tensors' device.
        topo: the topology.

    Raises:
        ValueError: the device does not match the process groups' backend.
    """
    if topo.sp_size == 1:
        return
    wanted = backend_device_type(topo.sp_group)
    if wanted is not None and device.type != wanted:
        raise ValueError(f"the tensors are on {device}, but the sequence-parallel groups use "
                         f"{dist.get_backend(topo.sp_group)}, which "
                         f"needs {wanted} tensors; move them with .to('{wanted}') or initialize "
                         f"distributed with the other backend")


_SIGNATURE = ("batch", "local sequence length", "q heads", "kv heads", "head_dim", "dtype", "causal", "layout",
              "seq_len", "softmax_scale")


def _check_same_across_ranks(q: Tensor, k: Tensor, topo: USPTopology, causal: bool, layout: str, seq_len: int,
                             scale: float) -> None:
    """Check once per input signature that every rank of the SP group calls with the same one.

    A mismatch would otherwise deadlock or garble the all-to-all and the ring. The check is one
    small all-gather the first time a signature is seen on this topology (later calls with the
    same shapes cost nothing). A rank whose shapes change while the others reuse a signature they
    already checked is caught by the group timeout instead.
    """
    if topo.sp_size == 1:
        return
    sig = (*q.shape[:3], k.shape[2], q.shape[3], DTYPES.index(q.dtype), int(causal), LAYOUTS.index(layout), seq_len,
           struct.unpack("<q", struct.pack("<d", scale))[0])
    if sig in topo.agreed_signatures:
        return
    rows = [tuple(r.tolist()) for r in all_gather_rows(torch.tensor(sig, device=q.device), topo.sp_group,
                                                          "usp_attention input check")]
    bad = [i for i, name in enumerate(_SIGNATURE) if len({r[i] for r in rows}) > 1]
    if bad:
        def show(i: int, x: int) -> str:
            if _SIGNATURE[i] == "dtype":
                return str(DTYPES[x]).replace("torch.", "")
            if _SIGNATURE[i] == "layout":
                return LAYOUTS[x]
            if _SIGNATURE[i] == "softmax_scale":
                return f"{struct.unpack('<d', struct.pack('<q', x))[0]:g}"
            return str(bool(x)) if _SIGNATURE[i] == "causal" else str(x)

        ranks = list(topo.sp_ranks)
        diffs = "; ".join(_SIGNATURE[i] + ": " + ", ".join(f"rank {ranks[p]}={show(i, r[i])}" for p, r in enumerate(rows))
                          for i in bad)
        raise ValueError(f"usp_attention was called with different inputs on the ranks of one sequence-parallel "
                         f"group ({diffs}); every rank must pass its shard of the same sequences (shard them with "
                         f"ds_usp.shard_sequence / ds_usp.shard_batch) with the same arguments")
    topo.agreed_signatures.add(sig)


def usp_attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, causal: bool = True,
                  layout: str = "zigzag", softmax_scale: Optional[float] = None, seq_len: Optional[int] = None,
                  attn_backend: str = "auto", native_op: Union[bool, str] = "auto") -> Tensor:
    """Exact attention over a sequence sharded across ``topo``'s sequence-parallel group.

    Args:
        q: ``(b, s_local, hq, d)``, this rank's shard (from :func:`shard_sequence` with ``layout``).
        k: ``(b, s_local, hkv, d)``; ``hq % hkv == 0`` (GQA/MQA).
        v: ``(b, s_local, hkv, d)``.
        topo: the USP topology (any ``ulysses_degree x ring_degree``).
        causal: causal (lower-triangular) attention over global positions.
        layout: ``"contiguous"`` or ``"zigzag"``, as the inputs were sharded.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        seq_len: real global length when the sequence was padded by :func:`shard_sequence`;
            ``None`` means ``s_local * U * R`` (no padding).
        attn_backend: local kernel: ``"auto"``, ``"torch"``, ``"flash_attn"`` (``"triton"`` is not built yet).
        native_op: ``usp.native_op``: ``"auto"`` uses the native op (:mod:`ds_usp.native`) for the
            packing, merge and accumulation when it builds and else the PyTorch code, with one
            warning; ``True`` requires it; ``False`` never builds it. Same numbers either way.

    Returns:
        ``(b, s_local, hq, d)`` in the input dtype: this rank's shard of the output.

    Raises:
        ValueError: bad shapes, dtypes, devices, head counts vs degrees, layout, ``causal``,
            ``softmax_scale``, ``seq_len`` or ``native_op``, raised before any communication; or
            ranks of the SP group that pass different shapes or arguments (checked once per
            signature with one small all-gather, the same error on every rank).
        ds_usp.native.NativeOpUnavailable: ``native_op=True`` and the op cannot be built or loaded.
    """
    _check_qkv(q, k, v, topo)
    check_layout(layout)
    if not isinstance(causal, bool):
        raise ValueError(f"causal ({causal!r}) must be True or False")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale ({softmax_scale!r}) must be a positive finite number or None "
                         f"(None: 1/sqrt(head_dim))")
    real_len, padded = resolve_seq_len(seq_len, q.shape[1], topo.ulysses_degree, topo.ring_degree, layout)
    backend = get_backend(attn_backend, q.device, q.dtype)
    ops = resolve_native_op(native_op, q.device)  # NativeOps or None (the PyTorch twins)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _check_same_across_ranks(q, k, topo, causal, layout, real_len, scale)
    spec = RingSpec(group=topo.ring_group, ranks=topo.ring_ranks, rank=topo.ring_rank, layout=layout,
                    seq_len=real_len, padded_len=padded)
    qh, kh, vh = qkv_seq_to_head(q, k, v, topo.ulysses_group, topo.ulysses_degree, ops)  # (b, s_local*U, h/U, d)
    out = ring_attention_piece(qh, kh, vh, spec, causal, scale, backend, ops)
    return out_head_to_seq(out, topo.ulysses_group, topo.ulysses_degree, ops)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, **kwargs) -> Tensor:
    """DeepSpeed-Ulysses attention: :func:`usp_attention` on a topology with ``ring_degree == 1``.

    Args:
        q: see :func:`usp_attention`.
        k: see :func:`usp_attention`.
        v: see :func:`usp_attention`.
        topo: a topology with ring degree 1.
        **kwargs: as for :func:`usp_attention`.

    Returns:
        This rank's shard of the output.

    Raises:
        ValueError: the topology has a ring, or any :func:`usp_attention` error.
    """
    if topo.ring_degree != 1:
        raise ValueError(f"ulysses_attention needs ring_degree 1, the topology has {topo.ring_degree}; "
                         f"use usp_attention")
    return usp_attention(q, k, v, topo, **kwargs)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, **kwargs) -> Tensor:
    """Ring attention: :func:`usp_attention` on a topology with ``ulysses_degree == 1``.

    Args:
        q: see :func:`usp_attention`.
        k: see :func:`usp_attention`.
        v: see :func:`usp_attention`.
        topo: a topology with Ulysses degree 1.
        **kwargs: as for :func:`usp_attention`.

    Returns:
        This rank's shard of the output.

    Raises:
        ValueError: the topology has a Ulysses degree above 1, or any :func:`usp_attention` error.
    """
    if topo.ulysses_degree != 1:
        raise ValueError(f"ring_attention needs ulysses_degree 1, the topology has {topo.ulysses_degree}; "
                         f"use usp_attention")
    return usp_attention(q, k, v, topo, **kwargs)


def _check_dim(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise ValueError(f"expected a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim ({dim}) is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard_sequence(x: Tensor, topo: USPTopology, dim: int = 1, layout: str = "zigzag",
                   pad_value: float = 0) -> Tensor:
    """This rank's shard of a full-sequence tensor (no communication).

    The sequence is padded with ``pad_value`` at its end to a multiple of ``U*R`` (contiguous) or
    ``2*U*R`` (zigzag); pass the real length as ``seq_len`` to :func:`usp_attention`/:func:`gather_sequence`.

    Args:
        x: the full tensor, identical on every rank of the SP group.
        topo: the topology.
        dim: the sequence dimension.
        layout: ``"contiguous"`` or ``"zigzag"``.
        pad_value: the value of the padding (e.g. a pad token id, or -100 for labels).

    Returns:
        The shard, ``x.shape[dim]`` padded and divided by ``U*R`` along ``dim``; differentiable.

    Raises:
        ValueError: bad ``dim`` or ``layout``, or an empty sequence.
    """
    dim = _check_dim(x, dim)
    check_layout(layout)
    n = x.shape[dim]
    if n == 0:
        raise ValueError("cannot shard an empty sequence")
    padded = padded_length(n, topo.ulysses_degree, topo.ring_degree, layout)
    if padded != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = padded - n
        x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
    idx = shard_positions(padded, topo.ulysses_degree, topo.ring_degree, topo.sp_rank, layout).to(x.device)
    return x.index_select(dim, idx)


def gather_sequence(x: Tensor, topo: USPTopology, dim: int = 1, layout: str = "zigzag",
                    seq_len: Optional[int] = None) -> Tensor:
    """Reassemble the full sequence from every SP rank's shard (inverse of :func:`shard_sequence`).

    The backward keeps this rank's shard of the gradient: exact when every rank uses the gathered
    tensor the same way (e.g. computes the same loss on it).

    Args:
        x: this rank's shard.
        topo: the topology.
        dim: the sequence dimension.
        layout: ``"contiguous"`` or ``"zigzag"``.
        seq_len: real global length, to cut the padding off (``None``: keep every position).

    Returns:
        The full tensor, in global position order.

    Raises:
        ValueError: bad ``dim``, ``layout`` or ``seq_len``.
    """
    dim = _check_dim(x, dim)
    check_layout(layout)
    real_len, padded = resolve_seq_len(seq_len, x.shape[dim], topo.ulysses_degree, topo.ring_degree, layout)
    full = gather_seq(x, topo.sp_group, dim) if topo.sp_size > 1 else x  # shards in SP-rank order
    order = torch.cat([shard_positions(padded, topo.ulysses_degree, topo.ring_degree, p, layout)
                       for p in range(topo.sp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(padded)
    return full.index_select(dim, inverse[:real_len].to(x.device))


class USPAttention(nn.Module):
    """``nn.Module`` form of :func:`usp_attention` (no parameters).

    Args:
        topo: the topology.
        causal: causal attention.
        layout: ``"contiguous"`` or ``"zigzag"``.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        attn_backend: local kernel choice.
        native_op: ``"auto"``, ``True`` or ``False`` (see :func:`usp_attention`).
    """

    def __init__(self, topo: USPTopology, causal: bool = True, layout: str = "zigzag",
                 softmax_scale: Optional[float] = None, attn_backend: str = "auto",
                 native_op: Union[bool, str] = "auto") -> None:
        super().__init__()
        check_layout(layout)
        check_native_op(native_op)
        self.topo, self.causal, self.layout = topo, causal, layout
        self.softmax_scale, self.attn_backend, self.native_op = softmax_scale, attn_backend, native_op

    def forward(self, q: Tensor, k: Tensor, v: Tensor, seq_len: Optional[int] = None) -> Tensor:
        """Attention of this rank's shards; see :func:`usp_attention`.

        Args:
            q: ``(b, s_local, hq, d)``.
            k: ``(b, s_local, hkv, d)``.
            v: ``(b, s_local, hkv, d)``.
            seq_len: real global length when padded.

        Returns:
            ``(b, s_local, hq, d)``.
        """
        return usp_attention(q, k, v, self.topo, causal=self.causal, layout=self.layout,
                             softmax_scale=self.softmax_scale, seq_len=seq_len, attn_backend=self.attn_backend,
                             native_op=self.native_op)
