"""Hybrid linear-attention models: their linear-attention layers wrapped from outside — Gated DeltaNet (Qwen3-Next,
Qwen3.5, OLMo Hybrid), Kimi Delta Attention (KDA: Kimi Linear) and Mamba-2 mixers (Mamba-2, Nemotron-H, Bamba,
Granite-4 hybrid, Zamba2, Falcon-H1) — and the other sequence mixers ds-usp shards without the delta-rule path:
Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba), LFM2's gated short convolutions (LFM2, LFM2-MoE, LFM3) and
RecurrentGemma's RG-LRU blocks.

``ds_usp.initialize`` calls :func:`wrap_linear_layers`, as it applies the memory stack: every such layer of the
model keeps its parameters and its own kernels, and its forward becomes

    input projections (this rank's tokens, all heads) -> gates -> ds_usp.linear.gated_delta_attention
    (Ulysses all-to-all for heads, the short convolution with its halo, the delta rule with the state passed
    across the ring) -> the layer's gated norm and output projection (this rank's tokens)

While the model runs whole sequences on each rank (:func:`ds_usp.integration.models.attention.unsharded`, which the
RL trainers' generation uses), every wrapped layer runs its own forward instead: the cache's convolution and recurrent
state are read and updated as in one process, and nothing is communicated.

The softmax layers of the same model use ``attn_implementation="usp"`` with their output gate (it is applied by
the model, after the attention). The family's own delta-rule function is called: transformers' torch chunked
rule on CPU, flash-linear-attention's when it is installed (GPUs). A layer is recognized by what it holds:

- Gated DeltaNet: the fused ``in_proj_qkvz`` / ``in_proj_ba`` of Qwen3-Next, the separate ``in_proj_qkv`` /
  ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` of Qwen3.5, or OLMo Hybrid's ``q_proj`` / ``k_proj`` / ``v_proj``
  / ``g_proj`` / ``b_proj`` / ``a_proj`` (and its ``allow_neg_eigval``: beta in [0, 2]), with ``conv1d`` over
  ``[q | k | v]``, ``A_log``, ``dt_bias``, and ``norm`` / ``out_proj`` or ``o_norm`` / ``o_proj``; one log decay
  per token and head;
- KDA: ``q_proj`` / ``k_proj`` / ``v_proj``, ``conv1d``, the layer's ``forget_gate`` module (its per-channel log
  decays, computed by the family's own code), ``b_proj``, the output gate ``g_a_proj`` / ``g_b_proj``, ``o_norm`` /
  ``o_proj``, and its module's ``chunk_kimi_delta_attention``;
- Mamba-2 (SSD): ``in_proj`` giving exactly ``[gate | x B C | dt]``, ``conv1d`` over ``[x | B | C]``, ``dt_bias``,
  ``A_log``, ``D``, the gated group norm ``norm`` and ``out_proj``, and its module's ``mamba2_chunk_scan`` (which
  takes an initial state). The scan is the delta-rule machinery's special case without the delta term: queries
  ``C``, keys ``B`` (``n_groups`` key heads), values ``x``; the step ``dt`` and the skip ``D`` travel with the
  log-decay input, ``A`` with ``beta``. Falcon-H1's mixer is this shape with muP multipliers: its input times
  ``ssm_in_multiplier``, the projection times its ``mup_vector`` buffer, and either the gated norm or (``mamba_rms_norm``
  off) ``y * silu(gate)``; they are token-local, applied around the sharded scan as the layer applies them;
- Mamba-1: ``in_proj``, a causal depthwise ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log`` of ``(d, N)``, ``D``,
  ``out_proj``, and its module's ``causal_conv1d_fn`` and ``mamba_selective_scan``. Its channels are independent
  recurrences with per-token ``B``, ``C``: no all-to-all; the family's own forward runs (its norms of dt, B, C
  included) with those two functions working on the sharded sequence (:func:`ds_usp.linear.sharded_causal_conv`,
  :func:`ds_usp.linear.sharded_selective_scan`: diagonal state passing over the SP group);
- gated short convolution: a ``...ShortConv`` with ``in_proj`` giving ``[B | C | x]``, a causal depthwise ``conv``
  and ``out_proj``: ``out_proj(C * conv(B * x))`` with the convolution's halo from the ranks before;
- Griffin recurrent block (RecurrentGemma): ``linear_x`` / ``linear_y`` / ``linear_out``, ``conv_1d`` and an
  ``rg_lru`` whose own forward computes the gates; its ``_rnn_scan`` runs each segment from zero and the state is
  passed over the SP group (:func:`ds_usp.linear.sharded_linear_recurrence`).

Other linear-attention and state-space layers are refused by ``ds_usp.integration.models.checks.check_model``.
"""
from __future__ import annotations

