"""USP attention: Ulysses all-to-all inside, ring across, as one differentiable custom op.

    topo = ds_usp.USPTopology.build(ulysses_degree=2, ring_degree=2)
    q_loc = ds_usp.shard_sequence(q, topo, dim=1, layout="zigzag")
    out_loc = ds_usp.usp_attention(q_loc, k_loc, v_loc, topo, causal=True, layout="zigzag")
    out = ds_usp.gather_sequence(out_loc, topo, dim=1, layout="zigzag")

Tensors are ``(batch, seq, heads, head_dim)``. When the global length is not a multiple of the
layout's shard count, :func:`~ds_usp.sharding.shard_sequence` pads it at the end; pass the real
length as ``seq_len=`` so padding is masked out. All inputs are checked before any collective runs.

The forward and the backward are each one ``torch.library`` custom op (``ds_usp::usp_attention_fwd``
and ``ds_usp::usp_attention_bwd``) whose derivative is registered with
``torch.library.register_autograd``. ``torch.compile`` therefore sees the attention as one opaque
operator with a known derivative: it neither traces into the collectives (an autograd function that
fills ``empty_like`` buffers through collectives gets a silently zero gradient under compile, as
DeepSpeed documents in ``deepspeed/sequence/layer.py``) nor breaks the graph. Process groups cannot
appear in an operator schema, so the ops take the groups' names and look them up in
torch.distributed's own registry (:func:`ds_usp.comm.resolve_group`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_usp.attention.checks import check_device, check_qkv, check_same_across_ranks, check_scale
from ds_usp.attention.ring import RingSpec, ring_backward, ring_forward
from ds_usp.attention.ulysses import head_split, head_to_seq, kv_replication, seq_to_head
from ds_usp.comm import resolve_group
from ds_usp.kernels import BACKEND_CHOICES, AttnBackend, get_backend
from ds_usp.ops import TorchOps, check_native_op, resolve_native_op
from ds_usp.sharding import check_layout, resolve_seq_len
from ds_usp.topology import USPTopology

_NATIVE = {"auto": "auto", "true": True, "false": False}  # the op schema carries usp.native_op as a string


@dataclass(frozen=True)
class _Run:
    """What one attention call needs besides its tensors, resolved from the ops' plain arguments."""

    ulysses_group: Any
    world: int  # U
    ring: RingSpec
    backend: AttnBackend
    ops: TorchOps
    heads: list[int]  # q, k, v head columns of one chunk of the q/k/v all-to-all
    rep: int  # kv head replication


def _resolve(x: Tensor, hq: int, hkv: int, ulysses_group: str, ring_group: str, layout: str, seq_len: int,
             attn_backend: str, native_op: str) -> _Run:
    """Groups, ring, kernel and packing for a call whose sequence-layout tensors look like ``x``."""
    ug, rg = resolve_group(ulysses_group), resolve_group(ring_group)
    world = dist.get_world_size(ug)
    _, padded = resolve_seq_len(seq_len, x.shape[1], world, dist.get_world_size(rg), layout)
    ring = RingSpec(group=rg, ranks=tuple(dist.get_process_group_ranks(rg)), rank=dist.get_rank(rg),
                    layout=layout, seq_len=seq_len, padded_len=padded)
    return _Run(ulysses_group=ug, world=world, ring=ring, backend=get_backend(attn_backend, x.device, x.dtype),
                ops=resolve_native_op(_NATIVE[native_op], x.device), heads=head_split(hq, hkv, world),
                rep=kv_replication(hkv, world))


