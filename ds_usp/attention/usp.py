"""USP attention: Ulysses all-to-all inside, ring across, as differentiable custom ops.

    topo = ds_usp.USPTopology.build(ulysses_degree=2, ring_degree=2)
    q_loc = ds_usp.shard_sequence(q, topo, dim=1, layout="zigzag")
    out_loc = ds_usp.usp_attention(q_loc, k_loc, v_loc, topo, causal=True, layout="zigzag")
    out = ds_usp.gather_sequence(out_loc, topo, dim=1, layout="zigzag")

Tensors are ``(batch, seq, heads, head_dim)``. When the global length is not a multiple of the
layout's shard count, :func:`~ds_usp.sharding.shard_sequence` pads it at the end; pass the real
length as ``seq_len=`` so padding is masked out. All inputs are checked before any collective runs. Layouts:
``"contiguous"``, ``"zigzag"`` (causal work balanced over the ring) and ``"balanced"`` (packed documents placed so
each rank's causal work is even; shard with the same ``doc_lens``). The local kernel (``attn_backend``) is torch's
SDPA ops, flash-attn or ds-usp's Triton kernels (:mod:`ds_usp.kernels`).

One call is three ``torch.library`` custom ops, each with a registered derivative:

* ``ds_usp::seq_to_head``: q, k, v (kv heads replicated where needed) through one all-to-all;
  its derivative is ``ds_usp::head_to_seq`` and the other way round;
* ``ds_usp::ring_attention``: the ring over the Ulysses group's piece, returning ``(out, lse)``;
  its derivative is ``ds_usp::ring_attention_bwd``; its options are one :class:`RingOptions` record;
* ``ds_usp::head_to_seq``: the output back to this rank's sequence shard.

``torch.compile`` therefore sees opaque operators with known derivatives: it neither traces into the
collectives (an autograd function that fills ``empty_like`` buffers through collectives gets a
silently zero gradient under compile, as DeepSpeed documents in ``deepspeed/sequence/layer.py``) nor
breaks the graph; and selective activation checkpointing (:mod:`ds_usp.integration.step.recompute`) can keep
the ring's result instead of recomputing it. Process groups cannot appear in an operator schema,
so the ops take the groups' names and look them up in torch.distributed's own registry
(:func:`ds_usp.comm.resolve_group`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_usp.attention.checks import (SPANS, VALID_KEYS, check_device, check_keys, check_qkv,
                                     check_same_across_ranks, check_scale, check_sinks, check_softcap, check_spans,
                                     documents_agreed, value_agreed)
from ds_usp.attention.counter import count_sp_layer
from ds_usp.attention.documents import Documents, doc_tensor, made_from, value_made_from
from ds_usp.attention.masks import MaskSpec, chunk_docs
from ds_usp.attention.ring import RingSpec, ring_backward, ring_forward, sink_grad
from ds_usp.attention.ulysses import head_to_seq, seq_to_head
from ds_usp.comm import resolve_group
from ds_usp.config import COMM_DTYPES
from ds_usp.kernels import BACKEND_CHOICES, get_backend, resolve_backend
from ds_usp.native import TorchOps, check_native_op, resolve_native_op
from ds_usp.sharding import check_layout, normalize_docs, resolve_seq_len, segment_bounds
from ds_usp.splits import head_split, kv_replication
from ds_usp.topology import USPTopology

_NATIVE = {"auto": "auto", "true": True, "false": False}  # the op schemas carry usp.native_op as a string


def _ops(native_op: str, x: Tensor) -> TorchOps:
    return resolve_native_op(_NATIVE[native_op], x.device)


def _world(group: str) -> int:
    return dist.get_world_size(resolve_group(group))


# ------------------------------------------------------------------------ Ulysses: sequence <-> heads


@torch.library.custom_op("ds_usp::seq_to_head", mutates_args=())
def _seq_to_head(xs: list[Tensor], reps: list[int], group: str, native_op: str, comm_dtype: str) -> Tensor:
    """``n x (b, s, h_i, d)`` -> ``(b, U*s, Hp, d)`` through one all-to-all (see :func:`ulysses.seq_to_head`);
    ``comm_dtype``: ``usp.comm_dtype`` of this exchange (its derivative always sends the training dtype)."""
    g = resolve_group(group)
    return seq_to_head(xs, reps, g, dist.get_world_size(g), _ops(native_op, xs[0]), comm_dtype == "fp8")


@_seq_to_head.register_fake
def _(xs: list[Tensor], reps: list[int], group: str, native_op: str, comm_dtype: str) -> Tensor:
    world = _world(group)
    b, s, _, d = xs[0].shape
    return xs[0].new_empty(b, world * s, sum(x.shape[2] * r for x, r in zip(xs, reps)) // world, d)


@torch.library.custom_op("ds_usp::head_to_seq", mutates_args=())
def _head_to_seq(x: Tensor, heads: list[int], reps: list[int], group: str, native_op: str,
                 comm_dtype: str) -> list[Tensor]:
    """``(b, U*s, sum heads, d)`` -> ``[(b, s, U*h_i/rep_i, d)]`` (see :func:`ulysses.head_to_seq`)."""
    g = resolve_group(group)
    return head_to_seq([x], heads, reps, g, dist.get_world_size(g), _ops(native_op, x), comm_dtype == "fp8")


@_head_to_seq.register_fake
def _(x: Tensor, heads: list[int], reps: list[int], group: str, native_op: str,
      comm_dtype: str) -> list[Tensor]:
    world = _world(group)
    b, big_s, _, d = x.shape
    return [x.new_empty(b, big_s // world, world * h // r, d) for h, r in zip(heads, reps)]


def _seq_to_head_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    xs, reps, group, native_op, _ = inputs
    world = _world(group)
    ctx.args = ([x.shape[2] * r // world for x, r in zip(xs, reps)], list(reps), group, native_op)


def _seq_to_head_backward(ctx: Any, grad: Tensor) -> tuple:  # gradients travel in the training dtype
    return list(_head_to_seq(grad.contiguous(), *ctx.args, "input")), None, None, None, None


def _head_to_seq_setup(ctx: Any, inputs: tuple, output: list[Tensor]) -> None:
    x, heads, reps, group, native_op, _ = inputs
    ctx.args = (list(reps), group, native_op)
    ctx.shapes = [(o.shape, o.dtype, o.device) for o in output]


def _head_to_seq_backward(ctx: Any, grads: list[Optional[Tensor]]) -> tuple:
    grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
             for g, (shape, dtype, device) in zip(grads, ctx.shapes)]
    return _seq_to_head(grads, *ctx.args, "input"), None, None, None, None, None


torch.library.register_autograd("ds_usp::seq_to_head", _seq_to_head_backward, setup_context=_seq_to_head_setup)
torch.library.register_autograd("ds_usp::head_to_seq", _head_to_seq_backward, setup_context=_head_to_seq_setup)
seq_to_head_op, head_to_seq_op = _seq_to_head, _head_to_seq  # the differentiable all-to-alls (also linear attention's)


# ------------------------------------------------------------------------------------------- ring


def _ring_and_mask(x: Tensor, world: int, ring_group: str, causal: bool, layout: str, seq_len: int,
                   docs: Optional[Tensor], spans: Optional[Tensor], keys: Optional[Tensor], window_left: int,
                   window_right: int, chunk: int) -> tuple[RingSpec, MaskSpec]:
    """The ring of ``ring_group`` for the Ulysses group's piece ``x`` (``(b, U*s, ...)``) and the mask.

    The ring's pieces follow the batch's documents (the ``"balanced"`` layout places them); the mask's documents
    are those cut into chunks of ``chunk`` tokens (0: none).
    """
    rg = resolve_group(ring_group)
    r = dist.get_world_size(rg)
    _, padded = resolve_seq_len(seq_len, x.shape[1] // world, world, r, layout)
    doc_starts = None if docs is None else value_made_from(docs) or normalize_docs(docs, x.shape[0], seq_len)
    mask = MaskSpec(causal=causal, seq_len=seq_len, docs=chunk_docs(doc_starts, x.shape[0], seq_len, chunk),
                    window=None if window_left < 0 else (window_left, window_right),
                    spans=None if spans is None else _spans_of(spans), keys=None if keys is None else _spans_of(keys))
    ring = RingSpec(group=rg, ranks=tuple(dist.get_process_group_ranks(rg)), rank=dist.get_rank(rg), layout=layout,
                    padded_len=padded, bounds=segment_bounds(doc_starts, seq_len, padded))
    return ring, mask


def _split(qkv: list[Tensor], heads: list[int], dims: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """``[q, k, v]`` as given, or ``[qkv_heads]`` split into its q, k, v head columns (views).

    ``qkv_heads`` is ``(b, U*s, Hp, g)`` in units of ``g`` columns (:func:`_units`): its ``heads[i] * dims[i] / g``
    unit columns per tensor become ``(b, U*s, heads[i], dims[i])``.
    """
    if len(qkv) == 3:
        return tuple(qkv)
    x = qkv[0]
    g = x.shape[-1]
    parts = x.split([h * d // g for h, d in zip(heads, dims)], dim=2)
    # (b, U*s, h*d/g, g) -> (b, U*s, h, d): the unit columns of one head are adjacent
    return tuple(part.reshape(*part.shape[:2], h, d) for part, h, d in zip(parts, heads, dims))


def as_units(x: Tensor, unit: int) -> Tensor:
    """``(b, s, h, d)`` -> ``(b, s, h*d/unit, unit)``: q, k and v of different head dims (MLA) as columns of one
    width, so one all-to-all carries them; ``unit`` divides every head dim, and a rank's chunk of whole heads is a
    chunk of whole units."""
    return x if x.shape[-1] == unit else x.reshape(*x.shape[:2], -1, unit)


class RingOptions(NamedTuple):
    """The ring op's arguments after ``(qkv, heads, dims)``, in the op's order: callers build them by name and the
    derivative reads them by name (an operator schema takes no record, so the ops list them as parameters).

    ``docs``: ``(b, n)`` int64 document lengths per row (zero-padded) or None; ``spans``: ``(b, m, 2)`` int64
    bidirectional spans ``(start, end)`` per row (``(0, 0)`` pads) or None; ``keys``: ``(b, m, 2)`` int64 runs of
    valid keys per row, in the same form, or None (every key); ``window_left`` < 0: no window;
    ``chunk`` 0: no chunked attention; ``softcap`` 0: none; ``sinks``: ``(hq',)`` this rank's heads' sink logits or
    None; ``comm_dtype``: ``usp.comm_dtype`` of the K/V blocks.
    """

    ulysses_degree: int
    ring_group: str
    causal: bool
    layout: str
    seq_len: int
    scale: float
    softcap: float
    sinks: Optional[Tensor]
    attn_backend: str
    native_op: str
    docs: Optional[Tensor]
    spans: Optional[Tensor]
    keys: Optional[Tensor]
    window_left: int
    window_right: int
    chunk: int
    comm_dtype: str


_SINKS = RingOptions._fields.index("sinks")


@torch.library.custom_op("ds_usp::ring_attention", mutates_args=())
def _ring_attention(qkv: list[Tensor], heads: list[int], dims: list[int], ulysses_degree: int, ring_group: str,
                    causal: bool, layout: str, seq_len: int, scale: float, softcap: float, sinks: Optional[Tensor],
                    attn_backend: str, native_op: str, docs: Optional[Tensor], spans: Optional[Tensor],
                    keys: Optional[Tensor], window_left: int, window_right: int, chunk: int,
                    comm_dtype: str) -> tuple[Tensor, Tensor]:
    """``(out (b, U*s, hq', dv), lse (b, hq', U*s) fp32)`` of the Ulysses group's piece against the whole ring.

    ``qkv`` is ``[q, k, v]`` (U = 1) or ``[qkv_heads]`` from ``ds_usp::seq_to_head``, split by ``heads``/``dims``;
    the rest is :class:`RingOptions`.
    """
    q, k, v = _split(qkv, heads, dims)
    ring, mask = _ring_and_mask(q, ulysses_degree, ring_group, causal, layout, seq_len, docs, spans, keys,
                                window_left, window_right, chunk)
    return ring_forward(q, k, v, ring, mask, scale, resolve_backend(attn_backend, q.device, q.dtype),
                        _ops(native_op, q), softcap, sinks, comm_dtype == "fp8")


@_ring_attention.register_fake
def _(qkv: list[Tensor], heads: list[int], dims: list[int], *options: Any) -> tuple[Tensor, Tensor]:
    b, s = qkv[0].shape[:2]
    return qkv[0].new_empty(b, s, heads[0], dims[2]), qkv[0].new_empty(b, heads[0], s, dtype=torch.float32)


@torch.library.custom_op("ds_usp::ring_attention_bwd", mutates_args=())
def _ring_attention_bwd(dout: Tensor, qkv: list[Tensor], out: Tensor, lse: Tensor, heads: list[int], dims: list[int],
                        ulysses_degree: int, ring_group: str, causal: bool, layout: str, seq_len: int, scale: float,
                        softcap: float, sinks: Optional[Tensor], attn_backend: str, native_op: str,
                        docs: Optional[Tensor], spans: Optional[Tensor], keys: Optional[Tensor], window_left: int,
                        window_right: int, chunk: int, comm_dtype: str) -> list[Tensor]:
    """Gradients for ``qkv`` as it was given (``[dq, dk, dv]`` or ``[d qkv_heads]``), then ``d sinks`` if any."""
    q, k, v = _split(qkv, heads, dims)
    ring, mask = _ring_and_mask(q, ulysses_degree, ring_group, causal, layout, seq_len, docs, spans, keys,
                                window_left, window_right, chunk)
    grads = ring_backward(dout.contiguous(), q, k, v, out, lse, ring, mask, scale,
                          resolve_backend(attn_backend, q.device, q.dtype), _ops(native_op, q), softcap,
                          comm_dtype == "fp8")
    if len(qkv) == 1:  # (b, U*s, Hp, g) like qkv_heads
        unit = qkv[0].shape[-1]
        grads = [torch.cat([as_units(g, unit) for g in grads], dim=2)]
    return list(grads) + ([] if sinks is None else [sink_grad(dout, out, lse, sinks)])


@_ring_attention_bwd.register_fake
def _(dout: Tensor, qkv: list[Tensor], out: Tensor, lse: Tensor, heads: list[int], dims: list[int],
      *options: Any) -> list[Tensor]:
    sinks = RingOptions(*options).sinks
    return [torch.empty_like(x) for x in qkv] + ([] if sinks is None else [torch.empty_like(sinks)])


def _ring_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    qkv, heads, dims, *options = inputs
    out, lse = output
    ctx.heads, ctx.dims, ctx.options = heads, dims, RingOptions(*options)
    ctx.save_for_backward(*qkv, out, lse)
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx: Any, dout: Tensor, _dlse: Any) -> tuple:
    *qkv, out, lse = ctx.saved_tensors
    grads = _ring_attention_bwd(dout, qkv, out, lse, ctx.heads, ctx.dims, *ctx.options)
    dsinks = grads.pop() if ctx.options.sinks is not None else None
    # one gradient per op input: qkv, heads, dims, then the options (only sinks is differentiable)
    return (grads, None, None) + tuple(dsinks if i == _SINKS else None for i in range(len(RingOptions._fields)))


torch.library.register_autograd("ds_usp::ring_attention", _ring_backward, setup_context=_ring_setup)


# ------------------------------------------------------------------------------------- public API


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) pairs meet, over the global sequence (see :func:`usp_attention` for each field).

    Attributes:
        causal: causal attention over global positions.
        seq_len: the real global length (None: no padding).
        doc_lens: packed documents, one list for every row or one per row, or one
            :class:`~ds_usp.attention.documents.Documents` (decoded once for all the model's layers).
        window: sliding window ``(left, right)``.
        chunk: chunked attention's chunk length.
        spans: bidirectional spans, one list for every row or one per row.
        keys: the runs of valid keys, one list for every row or one per row.
    """

    causal: bool = True
    seq_len: Optional[int] = None
    doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, Documents, None] = None
    window: Optional[tuple[int, int]] = None
    chunk: Optional[int] = None
    spans: Union[Sequence[Sequence[int]], Sequence[Sequence[Sequence[int]]], Tensor, None] = None
    keys: Union[Sequence[Sequence[int]], Sequence[Sequence[Sequence[int]]], Tensor, None] = None