import contextvars
import functools
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_usp.integration.data.batch import documents_of
from ds_usp.integration.models.attention import USPContext, context_of
from ds_usp.upstream.torch import replace_forward, set_module_attribute
from ds_usp.upstream.transformers import replace_family_functions, replace_private_method
from ds_usp.watchdog import run_in_layer
from ds_usp.linear import (check_linear_heads, gated_delta_attention, sharded_causal_conv, sharded_linear_recurrence,
                           sharded_selective_scan)

_COMMON = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
_INPUTS = (("in_proj_qkvz", "in_proj_ba"),  # Qwen3-Next: per key head [q | k | v... | z...], [b... | a...]
           ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5
           ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"))  # OLMo Hybrid
_OUTPUTS = (("norm", "out_proj"), ("o_norm", "o_proj"))  # the gated norm and the output projection
_KDA = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj",
        "num_heads", "head_dim")
_SELECTIVE = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj")
_SELECTIVE_FUNCTIONS = ("causal_conv1d_fn", "mamba_selective_scan")
_MAMBA2 = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
           "ssm_state_size", "intermediate_size", "conv_dim", "time_step_limit", "chunk_size")


def _has(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(hasattr(module, a) for a in names)


def _family(module: nn.Module, name: str) -> Any:
    """A function of the module that defines ``module``'s class (None: it has none)."""
    return getattr(sys.modules[type(module).__module__], name, None)


def is_gated_deltanet(module: nn.Module) -> bool:
    """Whether ``module`` is a Gated DeltaNet layer ds-usp wraps (see the module doc)."""
    return _has(module, _COMMON) and any(_has(module, x) for x in _INPUTS) and any(_has(module, x) for x in _OUTPUTS)


def is_kimi_delta(module: nn.Module) -> bool:
    """Whether ``module`` is a Kimi Delta Attention layer ds-usp wraps (see the module doc)."""
    return _has(module, _KDA) and callable(_family(module, "chunk_kimi_delta_attention"))


def is_mamba2(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba-2 mixer ds-usp wraps (see the module doc)."""
    return _has(module, _MAMBA2) and callable(_family(module, "mamba2_chunk_scan")) and \
        isinstance(module.in_proj, nn.Linear) and \
        module.in_proj.out_features == module.intermediate_size + module.conv_dim + module.num_heads


def is_linear_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a linear-attention layer ds-usp wraps: Gated DeltaNet, KDA or a Mamba-2 mixer."""
    return is_gated_deltanet(module) or is_kimi_delta(module) or is_mamba2(module)


def _depthwise(conv: Any) -> bool:
    """A causal depthwise ``nn.Conv1d`` (one filter per channel, ``K - 1`` zeros of padding before)."""
    return isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels and \
        conv.padding == (conv.kernel_size[0] - 1,) and conv.stride == (1,) and conv.dilation == (1,)


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` is a gated short convolution ds-usp wraps (LFM2, LFM2-MoE, LFM3): ``in_proj`` giving
    ``[B | C | x]``, ``y = C * conv(B * x)``, ``out_proj``; a class named ``...ShortConv`` whose module defines
    ``causal_conv1d_fn``."""
    conv, proj = getattr(module, "conv", None), getattr(module, "in_proj", None)
    return type(module).__name__.endswith("ShortConv") and _depthwise(conv) and isinstance(proj, nn.Linear) and \
        proj.out_features == 3 * conv.in_channels and isinstance(getattr(module, "out_proj", None), nn.Linear) and \
        callable(_family(module, "causal_conv1d_fn"))


def is_selective_ssm(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba-1 mixer ds-usp wraps (Mamba, Falcon-Mamba, Jamba): ``in_proj``, a causal
    depthwise ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log`` of ``(d, N)``, ``D``, ``out_proj``, and its module's
    ``causal_conv1d_fn`` and ``mamba_selective_scan``, which its forward calls."""
    return _has(module, _SELECTIVE) and isinstance(module.A_log, Tensor) and module.A_log.dim() == 2 and \
        _depthwise(module.conv1d) and all(callable(_family(module, f)) for f in _SELECTIVE_FUNCTIONS)


def is_rglru_block(module: nn.Module) -> bool:
    """Whether ``module`` is a Griffin recurrent block ds-usp wraps (RecurrentGemma): ``linear_x`` / ``linear_y`` /
    ``linear_out``, a causal depthwise ``conv_1d`` and an ``rg_lru`` whose ``_rnn_scan`` runs the recurrence."""
    return _has(module, ("linear_x", "linear_y", "linear_out", "act_fn", "conv_1d", "rg_lru")) and \
        _depthwise(module.conv_1d) and callable(getattr(module.rg_lru, "_rnn_scan", None))


def is_wrapped_mixer(module: nn.Module) -> bool:
    """Whether ``module`` mixes tokens outside attention in a way ds-usp shards: a linear-attention layer
    (:func:`is_linear_attention`), a short convolution (:func:`is_short_conv`), a Mamba-1 mixer
    (:func:`is_selective_ssm`) or a Griffin recurrent block (:func:`is_rglru_block`)."""
    return _wrapper(module) is not None


def mixer_family(module: nn.Module) -> Optional[str]:
    """Which kind of sequence mixer ds-usp wraps ``module`` as: ``"gated_deltanet"``, ``"kimi_delta"``, ``"mamba2"``,
    ``"mamba1"``, ``"short_conv"`` or ``"rglru"`` (None: not one, see :func:`is_wrapped_mixer`)."""
    for kind, name in ((is_short_conv, "short_conv"), (is_selective_ssm, "mamba1"), (is_rglru_block, "rglru"),
                       (is_mamba2, "mamba2"), (is_kimi_delta, "kimi_delta"), (is_gated_deltanet, "gated_deltanet")):
        if kind(module):
            return name
    return None


def linear_dims(module: nn.Module) -> tuple[int, int, int, int]:
    """``(key heads, value heads, key head dim, value head dim)`` of a layer :func:`is_linear_attention` accepts
    (Mamba-2: groups, heads, state size, head dim)."""
    if is_kimi_delta(module):
        return module.num_heads, module.num_heads, module.head_dim, module.head_dim
    if is_mamba2(module):
        return module.n_groups, module.num_heads, module.ssm_state_size, module.head_dim
    return module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim


def _projections(module: nn.Module, x: Tensor) -> tuple[Tensor, ...]:
    """``q, k (b, s, nk, dk), v, z (b, s, nv, dv), b, a (b, s, nv)`` of this rank's tokens, all heads."""
    bsz, s = x.shape[:2]
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    if hasattr(module, "in_proj_qkvz"):  # the layer's own reordering of its per-key-head interleaved projections
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
        return q, k, v.reshape(bsz, s, nv, dv), z.reshape(bsz, s, nv, dv), b.reshape(bsz, s, nv), \
            a.reshape(bsz, s, nv)
    if hasattr(module, "in_proj_qkv"):
        q, k, v = module.in_proj_qkv(x).split([nk * dk, nk * dk, nv * dv], dim=-1)
        z, b, a = module.in_proj_z(x), module.in_proj_b(x), module.in_proj_a(x)
    else:
        q, k, v, z, b, a = (proj(x) for proj in (module.q_proj, module.k_proj, module.v_proj, module.g_proj,
                                                 module.b_proj, module.a_proj))
    return (q.reshape(bsz, s, nk, dk), k.reshape(bsz, s, nk, dk), v.reshape(bsz, s, nv, dv),
            z.reshape(bsz, s, nv, dv), b, a)


def _inputs(module: nn.Module, x: Tensor, kda: bool, beta_scale: float) -> tuple[Tensor, ...]:
    """``q, k (b, s, nk, dk), v, z (b, s, nv, dv), g, beta`` of this rank's tokens, all heads: the output gate
    ``z``, fp32 log decays ``g`` (``(b, s, nv)``, KDA: ``(b, s, nv, dk)``) and ``beta`` ``(b, s, nv)``."""
    if kda:
        heads = (module.num_heads, module.head_dim)
        q, k, v = (proj(x).unflatten(-1, heads) for proj in (module.q_proj, module.k_proj, module.v_proj))
        z = module.g_b_proj(module.g_a_proj(x)).unflatten(-1, heads)
        return q, k, v, z, module.forget_gate(x), module.b_proj(x).sigmoid()
    q, k, v, z, b, a = _projections(module, x)
    return q, k, v, z, -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias), b.sigmoid() * beta_scale


def _rule(module: nn.Module, kda: bool) -> Callable:
    """The family's chunked delta rule as :data:`ds_usp.linear.delta.Rule` (l2-norm of q/k inside)."""
    fn = _family(module, "chunk_kimi_delta_attention" if kda else "torch_chunk_gated_delta_rule")

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Optional[Tensor]) -> tuple:
        return fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)

    return rule


def _mamba2_rule(module: nn.Module) -> Callable:
    """The family's ``mamba2_chunk_scan`` as :data:`ds_usp.linear.delta.Rule`: ``q`` = C, ``k`` = B, ``v`` = x,
    ``g`` = ``[dt | D]`` per token and head (dt after its bias, softplus and limits), ``beta`` = A per token and head
    (the same on every token: the scan gets one per head, a view, so A's gradient still flows); the state in the
    rule's ``(N, P)`` layout (the scan keeps ``(P, N)``), the skip ``D x`` added here."""
    scan, chunk = _family(module, "mamba2_chunk_scan"), module.chunk_size

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Optional[Tensor]) -> tuple:
        out, final = scan(v, g[..., 0], beta[0, 0], k, q, chunk_size=chunk, D=None, dt_bias=None,
                          initial_states=None if state is None else state.transpose(-1, -2), dt_softplus=False,
                          dt_limit=(0.0, float("inf")), return_final_states=True)
        acc = torch.promote_types(out.dtype, v.dtype)  # the scan's fp32 (fp64 in tests), as its own skip is
        return out.to(acc) + g[..., 1:].to(acc) * v.to(acc), final.transpose(-1, -2)

    return rule


def _mamba2_forward(module: nn.Module, ctx: USPContext) -> Callable:
    """The forward of a Mamba-2 mixer under the USP topology (the layer's own steps around the sharded scan)."""
    from transformers.activations import ACT2FN

    rule, activation = _mamba2_rule(module), ACT2FN[module.activation]
    groups, heads, state, head_dim = linear_dims(module)
    inner, bc = module.intermediate_size, groups * state
    # the convolution's channels [x | B | C] reordered to the linear path's [q | k | v] = [C | B | x]
    order = torch.cat([torch.arange(inner + bc, inner + 2 * bc), torch.arange(inner, inner + bc),
                       torch.arange(inner)]).to(module.conv1d.weight.device)
    low, high = module.time_step_limit
    scale_in = float(getattr(module, "ssm_in_multiplier", 1.0))  # Falcon-H1's muP input multiplier
    gated_norm = getattr(module, "mamba_rms_norm", True)

    @functools.wraps(module.forward)
    def forward(hidden_states: Tensor, cache_params: Any = None, attention_mask: Optional[Tensor] = None,
                **kwargs: Any) -> Tensor:
        _refuse_cache(cache_params, module, ctx)
        seq_len, docs = _documents(hidden_states, ctx, kwargs)
        x = _masked(hidden_states, attention_mask)
        projected = module.in_proj(x if scale_in == 1.0 else x * scale_in)
        mup = getattr(module, "mup_vector", None)  # Falcon-H1: a buffer, read per call (it moves with the layer)
        projected = projected if mup is None else projected * mup
        gate, xbc, dt = projected.split([inner, module.conv_dim, heads], dim=-1)
        xs, b, c = xbc.split([inner, bc, bc], dim=-1)
        bsz, s = x.shape[:2]
        dt = F.softplus(dt + module.dt_bias.to(dt.dtype)).clamp(low, high)  # as the scan does, token by token
        a = -torch.exp(module.A_log.float())
        g = torch.stack([dt, module.D.to(dt.dtype).expand_as(dt)], dim=-1)
        conv = module.conv1d
        weight = conv.weight.index_select(0, order.to(conv.weight.device))  # no copy unless the layer moved
        bias = None if conv.bias is None else conv.bias.index_select(0, order.to(conv.bias.device))
        core = gated_delta_attention(c.reshape(bsz, s, groups, state), b.reshape(bsz, s, groups, state),
                                     xs.reshape(bsz, s, heads, head_dim), g, a.expand(bsz, s, heads), weight, bias,
                                     ctx.topo, rule, activation, layout=ctx.layout, seq_len=seq_len, doc_lens=docs,
                                     native_op=ctx.native_op)
        core = core.reshape(bsz, s, -1)
        out = module.norm(core, gate) if gated_norm else core * F.silu(gate)  # Falcon-H1 may go without the norm
        return module.out_proj(out.to(x.dtype))

    return forward


def _refuse_cache(cache: Any, module: nn.Module, ctx: USPContext) -> None:
    """Refuse a call that continues from the recurrent or convolution state a cache holds (decoding); training
    starts afresh."""
    layer = getattr(module, "layer_idx", None)
    for getter in ("get_recurrent_state", "get_conv_state"):
        get = getattr(cache, getter, None)
        if callable(get) and layer is not None and get(layer, state_idx=0) is not None:
            raise ValueError(f"{ctx.model_name}: decoding from a cache is not supported on sequence shards "
                             f"(training and prefill are); generate on whole sequences inside "
                             f"ds_usp.hf.unsharded(model)")


def _short_conv_forward(module: nn.Module, ctx: USPContext) -> Callable:
    """The forward of a gated short convolution (LFM2) under the USP topology: the projections and gates on this
    rank's tokens, the convolution with its halo from the ranks before (:func:`ds_usp.linear.sharded_causal_conv`)."""
    conv = module.conv

    @functools.wraps(module.forward)
    def forward(hidden_states: Tensor, past_key_values: Any = None, attention_mask: Optional[Tensor] = None,
                **kwargs: Any) -> Tensor:
        _refuse_cache(past_key_values, module, ctx)
        seq_len, docs = _documents(hidden_states, ctx, kwargs)
        b, c, x = module.in_proj(_masked(hidden_states, attention_mask)).chunk(3, dim=-1)
        y = sharded_causal_conv(b * x, conv.weight.squeeze(1), conv.bias, ctx.topo, layout=ctx.layout,
                                seq_len=seq_len, doc_lens=docs)
        return module.out_proj(c * y)

    return forward


# while a wrapped mixer runs its family's own code (a Mamba-1 mixer's forward, RecurrentGemma's RG-LRU), what the
# sharded functions it calls need: (its context, the real global length, the documents)
_RUNNING: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("ds_usp_running_mixer", default=None)


def _rglru_block_forward(module: nn.Module, ctx: USPContext) -> Callable:
    """The forward of a Griffin recurrent block (RecurrentGemma) under the USP topology: its convolution with the
    halo from the ranks before (across packed documents, as the family's own runs), then its RG-LRU, whose gates are
    per token, with the recurrence's state passed over the SP group (:func:`ds_usp.linear.sharded_linear_recurrence`;
    the resets at position 0 are zero decays)."""
    conv, lru = module.conv_1d, module.rg_lru

    def sharded(scan: Callable) -> Callable:  # the family's scan, bound: run on each segment from zero
        def sharded_scan(hidden_states: Tensor, recurrent_gate: Tensor, reset: Tensor, recurrent_states: Any = None,
                         **kwargs: Any) -> tuple[Tensor, Any]:
            running = _RUNNING.get()
            if running is None:  # the family's own block forward (whole sequences, generation): the family's scan
                return scan(hidden_states, recurrent_gate, reset, recurrent_states, **kwargs)
            _, seq_len, docs = running
            none = torch.zeros_like(reset)
            out = sharded_linear_recurrence(lambda u, a: scan(u, a, none[:, :u.shape[1]], None, **kwargs)[0],
                                            hidden_states, recurrent_gate * ~reset, ctx.topo, layout=ctx.layout,
                                            seq_len=seq_len, doc_lens=docs)
            return out, None
        return sharded_scan

    replace_private_method(lru, "_rnn_scan", sharded, ("hidden_states", "recurrent_gate", "reset", "recurrent_states"))

    @functools.wraps(module.forward)
    def forward(input_states: Tensor, position_ids: Tensor, attention_mask: Any = None, use_cache: Any = None,
                **kwargs: Any) -> tuple[Tensor, None]:
        seq_len, docs = _documents(input_states, ctx, kwargs)
        token = _RUNNING.set((ctx, seq_len, docs))  # read by the RG-LRU's scan
        try:
            y = module.act_fn(module.linear_y(input_states))
            x = sharded_causal_conv(module.linear_x(input_states), conv.weight.squeeze(1), conv.bias, ctx.topo,
                                    layout=ctx.layout, seq_len=seq_len, doc_lens=docs, documents_reset=False)
            set_module_attribute(lru, "recurrent_states", None)  # training: no cached state (no decoding under USP)
            return module.linear_out(lru(x, position_ids) * y), None
        finally:
            _RUNNING.reset(token)

    return forward


def _selective_forward(module: nn.Module, ctx: USPContext) -> Callable:
    """The forward of a Mamba-1 mixer under the USP topology: the family's own forward, whose convolution and scan
    (its module's ``causal_conv1d_fn`` and ``mamba_selective_scan``) work on the sharded sequence while it runs
    (:func:`_shard_family_functions`); the rest of it (projections, the family's norms of dt, B and C) is per token."""
    _shard_family_functions(sys.modules[type(module).__module__])
    original = module.forward

    @functools.wraps(original)
    def forward(hidden_states: Tensor, cache_params: Any = None, attention_mask: Optional[Tensor] = None,
                **kwargs: Any) -> Tensor:
        _refuse_cache(cache_params, module, ctx)
        seq_len, docs = _documents(hidden_states, ctx, kwargs)
        token = _RUNNING.set((ctx, seq_len, docs))
        try:
            return original(hidden_states, cache_params=None, attention_mask=attention_mask, **kwargs)
        finally:
            _RUNNING.reset(token)

    return forward


def _shard_family_functions(family: Any) -> None:
    """Swap a Mamba-1 family's ``causal_conv1d_fn``, ``mamba_selective_scan`` and ``mamba_inner_fn`` (its fused
    training kernel) for versions that, while a wrapped mixer runs, convolve and scan the sharded sequence
    (:func:`ds_usp.linear.sharded_causal_conv`, :func:`ds_usp.linear.sharded_selective_scan`, the fused kernel
    declined); at any other time they call the family's own (idempotent)."""
    from transformers.activations import ACT2FN

    def sharded_conv(conv: Callable) -> Callable:
        def causal_conv1d_fn(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                             activation: Optional[str] = None, **kwargs: Any) -> Tensor:
            running = _RUNNING.get()
            if running is None:
                return conv(x, weight, bias, activation=activation, **kwargs)
            ctx, seq_len, docs = running
            return sharded_causal_conv(x.transpose(1, 2), weight, bias, ctx.topo, layout=ctx.layout, seq_len=seq_len,
                                       doc_lens=docs, activation=None if activation is None else ACT2FN[activation]
                                       ).transpose(1, 2)
        return causal_conv1d_fn

    def sharded_scan(scan: Callable) -> Callable:
        def mamba_selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                                 z: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None,
                                 delta_softplus: bool = False, return_last_state: bool = False, **kwargs: Any) -> Any:
            running = _RUNNING.get()
            if running is None or return_last_state:  # the state is for a cache: the wrapped forward passes none
                return scan(x, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                            return_last_state=return_last_state, **kwargs)
            ctx, seq_len, docs = running
            return sharded_selective_scan(scan, x, dt, A, B, C, D, z, delta_bias, delta_softplus, ctx.topo,
                                          layout=ctx.layout, seq_len=seq_len, doc_lens=docs, **kwargs)
        return mamba_selective_scan

    def declined(inner: Callable) -> Callable:  # the fused training kernel: None makes the family take the other path
        return lambda *args, **kwargs: None if _RUNNING.get() is not None else inner(*args, **kwargs)

    replace_family_functions(family, {"causal_conv1d_fn": sharded_conv, "mamba_selective_scan": sharded_scan,
                                      "mamba_inner_fn": declined},
                             {"causal_conv1d_fn": ("weight", "bias", "activation"),
                              "mamba_selective_scan": ("dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
                                                       "return_last_state")},
                             optional=("mamba_inner_fn",))


def _documents(hidden_states: Tensor, ctx: USPContext, kwargs: dict) -> tuple[Optional[int], Optional[tuple]]:
    """``(real global length, packed documents per row or None)`` from the call's ``cu_seq_lens_q`` or the context's,
    decoded once per model call (:func:`~ds_usp.integration.data.batch.documents_of`), not per layer."""
    cu = kwargs.get("cu_seq_lens_q")
    documents = documents_of(ctx.cu_seq_lens if cu is None else cu, hidden_states.shape[0])
    return (None, None) if documents is None else (documents.seq_len, documents.lens)


def _masked(hidden_states: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
    """As the layers do: the inputs of padding positions (a 2-D mask's zeros) are zero."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return hidden_states * attention_mask[:, -hidden_states.shape[1]:, None].to(hidden_states.dtype)
    return hidden_states


def _forward(module: nn.Module, ctx: USPContext) -> Callable:
    from transformers.activations import ACT2FN

    kda = is_kimi_delta(module)  # which family's inputs and rule: resolved once per layer, not per call
    rule, activation = _rule(module, kda), ACT2FN[getattr(module, "activation", "silu")]
    norm, proj = (getattr(module, name) for name in next(x for x in _OUTPUTS if _has(module, x)))
    dv = linear_dims(module)[3]
    beta_scale = 2.0 if getattr(module, "allow_neg_eigval", False) else 1.0  # OLMo Hybrid: beta in [0, 2]

    @functools.wraps(module.forward)
    def forward(hidden_states: Tensor, cache_params: Any = None, attention_mask: Optional[Tensor] = None,
                **kwargs: Any) -> Tensor:
        _refuse_cache(cache_params, module, ctx)
        seq_len, docs = _documents(hidden_states, ctx, kwargs)
        hidden_states = _masked(hidden_states, attention_mask)
        q, k, v, z, g, beta = _inputs(module, hidden_states, kda, beta_scale)
        conv = module.conv1d
        core = gated_delta_attention(q, k, v, g, beta, conv.weight, conv.bias, ctx.topo, rule, activation,
                                     layout=ctx.layout, seq_len=seq_len, doc_lens=docs, native_op=ctx.native_op)
        bsz, s = hidden_states.shape[:2]
        # (b, s, nv, dv) -> (b*s*nv, dv): the gated norm per token and head, as the layer does
        out = norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(bsz, s, -1)
        return proj(out)

    return forward


_WRAPPED = "_usp_wrapped"  # on a mixer whose forward wrap_linear_layers replaced


def _whole_or_sharded(own: Callable, sharded: Callable, ctx: USPContext, layer: Any) -> Callable:
    """A mixer's forward: ``sharded`` (its shard of the sequence, state passed over the SP group, in ``layer`` for the
    collectives' watchdog: :func:`ds_usp.watchdog.run_in_layer`), or, while the model runs whole sequences on each rank
    (:func:`ds_usp.integration.models.attention.unsharded`: generation), the layer's ``own`` forward, which reads and
    updates the cache's convolution and recurrent state as in one process and communicates nothing (the family
    functions ds-usp swapped pass through outside a sharded forward)."""

    @functools.wraps(sharded)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if ctx.unsharded:
            return own(*args, **kwargs)
        inputs = args[0] if args else next(iter(kwargs.values()), None)  # hidden_states / input_states
        return run_in_layer(layer, lambda: sharded(*args, **kwargs), inputs)

    return forward


def _wrapper(module: nn.Module) -> Optional[Callable[[nn.Module, USPContext], Callable]]:
    """What makes ``module``'s forward run under the USP topology, by the kind of mixer it is (None: not one)."""
    for kind, wrap in ((is_short_conv, _short_conv_forward), (is_selective_ssm, _selective_forward),
                       (is_rglru_block, _rglru_block_forward), (is_mamba2, _mamba2_forward),
                       (is_linear_attention, _forward)):
        if kind(module):
            return wrap
    return None


def wrap_linear_layers(model: nn.Module) -> int:
    """Make every sequence mixer ds-usp shards (:func:`is_wrapped_mixer`: linear attention, Mamba-1 mixers, short
    convolutions, Griffin recurrent blocks) of ``model`` run under the USP topology :func:`ds_usp.hf.attach` gave it
    (:func:`check_hybrid` first: the linear heads against the Ulysses degree).

    Args:
        model: the model (already attached).

    Returns:
        How many layers were wrapped.
    """
    ctx = context_of(model)
    wrapped = 0
    for name, module in model.named_modules():
        if is_wrapped_mixer(module) and not getattr(module, _WRAPPED, False):
            layer = getattr(module, "layer_idx", None)  # as the softmax layers are named, else the module's path
            replace_forward(module, _whole_or_sharded(module.forward, _wrapper(module)(module, ctx), ctx,
                                                      layer if isinstance(layer, int) else name))
            set_module_attribute(module, _WRAPPED, True)
            wrapped += 1
    return wrapped


def check_hybrid(model: nn.Module, ulysses_degree: int) -> None:
    """Refuse a hybrid whose linear heads the Ulysses degree cannot split, before any group is built.

    Raises:
        ValueError: naming the layer's heads and the degree.
    """
    for module in model.modules():
        if is_linear_attention(module):
            nk, nv, _, _ = linear_dims(module)
            check_linear_heads(nk, nv, ulysses_degree)