@torch.library.custom_op("ds_usp::usp_attention_fwd", mutates_args=())
def _usp_fwd(q: Tensor, k: Tensor, v: Tensor, ulysses_group: str, ring_group: str, sp_group: str, causal: bool,
             layout: str, seq_len: int, scale: float, attn_backend: str,
             native_op: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, qkv_heads, out_heads, lse)``; the last three are the backward's residuals.

    ``qkv_heads`` ``(b, U*s, Hp, d)`` and ``out_heads`` ``(b, U*s, hq/U, d)`` are empty when U is 1
    (the backward then uses q, k, v and out themselves); ``lse`` is ``(b, hq/U, U*s)`` fp32.
    """
    run = _resolve(q, q.shape[2], k.shape[2], ulysses_group, ring_group, layout, seq_len, attn_backend, native_op)
    check_same_across_ranks(q, k, resolve_group(sp_group), causal, layout, seq_len, scale)  # the first collective of a new signature
    if run.world == 1:
        out, lse = ring_forward(q, k, v, run.ring, causal, scale, run.backend, run.ops)
        return out, q.new_empty(0), q.new_empty(0), lse
    qkv = seq_to_head([q, k, v], [1, run.rep, run.rep], run.ulysses_group, run.world, run.ops)  # (b, U*s, Hp, d)
    qh, kh, vh = qkv.split(run.heads, dim=2)
    out_heads, lse = ring_forward(qh, kh, vh, run.ring, causal, scale, run.backend, run.ops)
    (out,) = head_to_seq([out_heads], run.heads[:1], [1], run.ulysses_group, run.world, run.ops)  # (b, s, hq, d)
    return out, qkv, out_heads, lse


@_usp_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, ulysses_group: str, ring_group: str, sp_group: str, causal: bool,
      layout: str, seq_len: int, scale: float, attn_backend: str,
      native_op: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    world = dist.get_world_size(resolve_group(ulysses_group))
    b, s, hq, d = q.shape
    lse = q.new_empty(b, hq // world, world * s, dtype=torch.float32)
    if world == 1:
        return torch.empty_like(q), q.new_empty(0), q.new_empty(0), lse
    heads = head_split(hq, k.shape[2], world)
    return (torch.empty_like(q), q.new_empty(b, world * s, sum(heads), d), q.new_empty(b, world * s, heads[0], d),
            lse)


@torch.library.custom_op("ds_usp::usp_attention_bwd", mutates_args=())
def _usp_bwd(dout: Tensor, qkv: list[Tensor], out: Tensor, lse: Tensor, num_kv_heads: int, ulysses_group: str,
             ring_group: str, causal: bool, layout: str, seq_len: int, scale: float, attn_backend: str,
             native_op: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the sequence layout.

    ``qkv`` is ``[q, k, v]`` and ``out`` the output when U is 1; otherwise ``qkv`` is ``[qkv_heads]``
    and ``out`` is ``out_heads`` (the forward's residuals).
    """
    run = _resolve(dout, dout.shape[2], num_kv_heads, ulysses_group, ring_group, layout, seq_len, attn_backend,
                   native_op)
    if run.world == 1:  # everything is in the ring layout already
        q, k, v = qkv
        return ring_backward(dout.contiguous(), q, k, v, out, lse, run.ring, causal, scale, run.backend, run.ops)
    qh, kh, vh = qkv[0].split(run.heads, dim=2)
    dout_heads = seq_to_head([dout], [1], run.ulysses_group, run.world, run.ops)  # (b, U*s, hq/U, d)
    dqh, dkh, dvh = ring_backward(dout_heads, qh, kh, vh, out, lse, run.ring, causal, scale, run.backend, run.ops)
    del dout_heads
    dq, dk, dv = head_to_seq([dqh, dkh, dvh], run.heads, [1, run.rep, run.rep], run.ulysses_group, run.world,
                             run.ops)
    return dq, dk, dv


@_usp_bwd.register_fake
def _(dout: Tensor, qkv: list[Tensor], out: Tensor, lse: Tensor, num_kv_heads: int, ulysses_group: str,
      ring_group: str, causal: bool, layout: str, seq_len: int, scale: float, attn_backend: str,
      native_op: str) -> tuple[Tensor, Tensor, Tensor]:
    b, s, _, d = dout.shape
    return torch.empty_like(dout), dout.new_empty(b, s, num_kv_heads, d), dout.new_empty(b, s, num_kv_heads, d)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, ulysses_group, ring_group, _sp_group, *flags = inputs  # flags: causal ... native_op
    out, qkv_heads, out_heads, lse = output
    ctx.args = (k.shape[2], ulysses_group, ring_group, *flags)
    if qkv_heads.numel():  # U > 1: the head-layout residuals
        ctx.save_for_backward(qkv_heads, out_heads, lse)
    else:
        ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(qkv_heads, out_heads, lse)