@dataclass(frozen=True)
class AttentionRun:
    """How the attention runs over the group, not what it computes (the ``usp`` keys of the same names).

    Attributes:
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``, as the inputs were sharded.
        attn_backend: the local kernel.
        native_op: ``"auto"``, True or False.
        comm_dtype: ``"input"`` or ``"fp8"``.
    """

    layout: str = "zigzag"
    attn_backend: str = "auto"
    native_op: Union[bool, str] = "auto"
    comm_dtype: str = "input"


def usp_attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, causal: bool = True,
                  layout: str = "zigzag", softmax_scale: Optional[float] = None, seq_len: Optional[int] = None,
                  attn_backend: str = "auto", native_op: Union[bool, str] = "auto",
                  doc_lens: Union[Sequence[int], Sequence[Sequence[int]], Tensor, None] = None,
                  window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None,
                  sinks: Optional[Tensor] = None, comm_dtype: str = "input", chunk: Optional[int] = None,
                  spans: Union[Sequence[Sequence[int]], Sequence[Sequence[Sequence[int]]], Tensor, None] = None,
                  keys: Union[Sequence[Sequence[int]], Sequence[Sequence[Sequence[int]]], Tensor, None] = None
                  ) -> Tensor:
    """Exact attention over a sequence sharded across ``topo``'s sequence-parallel group.

    Args:
        q: ``(b, s_local, hq, d)``, this rank's shard (from :func:`~ds_usp.sharding.shard_sequence`).
        k: ``(b, s_local, hkv, d)``; ``hq % hkv == 0`` (GQA/MQA).
        v: ``(b, s_local, hkv, dv)``; ``dv`` may differ from ``d`` (MLA: DeepSeek-V3, Kimi-K2).
        topo: the USP topology (any ``ulysses_degree x ring_degree``).
        causal: causal (lower-triangular) attention over global positions.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``, as the inputs were sharded (``"balanced"``
            with the same ``doc_lens``).
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        seq_len: real global length when the sequence was padded by ``shard_sequence``;
            ``None`` means ``s_local * U * R`` (no padding).
        attn_backend: local kernel: ``"auto"``, ``"torch"``, ``"flash_attn"``, ``"triton"``.
        native_op: ``usp.native_op``: ``"auto"`` uses the native op (:mod:`ds_usp.native`) for the
            packing, merge and accumulation when it builds and else the PyTorch twins, with one
            warning; ``True`` requires it; ``False`` never builds it. Same numbers either way.
        doc_lens: packed documents: their lengths over the *global* sequence, one list for every row
            or one list per row (summing to the real length); a token then sees only tokens of its own
            document. ``None``: one document.
        window: sliding window ``(left, right)``: a token at ``p`` sees ``p - left ... p + right``
            (``right`` must be 0 when causal). ``None``: unlimited.
        softcap: attention logit soft-cap (Gemma 2): scores become ``softcap * tanh(scores / softcap)``, the
            softmax scale applied first. None or 0: none.
        sinks: ``(hq,)`` one learned sink logit per query head (GPT-OSS ``s_aux``): it joins every query's
            softmax denominator once, with no value; differentiable. None: none.
        comm_dtype: ``usp.comm_dtype``: ``"input"`` sends everything in the inputs' dtype (exact); ``"fp8"``
            sends the forward's activations (q, k, v and the output through the all-to-alls, the ring's K/V
            blocks, forward and backward) as float8 e4m3 with one fp32 scale per token and head
            (:func:`ds_usp.comm.fp8_encode`): no longer exact (at most 6.25%, about 3.6% RMS, per element; 2-5%
            on the output), the gradients pass straight through and travel in the inputs' dtype.
        chunk: chunked attention (Llama 4's ``attention_chunk_size``): a token sees only tokens of its own chunk
            of ``chunk`` tokens, chunks counted from the start of its document. None: unchunked.
        spans: bidirectional spans (Gemma 3's image blocks, PaliGemma's prefix): ``(start, end)`` global
            positions, one list for every row or one list per row, each inside one document. A query in a span
            also sees the later keys of its span (the window's left bound still applies). None: none.
        keys: the valid keys: ``(start, end)`` runs of global positions, one list for every row or one list per row;
            a key outside them is seen by no query (a padded or masked-out token in the middle of the sequence: a
            diffusion transformer's joint text and image segments, a text key-padding mask). Queries outside them
            are still computed (against the valid keys). None: every key before ``seq_len``.

    Returns:
        ``(b, s_local, hq, dv)`` in the input dtype: this rank's shard of the output.

    Raises:
        ValueError: bad shapes, dtypes, devices, head counts vs degrees, layout, ``causal``,
            ``softmax_scale``, ``seq_len``, ``attn_backend``, ``native_op``, ``doc_lens``, ``window``, ``softcap``,
            ``sinks``, ``comm_dtype``, ``chunk``, ``spans`` or ``keys``, raised
            before any communication; or ranks of the SP group that pass different shapes or arguments (checked
            once per signature with one small all-gather, the same error on every rank; skipped under
            ``torch.compile``, where a mismatch ends in the group timeout's ``USPCommError``).
        ds_usp.native.NativeOpUnavailable: ``native_op=True`` and the op cannot be built or loaded.
    """
    return attention(q, k, v, topo, AttentionMask(causal, seq_len, doc_lens, window, chunk, spans, keys),
                     AttentionRun(layout, attn_backend, native_op, comm_dtype), softmax_scale, softcap, sinks)


