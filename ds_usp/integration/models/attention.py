"""HuggingFace transformers integration: a ``"usp"`` attention implementation.

    ds_usp.hf.register_usp_attention()            # once, before building the model
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="usp")
    engine, *_ = ds_usp.initialize(model=model, config="ds.json", ...)   # attaches the topology

Every attention layer of the model then runs :func:`ds_usp.usp_attention` on this rank's shard of
the sequence. The model itself is unchanged; the topology is attached to its modules by
:func:`attach` (``ds_usp.initialize`` calls it), so nothing is kept in module globals of ds-usp.

**Nothing transformers passes is dropped.** Every keyword an attention module hands to the attention interface
is either honoured (:data:`HONOURED`: the softmax scale, causality, the layer's own sliding window (checked against
the mask transformers asked for, :mod:`ds_usp.integration.models.masks`, which also brings Llama 4's chunks), the logit
soft-cap of Gemma 2, the attention sinks of GPT-OSS, packed documents), or known to change nothing here
(:data:`NEUTRAL`: positions are already in q/k through RoPE, cache and logging flags), or refused with a
``ValueError`` naming the keyword, the layer and what to do, when its value would change the result
(:data:`REFUSED`, and any keyword ds-usp does not know, future ones included). MLA (a value head dim other than
the query/key one) needs nothing special: the output has the value head dim, as the model's projection expects.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from ds_usp.attention import AttentionMask, AttentionRun, attention
from ds_usp.attention.checks import agree_documents
from ds_usp.attention.documents import Documents
from ds_usp.integration.data.batch import documents_of, documents_of_shard, host_bounds
from ds_usp.integration.models.masks import HFMask, usp_mask
from ds_usp.integration.models.multimodal import BODY_SPANS_KEY
from ds_usp.upstream.torch import set_module_attribute
from ds_usp.upstream.transformers import (attention_implementation, set_attention_implementation,
                                                      wrap_attn_implementation_check)
from ds_usp.sharding import layout_bounds, shard_positions
from ds_usp.topology import USPTopology
from ds_usp.watchdog import run_in_layer

ATTN_NAME = "usp"
_CONTEXT_ATTR = "_usp_context"

# Keywords usp_hf_attention takes as arguments and implements.
HONOURED = ("dropout", "scaling", "is_causal", "sliding_window", "softcap", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k")
# Keywords that reach the attention through the model's **kwargs and do not change attention's result.
NEUTRAL = ("position_ids", "use_cache", "output_router_logits", "num_items_in_batch", "output_hidden_states",
           "max_length_q", "max_length_k", "cache_position", "past_key_values", "return_dict", "deterministic",
           "labels", "shift_labels", "logits_to_keep", "return_logits")
# Keywords some families pass whose non-trivial values ds-usp's attention does not implement: what to do instead.
REFUSED = {
    "output_attentions": "attention weights are never materialized under sequence parallelism; call the model "
                         "with output_attentions=False",
    "position_bias": "an additive (q x k) position bias (T5, ALiBi-like) needs the whole score matrix; build the "
                     "model with attn_implementation='sdpa' and do not use sequence parallelism",
    "sinks": "per-query computed sinks are not supported (learned per-head sinks, s_aux, are)",
    "indices": "DeepSeek sparse attention (top-k key indices) is not supported under sequence parallelism",
    "block_indices": "block-sparse attention is not supported under sequence parallelism",
    "encoder_hidden_states": "cross-attention is not supported: ds-usp shards decoder self-attention",
    "seq_idx": "packed documents reach ds-usp as cu_seq_lens_q (ds_usp.shard_batch sets it); pass that instead of "
               "seq_idx",
}


@dataclass
class USPContext:
    """What the attention layers of a model need to run USP.

    Attributes:
        topo: the topology.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"`` (how batches are sharded).
        attn_backend: local kernel choice (``usp.attn_backend``).
        native_op: ``usp.native_op``: ``"auto"``, ``True`` or ``False``.
        comm_dtype: ``usp.comm_dtype``: ``"input"`` or ``"fp8"``.
        model_name: the model's class (named in errors).
        cu_seq_lens: the documents of the batch the model was last called with (``cu_seq_lens_q`` of
            :func:`ds_usp.shard_batch`), set by the model's wrapped forward: the attention uses it when a family's
            decoder layer does not pass its keyword arguments on (StableLM, Nemotron).
        unsharded: the model runs whole sequences on each rank, without USP (:func:`unsharded`: generation).
        full_topo: the topology ``ds_usp.initialize`` built; :attr:`topo` is it or, under dynamic SP, the degree the
            model was last called at (set from the call's ``sp_degree`` before anything runs).

    ``topo``, ``cu_seq_lens`` and ``unsharded`` describe the model's current call: set by :meth:`begin_call` when a
    top-level call starts (and by :meth:`whole_sequences`), they hold until the next one, through the call's backward
    and its recomputations. Nothing else changes them.
    """

    topo: USPTopology
    layout: str
    attn_backend: str = "auto"
    native_op: Union[bool, str] = "auto"
    comm_dtype: str = "input"
    model_name: str = "the model"
    cu_seq_lens: Optional[Tensor] = field(default=None, repr=False)
    unsharded: bool = False
    full_topo: Optional[USPTopology] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.full_topo is None:
            self.full_topo = self.topo

    @property
    def run(self) -> AttentionRun:
        """How the attention runs (layout, kernel, native op, wire dtype)."""
        return AttentionRun(self.layout, self.attn_backend, self.native_op, self.comm_dtype)

    def begin_call(self, degree: Optional[int], cu_seq_lens: Optional[Tensor]) -> None:
        """A top-level call of the model starts: its dynamic-SP degree (None: the full one) and its documents."""
        self.topo = degree_topology(self.full_topo, degree)
        self.cu_seq_lens = cu_seq_lens

    def set_documents(self, cu_seq_lens: Optional[Tensor]) -> None:
        """The documents of the current call, for layers that do not pass them on (a fused-head call's shard)."""
        self.cu_seq_lens = cu_seq_lens

    @contextlib.contextmanager
    def whole_sequences(self) -> Iterator[None]:
        """While it lasts, the model runs whole sequences on each rank, without USP (:func:`unsharded`)."""
        self.unsharded = True
        try:
            yield
        finally:
            self.unsharded = False

    def with_name(self, name: str) -> "USPContext":
        """This context naming ``name`` in errors (unless it was given a name)."""
        return self if self.model_name != "the model" else replace(self, model_name=name)


def _refuse(module: nn.Module, ctx: USPContext, key: str, value: Any, why: str) -> None:
    shown = f"a {type(value).__name__}" if isinstance(value, Tensor) else repr(value)
    raise ValueError(f"{ctx.model_name} ({type(module).__name__}) passes {key}={shown} to its attention: {why}")


def check_keywords(module: nn.Module, ctx: USPContext, kwargs: dict[str, Any]) -> None:
    """Refuse every keyword whose value would change the attention and that ds-usp does not implement.

    Args:
        module: the attention layer (named in the error).
        ctx: its USP context.
        kwargs: the keywords beyond :data:`HONOURED`.

    Raises:
        ValueError: naming the keyword, the model and the layer, and what to do.
    """
    for key, value in kwargs.items():
        if value is None or value is False:
            continue
        if key in REFUSED:
            _refuse(module, ctx, key, value, REFUSED[key])
        if key not in NEUTRAL:
            _refuse(module, ctx, key, value, "ds-usp does not know this argument, so it cannot honour it; it refuses "
                    "rather than compute something else (docs/models.md: how to add a family)")


def _in_layer(attention_fn: Callable[..., tuple[Tensor, Any]]) -> Callable[..., tuple[Tensor, Any]]:
    """``attention_fn`` with the layer it runs in (the module's ``layer_idx``) told to the collectives' watchdog
    (:func:`ds_usp.watchdog.run_in_layer`), so that a collective that does not complete names it, forward and
    backward."""

    @functools.wraps(attention_fn)
    def run(module: nn.Module, query: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        return run_in_layer(getattr(module, "layer_idx", None),
                            lambda: attention_fn(module, query, *args, **kwargs), query)

    return run


@_in_layer
def usp_hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None, s_aux: Optional[Tensor] = None,
                     cu_seq_lens_q: Optional[Tensor] = None, cu_seq_lens_k: Optional[Tensor] = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """transformers attention-interface function running USP.

    Args:
        module: the attention layer (carries the :class:`USPContext` set by :func:`attach`).
        query: ``(b, hq, s_local, d)`` as transformers passes it.
        key: ``(b, hkv, s_local, d)``.
        value: ``(b, hkv, s_local, dv)`` (``dv`` may differ from ``d``: MLA).
        attention_mask: the :class:`~ds_usp.integration.models.masks.HFMask` the ``"usp"`` mask interface made for
            this layer type (causal or not, window, chunks, bidirectional spans), or None; a mask tensor is refused (documents and
            padding come as ``cu_seq_lens_q``).
        dropout: must be 0.
        scaling: softmax scale.
        is_causal: overrides ``module.is_causal``.
        sliding_window: the layer's window as HF passes it (a query sees itself and the
            ``sliding_window - 1`` tokens before it), None for full attention.
        softcap: the attention logit soft-cap (Gemma 2's ``attn_logit_softcapping``), None for none.
        s_aux: GPT-OSS's learned attention sinks, ``(hq,)`` logits (gradients flow into them).
        cu_seq_lens_q: cumulative document lengths over the *global* rows (from
            :func:`ds_usp.integration.data.batch.shard_batch`): packed documents and the real length.
        cu_seq_lens_k: must equal ``cu_seq_lens_q`` (self-attention).
        **kwargs: other transformers arguments: neutral ones (:data:`NEUTRAL`) pass, others are refused.

    Returns:
        ``((b, s_local, hq, dv), None)``.

    Raises:
        RuntimeError: the model was not attached to a topology.
        ValueError: a mask tensor or a mask part ds-usp does not implement, dropout, or a keyword ds-usp does not
            implement (see the module doc).
    """
    ctx = getattr(module, _CONTEXT_ATTR, None)
    if ctx is None:
        raise RuntimeError('this model uses attn_implementation="usp" but has no USP topology: wrap it with '
                           "ds_usp.initialize(...) or call ds_usp.hf.attach(model, context) first")
    if attention_mask is not None and not isinstance(attention_mask, HFMask):
        raise ValueError(f"{ctx.model_name} ({type(module).__name__}) passes its own attention mask, which usp "
                         f"attention does not take: pack sequences instead of padding them; ds_usp.shard_batch passes "
                         f"the documents and the real length as cu_seq_lens_q")
    if dropout:
        raise ValueError(f"usp attention does not support attention dropout ({dropout}); set attention_dropout=0")
    body_spans = kwargs.pop(BODY_SPANS_KEY, None)  # a VLM body's blocks its language model did not see
    check_keywords(module, ctx, kwargs)
    if cu_seq_lens_q is None:
        cu_seq_lens_q = ctx.cu_seq_lens  # a decoder layer that does not pass the batch's documents on
    elif cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and \
            host_bounds(cu_seq_lens_k) != host_bounds(cu_seq_lens_q):  # read once per call, not per layer
        _refuse(module, ctx, "cu_seq_lens_k", cu_seq_lens_k, "keys with other documents than the queries "
                "(cross-attention) are not supported; ds-usp shards self-attention")
    causal, window, chunk = _mask_of(module, ctx, attention_mask, is_causal, sliding_window)
    spans = attention_mask.spans if attention_mask is not None else None
    if spans is None and body_spans is not None:
        if not causal or window is not None or chunk is not None:
            _refuse(module, ctx, "attention_mask", attention_mask, "the VLM's body made a mask with bidirectional "
                    "blocks for one layer type, and this layer has another (a window or chunks)")
        spans = body_spans
    documents = documents_of(cu_seq_lens_q, query.shape[0])  # decoded once per model call, not per layer
    seq_len = None if documents is None else documents.seq_len
    query = _global_query_temperature(module, ctx, query, seq_len, None if documents is None else documents.lens)
    # (b, h, s, d) -> (b, s, h, d): ds-usp's layout
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), ctx.topo,
                    AttentionMask(causal, seq_len, documents, window, chunk, spans), ctx.run, scaling, softcap, s_aux)
    return out, None


def _global_query_temperature(module: nn.Module, ctx: USPContext, query: Tensor, seq_len: Optional[int],
                              docs: Optional[tuple[tuple[int, ...], ...]]) -> Tensor:
    """Llama 4's attention temperature tuning, by the global row index instead of the shard's.

    Llama 4's NoPE layers (``attn_temperature_tuning``, ``use_rope`` False) scale each query by
    ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))`` where ``i`` is the token's row index, which the layer
    takes as ``arange`` over the tokens it holds: on a shard that is the shard's index, not the sequence's. This
    rescales the queries to the factor of their global rows (a no-op while the sequence is shorter than
    ``floor_scale``), so the result equals one process's over the whole sequence.
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    topo, s_local = ctx.topo, query.shape[2]
    padded = s_local * topo.sp_size
    real = padded if seq_len is None else seq_len
    ratio = _temperature_ratio(float(module.floor_scale), float(module.attn_scale), padded, topo.ulysses_degree,
                               topo.ring_degree, topo.sp_rank, ctx.layout,
                               layout_bounds(ctx.layout, docs, real, padded), query.device, query.dtype)
    return (query * ratio).to(query.dtype)


@functools.lru_cache(maxsize=64)
def _temperature_ratio(floor_scale: float, attn_scale: float, padded: int, u: int, r: int, sp_rank: int, layout: str,
                       bounds: Optional[tuple[int, ...]], device: torch.device, dtype: torch.dtype) -> Tensor:
    """``(1, 1, s_local, 1)`` the factor of each held token's global row over its shard row's, on ``device``: made
    (a copy from the host) once per layout, shape, rank, device and dtype, not in every NoPE layer's call."""
    rows = shard_positions(padded, u, r, sp_rank, layout, bounds)

    def factor(i: Tensor) -> Tensor:
        return torch.log1p(torch.floor((i.double() + 1.0) / floor_scale)) * attn_scale + 1.0

    with torch.inference_mode(False):  # kept across calls: a normal tensor, whatever mode the first call ran in
        ratio = factor(rows) / factor(torch.arange(rows.numel()))
        # (s,) -> (1, 1, s, 1) over (b, h, s, d)
        return ratio.to(device, dtype).view(1, 1, -1, 1)


def _mask_of(module: nn.Module, ctx: USPContext, mask: Optional[HFMask], is_causal: Optional[bool],
             sliding_window: Optional[int]) -> tuple[bool, Optional[tuple[int, int]], Optional[int]]:
    """``(causal, window (left, right) or None, chunk or None)`` of a layer: what its mask (:class:`HFMask`, from
    the ``"usp"`` mask interface) asks for, checked against the layer's own ``is_causal`` and ``sliding_window``
    arguments; without a mask (a model that builds none), those arguments alone."""
    if mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        return causal, _window(sliding_window, causal), None
    if mask.unsupported:
        _refuse(module, ctx, "attention_mask", mask, f"its mask has parts ds-usp does not implement "
                f"({'; '.join(mask.unsupported)}), so ds-usp refuses rather than compute another mask")
    if is_causal is not None and bool(is_causal) != mask.causal:
        _refuse(module, ctx, "is_causal", is_causal, f"its mask is {'causal' if mask.causal else 'bidirectional'}; "
                f"ds-usp does not guess which one the model means")
    if sliding_window is not None and sliding_window != mask.window:
        has = "no window" if mask.window is None else f"a window of {mask.window} tokens"
        _refuse(module, ctx, "sliding_window", sliding_window, f"its mask has {has}; ds-usp does not guess which one "
                f"the model means")
    if mask.window is not None and not mask.causal:
        _refuse(module, ctx, "attention_mask", mask, "a one-sided window on a bidirectional mask is not implemented")
    window = _window(mask.window, mask.causal)
    if mask.both_sides is not None:
        if window is not None or mask.causal:
            _refuse(module, ctx, "attention_mask", mask, "a two-sided window combined with another window or with "
                    "causality is not implemented")
        window = (mask.both_sides, mask.both_sides)
    return mask.causal, window, mask.chunk


def _window(sliding_window: Optional[int], causal: bool) -> Optional[tuple[int, int]]:
    """HF's ``sliding_window`` (a query sees itself and the ``sliding_window - 1`` keys before it) as ds-usp's
    ``(left, right)``."""
    if sliding_window is None:
        return None
    return sliding_window - 1, 0 if causal else sliding_window - 1


# The sharded vision towers' attention (ds_usp.integration.models.vision): the same function under a name transformers treats
# as flash-like, because the Qwen-VL vision attention passes cu_seqlens (the images, frames or windows of the packed
# patches) only to those, and otherwise splits the sequence per image itself, which a shard cannot do.
VISION_ATTN_NAME = "usp_vision_flash_varlen"


def register_usp_attention() -> str:
    """Register :func:`usp_hf_attention` with transformers as ``attn_implementation="usp"`` (idempotent).

    Also registers the ``"usp"`` mask interface (:func:`ds_usp.integration.models.masks.usp_mask`), which builds no
    ``(s x s)`` mask but says what each layer type's mask means; and makes building a model whose family does
    not route its attention through transformers' attention interface (Falcon, GPT-J, Bloom...) with
    ``attn_implementation="usp"`` fail with an error that names the family, instead of a ``KeyError: 'usp'`` deep
    inside it or, for some families, silently running their own attention.

    Returns:
        The implementation name, ``"usp"``.

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, usp_hf_attention)
    AttentionInterface.register(VISION_ATTN_NAME, usp_hf_attention)
    AttentionMaskInterface.register(ATTN_NAME, usp_mask)
    wrap_attn_implementation_check(refuse_non_interface_family, ATTN_NAME)
    return ATTN_NAME


def refuse_non_interface_family(model_class: type) -> None:
    """Refuse a transformers model class whose attention does not go through the attention interface.

    Args:
        model_class: a ``PreTrainedModel`` subclass.

    Raises:
        ValueError: naming the class and what to do.
    """
    can_set = getattr(model_class, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise ValueError(f"{model_class.__name__} computes attention in its own code instead of transformers' "
                         f"attention interface, so attn_implementation='usp' cannot reach it and ds-usp cannot shard "
                         f"its sequence: train it without sequence parallelism, or use a family listed in "
                         f"docs/models.md")


def attach(model: nn.Module, context: USPContext) -> None:
    """Give every module of ``model`` the USP context its ``"usp"`` attention layers read.

    Args:
        model: the (HuggingFace) model.
        context: the topology and layout.
    """
    attached = context_of(model) is not None
    context = context.with_name(type(model).__name__)
    for m in model.modules():
        set_module_attribute(m, _CONTEXT_ATTR, context)
    if not attached:
        model.register_forward_pre_hook(_documents_of_call, with_kwargs=True)


def _documents_of_call(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before each call of the model: the batch's documents, passed on to every layer.

    A call with ``cu_seq_lens_q`` (``engine(**shard)``) keeps them; a call with ``position_ids`` only (the README's
    loop) gets them from the positions (:func:`~ds_usp.integration.data.batch.documents_of_shard`), so that packed rows
    never attend across documents, however the model is called. Either way the context keeps them for decoder layers
    that do not pass their keyword arguments on to the attention (StableLM, Nemotron) and the hybrid layers.
    """
    ctx = context_of(model)
    if ctx.unsharded:
        return args, kwargs
    kwargs = dict(kwargs)
    degree = kwargs.pop("sp_degree", None)  # dynamic SP: the batch says its degree
    ctx.begin_call(degree, kwargs.get("cu_seq_lens_q"))
    positions = kwargs.get("position_ids")
    if ctx.cu_seq_lens is None and isinstance(positions, Tensor) and positions.dim() == 2:
        cu = documents_of_shard(positions, ctx.topo, ctx.layout)
        if cu is not None:
            bounds = host_bounds(cu)  # known: ds-usp made it
            longest = max(b - a for a, b in zip(bounds, bounds[1:]))
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
            ctx.set_documents(cu)
    _decode_documents(ctx, kwargs)
    return args, kwargs


def _decode_documents(ctx: USPContext, kwargs: dict) -> Optional[Documents]:
    """The call's documents decoded before its first layer, so that no layer reads them (a host read waits for the
    device): one read of ``cu_seq_lens_q`` at most (none for those :func:`ds_usp.shard_batch` made) and of a distinct
    ``cu_seq_lens_k``, and one check across the ranks (none when ``shard_batch`` compared the batch, or for documents
    checked before). The layers find the value by the tensor they are given
    (:func:`~ds_usp.integration.data.batch.documents_of`). Nothing is done when the batch's rows are not known here
    (no ``input_ids`` or ``inputs_embeds``) or while compiling: the layers decode them then."""
    inputs = kwargs.get("input_ids")
    inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
    if ctx.cu_seq_lens is None or not isinstance(inputs, Tensor) or inputs.dim() < 2 or \
            torch.compiler.is_compiling():
        return None
    documents = documents_of(ctx.cu_seq_lens, inputs.shape[0])
    keys = kwargs.get("cu_seq_lens_k")
    if isinstance(keys, Tensor) and keys is not ctx.cu_seq_lens:
        host_bounds(keys)  # for the layers' check that keys and queries have the same documents
    agree_documents(documents, ctx.topo.sp_group)
    return documents


def degree_topology(full: USPTopology, degree: Optional[int]) -> USPTopology:
    """The topology a micro batch of sequence-parallel degree ``degree`` runs on (dynamic SP, see
    :meth:`ds_usp.topology.USPTopology.with_degrees`).

    Args:
        full: the topology ``ds_usp.initialize`` built (with its degrees).
        degree: the batch's ``sp_degree`` (:func:`ds_usp.shard_batch` puts it in a degree's shards); ``None``: full.

    Returns:
        That degree's topology.

    Raises:
        ValueError: a degree the topology was not built with (the degrees it has are named).
    """
    if degree is None or degree == full.sp_size:
        return full
    if degree not in full.degrees:
        raise ValueError(f"the batch runs at sequence-parallel degree {degree}, but ds_usp.initialize built "
                         f"{sorted(full.degrees) or [full.sp_size]} (set usp.dynamic_sp to true for smaller degrees)")
    return full.degrees[degree]


def context_of(model: nn.Module) -> Optional[USPContext]:
    """The :class:`USPContext` :func:`attach` gave ``model`` (None when it has none)."""
    return getattr(model, _CONTEXT_ATTR, None)


@contextlib.contextmanager
def unsharded(model: nn.Module, implementation: str = "sdpa") -> Iterator[None]:
    """Run ``model`` on whole sequences on each rank, without USP, for as long as the block lasts (generation).

    The ``"usp"`` attention and mask functions are swapped for ``implementation``'s in every config of the model (HF
    looks them up on each call), and the documents hook stands aside; the memory stack's wrapped forward passes calls
    without labels through. Nothing is communicated over the SP group inside the block.

    Args:
        model: a model :func:`attach` gave a context (others are left alone).
        implementation: the attention implementation to use instead of ``"usp"``.
    """
    ctx = context_of(model)
    configs = {id(c): (c, attention_implementation(c)) for c in (getattr(m, "config", None) for m in model.modules())
               if attention_implementation(c) in (ATTN_NAME, VISION_ATTN_NAME)}
    if ctx is None or not configs:
        yield
        return
    with ctx.whole_sequences():
        for config, _ in configs.values():
            set_attention_implementation(config, implementation)
        try:
            yield
        finally:
            for config, name in configs.values():
                set_attention_implementation(config, name)