def _backward(ctx: Any, dout: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
    *qkv, out, lse = ctx.saved_tensors
    dq, dk, dv = _usp_bwd(dout, qkv, out, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * 9


torch.library.register_autograd("ds_usp::usp_attention_fwd", _backward, setup_context=_setup_context)


def usp_attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, causal: bool = True,
                  layout: str = "zigzag", softmax_scale: Optional[float] = None, seq_len: Optional[int] = None,
                  attn_backend: str = "auto", native_op: Union[bool, str] = "auto") -> Tensor:
    """Exact attention over a sequence sharded across ``topo``'s sequence-parallel group.

    Args:
        q: ``(b, s_local, hq, d)``, this rank's shard (from :func:`~ds_usp.sharding.shard_sequence`).
        k: ``(b, s_local, hkv, d)``; ``hq % hkv == 0`` (GQA/MQA).
        v: ``(b, s_local, hkv, d)``.
        topo: the USP topology (any ``ulysses_degree x ring_degree``).
        causal: causal (lower-triangular) attention over global positions.
        layout: ``"contiguous"`` or ``"zigzag"``, as the inputs were sharded.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        seq_len: real global length when the sequence was padded by ``shard_sequence``;
            ``None`` means ``s_local * U * R`` (no padding).
        attn_backend: local kernel: ``"auto"``, ``"torch"``, ``"flash_attn"`` (``"triton"`` is not built yet).
        native_op: ``usp.native_op``: ``"auto"`` uses the native op (:mod:`ds_usp.ops`) for the
            packing, merge and accumulation when it builds and else the PyTorch twins, with one
            warning; ``True`` requires it; ``False`` never builds it. Same numbers either way.

    Returns:
        ``(b, s_local, hq, d)`` in the input dtype: this rank's shard of the output.

    Raises:
        ValueError: bad shapes, dtypes, devices, head counts vs degrees, layout, ``causal``,
            ``softmax_scale``, ``seq_len``, ``attn_backend`` or ``native_op``, raised before any
            communication; or ranks of the SP group that pass different shapes or arguments (checked
            once per signature with one small all-gather, the same error on every rank).
        ds_usp.ops.NativeOpUnavailable: ``native_op=True`` and the op cannot be built or loaded.
    """
    check_qkv(q, k, v, topo.ulysses_degree)
    check_device(q.device, topo.sp_group)
    check_layout(layout)
    if not isinstance(causal, bool):
        raise ValueError(f"causal ({causal!r}) must be True or False")
    check_scale(softmax_scale)
    real_len, _ = resolve_seq_len(seq_len, q.shape[1], topo.ulysses_degree, topo.ring_degree, layout)
    if attn_backend not in BACKEND_CHOICES:
        get_backend(attn_backend, q.device)  # raises the message that lists what is usable here
    check_native_op(native_op)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ulysses, ring, sp = topo.group_names
    out, *_ = _usp_fwd(q, k, v, ulysses, ring, sp, causal, layout, real_len, scale, attn_backend,
                       str(native_op).lower())
    return out


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, **kwargs: Any) -> Tensor:
    """DeepSpeed-Ulysses attention: :func:`usp_attention` on a topology with ``ring_degree == 1``.

    Args:
        q, k, v: this rank's shards, as for :func:`usp_attention`.
        topo: a topology with ring degree 1.
        **kwargs: as for :func:`usp_attention`.

    Returns:
        This rank's shard of the output.

    Raises:
        ValueError: the topology has a ring, or any :func:`usp_attention` error.
    """
    _require_degree("ulysses_attention", "ring_degree", topo.ring_degree)
    return usp_attention(q, k, v, topo, **kwargs)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, **kwargs: Any) -> Tensor:
    """Ring attention: :func:`usp_attention` on a topology with ``ulysses_degree == 1``.

    Args:
        q, k, v: this rank's shards, as for :func:`usp_attention`.
        topo: a topology with Ulysses degree 1.
        **kwargs: as for :func:`usp_attention`.

    Returns:
        This rank's shard of the output.

    Raises:
        ValueError: the topology has a Ulysses degree above 1, or any :func:`usp_attention` error.
    """
    _require_degree("ring_attention", "ulysses_degree", topo.ulysses_degree)
    return usp_attention(q, k, v, topo, **kwargs)


def _require_degree(entry: str, key: str, value: int) -> None:
    if value != 1:
        raise ValueError(f"{entry} needs {key} 1, the topology has {value}; use usp_attention")


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