def attention(q: Tensor, k: Tensor, v: Tensor, topo: USPTopology, mask: AttentionMask, run: AttentionRun,
              softmax_scale: Optional[float] = None, softcap: Optional[float] = None,
              sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`usp_attention` with its mask and its way of running as records (the model integrations hold them).

    Args, Returns and Raises: as for :func:`usp_attention`.
    """
    causal, seq_len, doc_lens, window, chunk, spans = (mask.causal, mask.seq_len, mask.doc_lens, mask.window,
                                                       mask.chunk, mask.spans)
    count_sp_layer()  # the safety net's count (ds_usp.attention.counter), under torch.compile too
    layout, attn_backend, native_op, comm_dtype = run.layout, run.attn_backend, run.native_op, run.comm_dtype
    u = topo.ulysses_degree
    check_qkv(q, k, v, u)
    check_device(q.device, topo.sp_group)
    check_layout(layout)
    if not isinstance(causal, bool):
        raise ValueError(f"causal ({causal!r}) must be True or False")
    check_scale(softmax_scale)
    cap = check_softcap(softcap)
    check_sinks(sinks, q.shape[2], q.device)
    real_len, _ = resolve_seq_len(seq_len, q.shape[1], u, topo.ring_degree, layout)
    check_native_op(native_op)
    if comm_dtype not in COMM_DTYPES:
        raise ValueError(f"usp.comm_dtype={comm_dtype!r} is not valid: choose from {', '.join(map(repr, COMM_DTYPES))}")
    documents, docs = _doc_starts(doc_lens, q.shape[0], real_len)
    left, right = check_window(window, causal)
    row_spans = check_spans(spans, q.shape[0], real_len, docs)
    row_keys = check_keys(mask.keys, q.shape[0], real_len)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk ({chunk!r}) must be a positive number of tokens or None")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if attn_backend not in BACKEND_CHOICES:
        get_backend(attn_backend, q.device)  # raises the message that lists what is usable here
    if not torch.compiler.is_compiling():  # (compiled code has checked these while tracing)
        resolve_backend(attn_backend, q.device, q.dtype)  # one that cannot run here is refused now, not in the ring
        check_same_across_ranks(q, k, v, topo.sp_group, causal, layout, real_len, scale,
                                (_doc_signature(documents, docs, topo.sp_group), left, right, cap, sinks is not None,
                                 COMM_DTYPES.index(comm_dtype), chunk or 0,
                                 _unless_agreed(spans, row_spans, topo.sp_group, SPANS),
                                 _unless_agreed(row_keys, row_keys, topo.sp_group, VALID_KEYS)))
    native = str(native_op).lower()
    docs_t = documents.tensor if documents is not None else None if docs is None else doc_tensor(docs, real_len)
    spans_t = None if row_spans is None else spans_tensor(row_spans)
    keys_t = None if row_keys is None else spans_tensor(row_keys)
    ulysses, ring, _ = topo.group_names
    hq, hkv, dk, dv = q.shape[2], k.shape[2], k.shape[3], v.shape[3]

    def options(sinks: Optional[Tensor]) -> RingOptions:
        return RingOptions(ulysses_degree=u, ring_group=ring, causal=causal, layout=layout, seq_len=real_len,
                           scale=scale, softcap=cap, sinks=sinks, attn_backend=attn_backend, native_op=native,
                           docs=docs_t, spans=spans_t, keys=keys_t, window_left=left, window_right=right,
                           chunk=chunk or 0, comm_dtype=comm_dtype)

    if u == 1:
        out, _ = _ring_attention([q, k, v], [hq, hkv, hkv], [dk, dk, dv], *options(sinks))
        return out
    rep = kv_replication(hkv, u)
    unit = math.gcd(dk, dv)
    if dk != dv and rep > 1:  # units of one head would be replicated apart: replicate whole heads first
        k, v, hkv, rep = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2), hkv * rep, 1
    if sinks is not None:  # this rank's query heads after the all-to-all: the u-th block of hq / U
        sinks = sinks.narrow(0, topo.ulysses_rank * (hq // u), hq // u)
    qkv = _seq_to_head([as_units(x, unit) for x in (q, k, v)], [1, rep, rep], ulysses, native,
                       comm_dtype)  # (b, U*s, Hp, unit)
    out_heads, _ = _ring_attention([qkv], head_split(hq, hkv, u), [dk, dk, dv], *options(sinks))
    return _head_to_seq(out_heads, [hq // u], [1], ulysses, native, comm_dtype)[0]  # (b, s, hq, dv)


def _doc_starts(doc_lens: Any, batch: int,
                seq_len: int) -> tuple[Optional[Documents], Optional[tuple[tuple[int, ...], ...]]]:
    """``(the Documents value, document starts per row)``: a :class:`Documents` value's own starts when it describes
    ``batch`` rows of ``seq_len`` tokens (no work per layer), else (None, the starts read from the lengths by
    :func:`~ds_usp.sharding.normalize_docs`, raising as for lists)."""
    if isinstance(doc_lens, Documents):
        if doc_lens.fits(batch, seq_len):
            return doc_lens, doc_lens.starts
        doc_lens = doc_lens.lens
    return None, normalize_docs(doc_lens, batch, seq_len)


def _doc_signature(documents: Optional[Documents], docs: Optional[tuple[tuple[int, ...], ...]], group: Any) -> Any:
    """The documents' part of the cross-rank check: nothing when the ranks were shown to hold them (the model's call
    checked them once for all its layers, :func:`ds_usp.attention.checks.agree_documents`), else the documents."""
    if documents is None:
        return docs or ()
    return () if documents_agreed(documents, group) else documents


def _unless_agreed(given: Any, checked: Any, group: Any, what: str) -> Any:
    """Spans' or valid keys' part of the cross-rank check: nothing when the ranks were shown to hold the value given
    (worked out once per model call, before its first layer, and agreed there: a VLM body's image blocks, a diffusion
    transformer's valid keys; :func:`ds_usp.attention.checks.agree_value`), else the checked value (the argument as
    :func:`~ds_usp.attention.checks.check_spans` or ``check_keys`` returned it, a function of the value given and
    of the batch, length and documents, which the signature holds)."""
    if checked is None:
        return ()
    return () if isinstance(given, tuple) and value_agreed(given, group, what) else checked  # (lists, tensors: not)


@functools.lru_cache(maxsize=64)
def spans_tensor(spans: tuple[tuple[tuple[int, int], ...], ...]) -> Tensor:
    """Spans per row -> ``(b, m, 2)`` int64 CPU tensor, rows padded with ``(0, 0)`` (the ring op's argument, which
    the op only reads): made once per value, not per layer. Where spans or valid keys are decoded once per model call
    (a VLM's image blocks; a DiT's valid keys, worked out of its key mask before its first block), calling it there
    makes the layers' calls find it.

    Args:
        spans: per row, ``(start, end)`` pairs (as :func:`~ds_usp.attention.checks.check_spans` returns them).

    Returns:
        The tensor (shared: not to be written).
    """
    m = max(len(row) for row in spans)
    return made_from(torch.tensor([[list(p) for p in row] + [[0, 0]] * (m - len(row)) for row in spans],
                                  dtype=torch.int64).view(len(spans), m, 2), _runs(spans))


def _runs(rows: Any) -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple((a, b) for a, b in row if b > a) for row in rows)


def _spans_of(spans: Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The ring op's ``(b, m, 2)`` spans (or valid keys) tensor -> per row, the non-empty runs (the value it was made
    from, when :func:`spans_tensor` made it: not read)."""
    return value_made_from(spans) or _runs(spans.tolist())


