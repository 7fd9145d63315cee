"""The memory of the whole training step at long sequence lengths, applied to an HF causal LM from outside.

:func:`apply` (called by ``ds_usp.initialize``) wraps the model the way torchtitan applies parallelisms:
the attention layers know nothing about it.

* **Chunked logits + loss** (``usp.chunked_loss``): ``model(input_ids=..., shift_labels=...)`` (or
  ``labels=``) returns ``out.loss`` without ever holding the full logits: the hidden states go through
  ``lm_head`` and the cross-entropy chunk by chunk (:class:`ChunkedLMLoss`). The loss is the
  token-weighted mean over the whole sequence of the SP group, the same value on every rank of the
  group, and its gradient on each rank is that rank's exact share. ``out.logits`` is None unless
  ``return_logits=True``.
* **Tiled MLP** (``usp.tiled_mlp``): every decoder layer's MLP runs over sequence tiles and recomputes
  each tile in the backward (:class:`TiledMLP`), so its ``tokens x intermediate_size`` activations
  never exist whole.
* **Activation checkpointing** (``usp.activation_checkpointing``) per decoder layer, torch's
  non-reentrant checkpoint. ``"selective"`` keeps the ring attention's output and LSE (a custom op,
  kept by torch's selective checkpointing policy) so the backward recomputes only the projections,
  norms and the cheap all-to-alls, never the attention itself; ``"full"`` recomputes everything
  (ALST's way, the least memory).
* **Offload** (``usp.offload_activations``): the checkpointed hidden states (each layer's input) wait
  for the backward in host memory (a copy to ``cpu`` and back, so a no-op on CPU).

"auto" settings are decided per forward call from the tokens each rank holds (:class:`StepPlan`):
features turn on when sequence parallelism is on and the sequence is long enough to need them.

Why not DeepSpeed's ``TiledFusedLogitsLoss`` / ``TiledMLP``: the loss takes the weight gradient
inside its forward with a unit incoming gradient and never multiplies it by the real one (so the
``lm_head`` gradient is wrong under gradient accumulation, loss scaling or a later division, as with
ArcticTraining's wiring); ``TiledMLP`` cuts tiles with ``torch.chunk``, whose tile count depends on
the length, so under ZeRO-3 (a parameter gather per tile) replicas with different lengths would
gather a different number of times and hang. Both ideas are kept: recompute per tile, and
``ds_grad_is_ready`` so that ZeRO reduces a weight's gradient once, after its last tile.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

from ds_usp.comm import sum_over_group
from ds_usp.integration.data import IGNORE_INDEX, docs_from_cu_seq_lens, sp_token_mean
from ds_usp.integration.data import shift_labels as shift_sequence_labels
from ds_usp.log import log_rank0
from ds_usp.topology import USPTopology

MIB = 2 ** 20
CHECKPOINT_MIN_TOKENS = 2048  # "auto" checkpoints the layers when a rank holds at least this many tokens
OFFLOAD_SHARE = 0.1  # "auto" offloads when the checkpointed hidden states would take this share of the GPU
MLP_LIVE = 6  # tokens x intermediate tensors a tile's backward holds at once (gate, up, act, product, 2 grads)


@dataclass(frozen=True)
class MemorySettings:
    """The ``usp`` memory keys (see docs/config.md).

    Attributes:
        chunked_loss: ``"auto"``, True or False.
        tiled_mlp: ``"auto"``, True or False.
        activation_checkpointing: ``"auto"``, ``"selective"``, ``"full"`` or False.
        offload_activations: ``"auto"``, True or False.
        tile_mib: the budget of one tile: a logits chunk in fp32, an MLP tile's intermediate.
    """

    chunked_loss: Any = "auto"
    tiled_mlp: Any = "auto"
    activation_checkpointing: Any = "auto"
    offload_activations: Any = "auto"
    tile_mib: float = 128.0


@dataclass(frozen=True)
class StepPlan:
    """What one forward call does, decided from the tokens per rank (the same on every rank).

    Attributes:
        tokens: tokens this rank holds (batch x local length); the largest over the ranks under ZeRO-3.
        loss_chunk: tokens per logits chunk (0: the loss is not chunked).
        loss_grad_in_forward: take the loss's gradients in its forward (no recompute; holds one
            ``vocab x hidden`` fp32 weight gradient until the backward) instead of recomputing each
            chunk's logits in the backward.
        mlp_tiles: tiles of the MLP (0: not tiled).
        checkpoint: ``"selective"``, ``"full"`` or ``""`` (off).
        offload: move each checkpointed layer input to host memory.
    """

    tokens: int
    loss_chunk: int = 0
    loss_grad_in_forward: bool = False
    mlp_tiles: int = 0
    checkpoint: str = ""
    offload: bool = False


@dataclass
class MemoryContext:
    """What the wrapped model shares between its top-level forward and its layers."""

    settings: MemorySettings
    topo: USPTopology
    layout: str
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    zero3: bool
    plan: Optional[StepPlan] = field(default=None)

    def make_plan(self, tokens: int, device: torch.device, dtype: torch.dtype) -> StepPlan:
        """Decide the features for a forward call over ``tokens`` tokens per rank.

        Args:
            tokens: batch x local sequence length of this rank.
            device: the activations' device.
            dtype: the activations' dtype.

        Returns:
            The plan.
        """
        if self.zero3 and dist.get_world_size() > 1:  # tile counts decide how often ZeRO-3 gathers: agree on them
            t = torch.tensor([tokens], device=_group_device(device))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.topo.sp_dp_group)
            tokens = int(t)
        s, tile = self.settings, self.settings.tile_mib * MIB
        elem = torch.empty(0, dtype=dtype).element_size()
        logits_bytes = tokens * self.vocab * 4
        chunked = s.chunked_loss is True or (s.chunked_loss == "auto" and logits_bytes > tile)
        loss_chunk = max(1, int(tile // (self.vocab * 4))) if chunked else 0
        ckpt = s.activation_checkpointing
        if ckpt == "auto":
            ckpt = "selective" if tokens >= CHECKPOINT_MIN_TOKENS else ""
        ckpt = ckpt or ""
        mlp_bytes = tokens * self.intermediate * elem * MLP_LIVE
        tiled = s.tiled_mlp is True or (s.tiled_mlp == "auto" and (bool(ckpt) or mlp_bytes > tile))
        offload = s.offload_activations is True
        if s.offload_activations == "auto" and ckpt and device.type == "cuda":
            held = self.layers * tokens * self.hidden * elem
            offload = held > OFFLOAD_SHARE * torch.cuda.get_device_properties(device).total_memory
        return StepPlan(tokens=tokens, loss_chunk=loss_chunk,
                        loss_grad_in_forward=chunked and self.vocab * self.hidden * 4 <= tile,
                        mlp_tiles=max(1, math.ceil(mlp_bytes / tile)) if tiled else 0, checkpoint=ckpt,
                        offload=bool(offload and ckpt))


def _group_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")


# -------------------------------------------------------------------------------- chunked loss


def _gathered(params: list[Optional[Tensor]]) -> Any:
    """ZeRO-3's gather of ``params`` for the block: a no-op for parameters ZeRO-3 does not partition or keeps
    whole (persistent small ones, or already gathered; gathering those would release them on exit)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    partitioned = [p for p in params if p is not None and getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


def _chunk(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, start: int, stop: int,
           dx: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
    """One chunk: its loss sum; with ``dx``/``dw`` given, also its gradients (written/added into them).

    The gradient of ``sum_t valid_t * (logsumexp(z_t) - z_t[y_t])`` with respect to the logits is
    ``softmax(z_t) - onehot(y_t)`` on valid rows; it is cast to the matmul dtype as autograd would,
    and multiplied by ``scale`` (the incoming gradient) when given. Everything of ``chunk x vocab``
    size happens in the one fp32 logits buffer (``torch.logsumexp`` would add two more).
    """
    xc, yc = x[start:stop], labels[start:stop]
    logits = F.linear(xc, weight, bias).float()  # (c, V), the chunk's only (c, V) buffer
    valid = yc != IGNORE_INDEX
    target = yc.clamp_min(0)
    picked = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    peak = logits.amax(dim=1, keepdim=True)
    norm = logits.sub_(peak).exp_().sum(dim=1, keepdim=True)  # logits now hold exp(z - max)
    lse = peak.squeeze(1) + norm.squeeze(1).log()
    loss = ((lse - picked) * valid).sum()
    if dx is None:
        return loss
    probs = logits.div_(norm)  # softmax
    rows = torch.arange(yc.shape[0], device=yc.device)
    probs[rows, target] -= 1.0
    probs.mul_(valid.unsqueeze(1) if scale is None else (valid * scale).unsqueeze(1))
    grad = probs.to(x.dtype)  # dlogits as autograd hands it to the matmul
    torch.mm(grad, weight, out=dx[start:stop])
    if grad.dtype == dw.dtype:
        dw.addmm_(grad.t(), xc)
    else:
        dw.add_(grad.t() @ xc)
    if db is not None:
        db.add_(grad.sum(0))
    return loss


class ChunkedLMLoss(torch.autograd.Function):
    """Sum over tokens of ``cross_entropy(lm_head(hidden), labels)`` computed chunk by chunk, never whole.

    Two ways to get the gradients, same numbers: ``grad_in_forward`` takes them chunk by chunk in the
    forward (three matmuls per chunk, nothing recomputed; it holds ``dx`` and an fp32 weight gradient
    until the backward, which multiplies them by the incoming gradient: exact under any scaling);
    otherwise the backward recomputes each chunk's logits (four matmuls per chunk, nothing held but
    the inputs). Under ZeRO-3 the caller gathers the ``lm_head`` weight once per pass, not per chunk.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk: int,
                grad_in_forward: bool) -> Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])  # (b, s, H) -> (b*s, H)
        y = labels.reshape(-1)
        ctx.hidden_shape, ctx.chunk, ctx.grad_in_forward = hidden.shape, chunk, grad_in_forward
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        grads = _grad_buffers(x, weight, bias) if grad_in_forward else (None, None, None)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], chunk):
            total += _chunk(x, weight, bias, y, start, start + chunk, *grads, None)
        ctx.save_for_backward(*grads) if grad_in_forward else ctx.save_for_backward(x, weight, bias, y)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        if ctx.grad_in_forward:
            dx, dw, db = ctx.saved_tensors
            dx, dw, db = dx * grad.to(dx.dtype), dw * grad, None if db is None else db * grad
        else:
            x, weight, bias, y = ctx.saved_tensors
            dx, dw, db = _grad_buffers(x, weight, bias)
            with _gathered([weight, bias]):
                for start in range(0, x.shape[0], ctx.chunk):
                    _chunk(x, weight, bias, y, start, start + ctx.chunk, dx, dw, db, grad)
        w_dtype, b_dtype = ctx.dtypes
        return (dx.view(ctx.hidden_shape), dw.to(w_dtype), None if db is None else db.to(b_dtype), None, None,
                None)


def _grad_buffers(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``dx`` (x's dtype) and fp32 accumulators for the weight and bias gradients."""
    def zeros(t: Tensor) -> Tensor:
        return torch.zeros(t.shape, dtype=torch.float32, device=t.device)

    return torch.empty_like(x), zeros(weight), None if bias is None else zeros(bias)


def chunked_lm_loss(hidden: Tensor, lm_head: nn.Module, shift_labels: Tensor, topo: Optional[USPTopology],
                    chunk: int, grad_in_forward: bool, num_items: Optional[Tensor] = None) -> Tensor:
    """The token-weighted mean cross-entropy of the whole sequence held by ``topo``'s SP group, in chunks.

    Args:
        hidden: ``(b, s_local, H)`` final hidden states (after the model's last norm).
        lm_head: the output projection (``vocab x H`` weight, optional bias).
        shift_labels: ``(b, s_local)`` next-token targets, ``-100`` ignored.
        topo: the topology (None or SP size 1: this rank's tokens are the whole sequence).
        chunk: tokens per logits chunk.
        grad_in_forward: see :class:`ChunkedLMLoss` (only used when gradients are wanted).
        num_items: divide by this count instead of the SP group's valid targets (HF's
            ``num_items_in_batch``, for gradient accumulation).

    Returns:
        A scalar fp32 loss: the same value on every rank of the SP group; each rank's backward gives
        its own tokens' exact gradient.
    """
    weight, bias = lm_head.weight, lm_head.bias
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    with _gathered([weight, bias]):
        total = ChunkedLMLoss.apply(hidden, weight, bias, shift_labels, chunk, grad_in_forward and wants_grad)
    return sp_loss(total, shift_labels, topo, num_items)


def sp_loss(loss_sum: Tensor, shift_labels: Tensor, topo: Optional[USPTopology],
            num_items: Optional[Tensor] = None) -> Tensor:
    """This rank's summed token losses -> the SP group's mean (:func:`ds_usp.integration.data.sp_token_mean`).

    Args:
        loss_sum: this rank's summed token losses.
        shift_labels: this rank's targets (their non-ignored count is the denominator).
        topo: the topology.
        num_items: a denominator given by the caller instead (HF's ``num_items_in_batch``, already the count
            over the whole sequence and the accumulation window).

    Returns:
        The loss, the same value on every rank of the SP group.
    """
    if num_items is None:
        return sp_token_mean(loss_sum, (shift_labels != IGNORE_INDEX).sum(), topo)
    if topo is not None and topo.sp_size > 1:
        loss_sum = sum_over_group(loss_sum, topo.sp_group)
    return loss_sum / torch.as_tensor(num_items, dtype=torch.float32, device=loss_sum.device).clamp_min(1.0)


# -------------------------------------------------------------------------------------- tiled MLP


def _tile_bounds(length: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` slices of ``[0, length)``, possibly empty at the end: the count never depends on the length."""
    step = max(1, math.ceil(length / tiles))
    return [(min(i * step, length), min((i + 1) * step, length)) for i in range(tiles)]


class TiledMLP(torch.autograd.Function):
    """``mlp(x)`` over ``tiles`` sequence tiles; the backward recomputes one tile at a time.

    ``x`` is saved before anything is computed, so a checkpointed layer's recomputation (which stops
    once every saved tensor is back) ends before the MLP runs again. Under ZeRO every parameter of
    ``mlp`` is marked not ready (``ds_grad_is_ready``) until its last tile's gradient is in, so its
    gradient is reduced once.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, mlp: Callable[[Tensor], Tensor], tiles: int, params: tuple) -> Tensor:
        ctx.save_for_backward(x)
        ctx.mlp, ctx.tiles, ctx.params = mlp, tiles, params
        return torch.cat([mlp(x[:, a:b]) for a, b in _tile_bounds(x.shape[1], tiles)], dim=1)  # (b, s, H)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        dx = torch.zeros_like(x)
        bounds = _tile_bounds(x.shape[1], ctx.tiles)
        for i, (a, b) in enumerate(bounds):
            for p in ctx.params:
                p.ds_grad_is_ready = i == len(bounds) - 1
            xt = x[:, a:b].detach().requires_grad_(True)
            with torch.enable_grad():
                yt = ctx.mlp(xt)
            torch.autograd.backward(yt, grad[:, a:b])
            dx[:, a:b] = xt.grad
        return dx, None, None, None


# ---------------------------------------------------------------------- activation checkpointing


def _keep_ring_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: keep the ring's (out, lse); recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.ds_usp.ring_attention.default \
        else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _keep_ring_attention)


class _ToHost(torch.autograd.Function):
    """A copy to pinned host memory whose gradient goes back to the device (offload of a checkpointed input)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.device = x.device
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return host.copy_(x, non_blocking=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.to(ctx.device, non_blocking=True)


def to_host(x: Tensor) -> Tensor:
    """``x`` in host memory, differentiably (``x`` itself when it is there already: the CPU no-op)."""
    return x if x.device.type == "cpu" else _ToHost.apply(x)


# ---------------------------------------------------------------------------- applying to a model


def apply(model: nn.Module, settings: MemorySettings, topo: USPTopology, layout: str, zero3: bool) -> Optional[MemoryContext]:
    """Wrap an HF causal LM (Llama, Qwen2, Mistral and alike) with the memory features, from outside.

    Args:
        model: the model (``get_decoder()`` with ``.layers``, ``get_output_embeddings()``, ``config``).
        settings: the ``usp`` memory keys.
        topo: the topology.
        layout: the sequence layout (for ``labels=``, which are shifted over the whole sequence).
        zero3: ZeRO-3 is on (tile counts are then agreed over the ranks).

    Returns:
        The shared context, or None when ``model`` is not an HF causal LM (then nothing is wrapped). The
        SP loss of ``model(..., shift_labels=...)`` is always installed on a causal LM; the settings
        decide the chunking, tiling, checkpointing and offload.

    Raises:
        ValueError: a feature set to ``true`` cannot be applied to this model (the message says why).
    """
    cfg = getattr(model, "config", None)
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = get_head() if callable(get_head) else None
    layers = getattr(decoder, "layers", None)
    problem = None
    if cfg is None or decoder is None or head is None or layers is None or not hasattr(head, "weight"):
        problem = (f"{type(model).__name__} is not a HuggingFace causal LM with get_decoder().layers and "
                   f"get_output_embeddings()")
    elif getattr(cfg, "final_logit_softcapping", None) is not None:
        problem = f"{type(model).__name__} caps its logits (final_logit_softcapping), which the chunked loss does not"
    if problem:
        forced = [k for k in ("chunked_loss", "tiled_mlp", "activation_checkpointing", "offload_activations")
                  if getattr(settings, k) not in ("auto", False, None)]
        if forced:
            raise ValueError(f"usp.{forced[0]} is set, but {problem}; set it to 'auto' or false")
        log_rank0(f"usp memory features and the model's SP loss are off: {problem}")
        return None
    ctx = MemoryContext(settings=settings, topo=topo, layout=layout, hidden=cfg.hidden_size,
                        intermediate=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size), vocab=head.weight.shape[0]
                        if head.weight.dim() == 2 and head.weight.numel() else cfg.vocab_size,
                        layers=len(layers), zero3=zero3)
    if getattr(model, "is_gradient_checkpointing", False) and settings.activation_checkpointing is not False:
        model.gradient_checkpointing_disable()  # ours keeps the attention's result; two nested would recompute twice
        log_rank0("HF gradient checkpointing is replaced by usp.activation_checkpointing (set it to false to keep HF's)")
    model.forward = _causal_lm_forward(model, model.forward, decoder, head, ctx)
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            mlp.forward = _tiled_mlp_forward(mlp.forward, tuple(mlp.parameters()), ctx)
        layer.forward = _checkpointed_layer_forward(layer.forward, ctx)
    return ctx


def _tiled_mlp_forward(original: Callable[[Tensor], Tensor], params: tuple, ctx: MemoryContext) -> Callable:
    @functools.wraps(original)
    def forward(x: Tensor) -> Tensor:
        tiles = ctx.plan.mlp_tiles if ctx.plan is not None else 0
        if not tiles or x.dim() != 3:
            return original(x)
        return TiledMLP.apply(x, original, tiles, params)
    return forward


def _checkpointed_layer_forward(original: Callable, ctx: MemoryContext) -> Callable:
    @functools.wraps(original)
    def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        plan = ctx.plan
        if plan is None or not plan.checkpoint or not torch.is_grad_enabled():
            return original(hidden_states, *args, **kwargs)

        def run(hidden: Tensor, *rest: Any, **kw: Any) -> Any:  # also the recomputation: the same plan
            ctx.plan = plan
            return original(hidden.to(device), *rest, **kw)

        device = hidden_states.device
        # a KV cache would be filled twice (forward and recomputation); training does not read it anyway
        kwargs.update(use_cache=False, past_key_values=None)
        stored = to_host(hidden_states) if plan.offload else hidden_states
        return checkpoint(run, stored, *args, use_reentrant=False,
                          context_fn=_SELECTIVE if plan.checkpoint == "selective" else noop_context_fn, **kwargs)
    return forward


def _causal_lm_forward(model: nn.Module, original: Callable, decoder: nn.Module, head: nn.Module,
                       ctx: MemoryContext) -> Callable:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from ds_usp.sharding import gather_sequence, shard_sequence

    @functools.wraps(original)
    def forward(input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                shift_labels: Optional[Tensor] = None, return_logits: bool = False,
                num_items_in_batch: Optional[Tensor] = None, **kwargs: Any) -> Any:
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        ctx.plan = ctx.make_plan(ref.shape[0] * ref.shape[1], ref.device,
                                 head.weight.dtype if head.weight.is_floating_point() else torch.float32)
        if labels is None and shift_labels is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        kwargs.setdefault("use_cache", False)  # a loss is wanted: no KV cache (HF builds one when config.use_cache)
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        hidden = out[0]  # (b, s_local, H)
        if shift_labels is None:  # labels of this rank's shard: shift them over the whole sequence
            cu = kwargs.get("cu_seq_lens_q")
            seq, docs = docs_from_cu_seq_lens(cu, labels.shape[0]) if cu is not None else (None, None)
            topo, layout = ctx.topo, ctx.layout
            full = gather_sequence(labels, topo, dim=1, layout=layout, seq_len=seq, doc_lens=docs)  # (b, S)
            shift_labels = shard_sequence(shift_sequence_labels(full, docs), topo, dim=1, layout=layout,
                                          pad_value=IGNORE_INDEX, doc_lens=docs)
        plan = ctx.plan
        logits = head(hidden) if return_logits or not plan.loss_chunk else None
        if plan.loss_chunk:
            loss = chunked_lm_loss(hidden, head, shift_labels, ctx.topo, plan.loss_chunk, plan.loss_grad_in_forward,
                                   num_items_in_batch)
        else:  # the whole logits, plain autograd: (b, s, V) -> (b*s, V)
            loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift_labels.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
            loss = sp_loss(loss_sum, shift_labels, ctx.topo, num_items_in_batch)
            logits = logits if return_logits else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=getattr(out, "past_key_values", None),
                                      hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))
    return forward