def check_window(window: Any, causal: bool) -> tuple[int, int]:
    """Validate a sliding window and return ``(left, right)`` (``(-1, -1)``: no window).

    Args:
        window: ``None`` or ``(left, right)`` non-negative integers.
        causal: causal attention (then ``right`` must be 0).

    Returns:
        ``(left, right)`` for the ring op.

    Raises:
        ValueError: naming the value and what is valid.
    """
    if window is None:
        return -1, -1
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in window)
    if not ok:
        raise ValueError(f"window ({window!r}) must be None or (left, right), two integers >= 0 (tokens a query sees "
                         f"before and after itself)")
    if causal and window[1] != 0:
        raise ValueError(f"window ({tuple(window)}) sees {window[1]} later tokens, but the attention is causal: "
                         f"use (left, 0)")
    return int(window[0]), int(window[1])


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
    """Ring attention: :func:`usp_attention` on a topology with ``ulysses_degree == 1``; its arguments and result are
    :func:`ulysses_attention`'s. Raises ``ValueError`` when the topology has a Ulysses degree above 1, or any
    :func:`usp_attention` error."""
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
        self.topo, self.causal, self.softmax_scale = topo, causal, softmax_scale
        self.run = AttentionRun(layout, attn_backend, native_op)

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
        return attention(q, k, v, self.topo, AttentionMask(self.causal, seq_len), self.run, self.softmax_scale)
