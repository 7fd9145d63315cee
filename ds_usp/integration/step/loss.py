"""The SP loss of a causal LM: the token-weighted cross-entropy of the whole sequence, through ``lm_head`` in chunks.

Every SP loss lives here: :func:`sp_token_mean` (a rank's summed token losses -> the SP group's mean, the value on
every rank, each rank's share as gradient), :func:`sp_cross_entropy` (from logits), :func:`sp_loss` (with HF's
``num_items_in_batch``), :func:`chunked_lm_loss` (through ``lm_head`` in chunks, after the model's
:class:`LogitsTail`) and the MoE router's :func:`load_balancing_loss` over the whole group.
:func:`chunked_lm_loss` never holds the whole logits (:class:`ChunkedLMLoss`); :func:`sp_loss` turns a rank's
summed token losses into the SP group's mean. The loss is the same value on every rank of the group, and its
gradient on each rank is that rank's exact share.

Why not DeepSpeed's ``TiledFusedLogitsLoss``: it takes the weight gradient inside its forward with a unit
incoming gradient and never multiplies it by the real one (so the ``lm_head`` gradient is wrong under gradient
accumulation, loss scaling or a later division, as with ArcticTraining's wiring).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_usp.comm import all_reduce_sum_, sum_over_group
from ds_usp.integration.data.batch import IGNORE_INDEX
from ds_usp.topology import USPTopology

# -------------------------------------------------------------------------------- the SP loss


def sp_token_mean(loss_sum: Tensor, count: Tensor, topo: Optional[USPTopology]) -> Tensor:
    """``sum over the SP group of loss_sum / sum of count``: the value on every rank, each rank's share as gradient.

    Args:
        loss_sum: this rank's summed token losses (a differentiable scalar).
        count: this rank's number of targets (a scalar; not differentiated).
        topo: the topology (None or SP size 1: this rank's tokens are the whole sequence).

    Returns:
        The token-weighted mean, fp32.
    """
    count = count.to(torch.float32)
    if topo is not None and topo.loss_group_size > 1:  # a dynamic-SP degree: its parent's whole group
        loss_sum = sum_over_group(loss_sum, topo.loss_group)
        all_reduce_sum_(count, topo.loss_group, "SP loss all-reduce")
    return loss_sum / count.clamp_min(1.0)


def sp_cross_entropy(logits: Tensor, shift_labels: Tensor, topo: USPTopology) -> Tensor:
    """The token-weighted mean cross-entropy of the whole sequence held by the SP group (see the module doc).

    The value is the single-device mean loss of the full sequences on every rank of the group, however
    unevenly the ignored (``-100``) labels fall over the ranks; call ``backward`` (or ``engine.backward``)
    on it directly on every rank.

    Args:
        logits: ``(b, s_local, vocab)``.
        shift_labels: ``(b, s_local)`` from :func:`shard_batch`.
        topo: the topology.

    Returns:
        A scalar tensor (fp32).

    Raises:
        ValueError: shapes disagree.
    """
    if logits.shape[:2] != shift_labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} disagree")
    # (b, s, V) -> (b*s, V)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift_labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return sp_token_mean(loss_sum, (shift_labels != IGNORE_INDEX).sum(), topo)


@dataclass(frozen=True)
class LogitsTail:
    """What a causal LM applies to ``lm_head``'s output ``z`` before its loss: ``softcap * tanh(scale z / softcap)``.

    Attributes:
        scale: multiplies the logits (Cohere's ``logit_scale``; ``1 / logits_scaling`` for Granite).
        softcap: the final logit soft-cap (Gemma 2/3's ``final_logit_softcapping``); 0: none.
    """

    scale: float = 1.0
    softcap: float = 0.0

    @property
    def identity(self) -> bool:
        """Nothing is applied."""
        return self.scale == 1.0 and not self.softcap

    def apply(self, z: Tensor) -> Tensor:
        """The model's logits from ``lm_head``'s output (differentiable)."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


NO_TAIL = LogitsTail()

# -------------------------------------------------------------------------------- chunked loss


def gathered(params: list[Optional[Tensor]]) -> Any:
    """ZeRO-3's gather of ``params`` for the block: a no-op for parameters ZeRO-3 does not partition or keeps
    whole (persistent small ones, or already gathered; gathering those would release them on exit)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    partitioned = [p for p in params if p is not None and getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


@functools.lru_cache(maxsize=None)
def _fp32_product(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32, out=...)`` runs here: a low-precision product written in fp32
    straight from the matmul (cuBLAS). Probed once per device type (a CPU build has no such kernel; in-place
    accumulation into fp32, ``addmm`` with ``out_dtype``, needs its input in the low precision, so it is no help)."""
    if device_type != "cuda":
        return False
    try:
        a = torch.ones((2, 2), dtype=torch.bfloat16, device=device_type)
        out = torch.empty((2, 2), dtype=torch.float32, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32, out=out)
        return bool((out == 2).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _add_weight_grad(dw: Tensor, grad: Tensor, probs: Tensor, xc: Tensor, product: list) -> None:
    """``dw += grad^T xc`` in fp32 with no ``vocab x hidden`` allocation per chunk: in place when ``grad`` is fp32; a
    low-precision ``grad`` through the matmul's fp32 output into one fp32 product per pass (``product``, filled on
    the first chunk; CUDA), else as the fp32 ``probs`` it was cast from times ``xc`` in fp32, in place (chunk-sized
    conversions only)."""
    if grad.dtype == dw.dtype:
        dw.addmm_(grad.t(), xc)
    elif _fp32_product(dw.device.type):
        if not product:
            product.append(torch.empty_like(dw))
        torch.mm(grad.t(), xc, out_dtype=torch.float32, out=product[0])
        dw.add_(product[0])
    else:
        dw.addmm_(probs.t(), xc.float())


def _chunk(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, start: int, stop: int,
           dx: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor], scale: Optional[Tensor],
           tail: LogitsTail, buf: Tensor, product: Optional[list] = None) -> Tensor:
    """One chunk: its loss sum; with ``dx``/``dw`` given, also its gradients (written/added into them).

    The logits are ``tail(lm_head(x))`` (what the model applies after ``lm_head``). The gradient of
    ``sum_t valid_t * (logsumexp(z_t) - z_t[y_t])`` with respect to the logits is ``softmax(z_t) - onehot(y_t)``
    on valid rows, times the tail's derivative (``scale``, and ``1 - tanh^2`` under a soft-cap); it is cast to the
    matmul dtype as autograd would, and multiplied by ``scale`` (the incoming gradient) when given. Everything of
    ``chunk x vocab`` size happens in the one fp32 logits buffer ``buf`` (``torch.logsumexp`` would add two more),
    plus the tanh of a soft-capped tail; the weight gradient is accumulated in fp32 in place
    (:func:`_add_weight_grad`, ``product`` its per-pass fp32 product).
    """
    xc, yc = x[start:stop], labels[start:stop]
    logits = buf[:xc.shape[0]]  # (c, V), the chunk's only (c, V) buffer
    if x.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
        if bias is None:
            torch.mm(xc, weight.t(), out=logits)
        else:
            torch.addmm(bias, xc, weight.t(), out=logits)
    else:  # the matmul in the training dtype, as F.linear, then fp32
        logits.copy_(F.linear(xc, weight, bias))
    if tail.scale != 1.0:
        logits.mul_(tail.scale)
    capped = None
    if tail.softcap:
        capped = logits.div_(tail.softcap).tanh_()  # (c, V): tanh(z / cap), kept for the derivative
        logits = capped * tail.softcap
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
    if capped is not None:  # d(cap tanh(z / cap)) / dz = 1 - tanh^2
        probs.mul_(capped.square_().neg_().add_(1.0))
    if tail.scale != 1.0:
        probs.mul_(tail.scale)
    grad = probs.to(x.dtype)  # dlogits as autograd hands it to the matmul
    torch.mm(grad, weight, out=dx[start:stop])
    _add_weight_grad(dw, grad, probs, xc, product if product is not None else [])
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
                grad_in_forward: bool, tail: LogitsTail) -> Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])  # (b, s, H) -> (b*s, H)
        y = labels.reshape(-1)
        ctx.hidden_shape, ctx.chunk, ctx.grad_in_forward, ctx.tail = hidden.shape, chunk, grad_in_forward, tail
        ctx.scaled = False
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        grads = _grad_buffers(x, weight, bias) if grad_in_forward else (None, None, None)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        buf, product = _logits_buffer(x, weight, chunk), []
        for start in range(0, x.shape[0], chunk):
            total += _chunk(x, weight, bias, y, start, start + chunk, *grads, None, tail, buf, product)
        ctx.save_for_backward(*grads) if grad_in_forward else ctx.save_for_backward(x, weight, bias, y)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        if ctx.grad_in_forward:  # scaled in place: a second fp32 weight gradient would be the loss's largest buffer
            if ctx.scaled:
                raise RuntimeError("the chunked loss took its gradients in the forward and scaled them in its first "
                                   "backward: a second backward through it (retain_graph) is not supported")
            ctx.scaled = True
            dx, dw, db = ctx.saved_tensors
            dx.mul_(grad.to(dx.dtype))
            dw.mul_(grad)
            if db is not None:
                db.mul_(grad)
        else:
            x, weight, bias, y = ctx.saved_tensors
            dx, dw, db = _grad_buffers(x, weight, bias)
            with gathered([weight, bias]):
                buf, product = _logits_buffer(x, weight, ctx.chunk), []
                for start in range(0, x.shape[0], ctx.chunk):
                    _chunk(x, weight, bias, y, start, start + ctx.chunk, dx, dw, db, grad, ctx.tail, buf, product)
        w_dtype, b_dtype = ctx.dtypes
        return (dx.view(ctx.hidden_shape), dw.to(w_dtype), None if db is None else db.to(b_dtype), None, None,
                None, None)


def _logits_buffer(x: Tensor, weight: Tensor, chunk: int) -> Tensor:
    """The one fp32 ``(chunk, V)`` buffer every chunk's logits are written into: a fresh one per chunk fragments
    a CPU heap (glibc keeps the freed block resident while small allocations split it)."""
    return torch.empty((min(chunk, x.shape[0]), weight.shape[0]), dtype=torch.float32, device=x.device)


def _grad_buffers(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``dx`` (x's dtype) and fp32 accumulators for the weight and bias gradients."""
    def zeros(t: Tensor) -> Tensor:
        return torch.zeros(t.shape, dtype=torch.float32, device=t.device)

    return torch.empty_like(x), zeros(weight), None if bias is None else zeros(bias)


def chunked_lm_loss(hidden: Tensor, lm_head: nn.Module, shift_labels: Tensor, topo: Optional[USPTopology],
                    chunk: int, grad_in_forward: bool, num_items: Optional[Tensor] = None,
                    tail: LogitsTail = NO_TAIL) -> Tensor:
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
        tail: what the model applies to ``lm_head``'s output before its loss
            (:func:`ds_usp.integration.step.tail.find_logits_tail`).

    Returns:
        A scalar fp32 loss: the same value on every rank of the SP group; each rank's backward gives
        its own tokens' exact gradient.
    """
    weight, bias = lm_head.weight, lm_head.bias
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    with gathered([weight, bias]):
        total = ChunkedLMLoss.apply(hidden, weight, bias, shift_labels, chunk, grad_in_forward and wants_grad, tail)
    return sp_loss(total, shift_labels, topo, num_items)


def sp_loss(loss_sum: Tensor, shift_labels: Tensor, topo: Optional[USPTopology],
            num_items: Optional[Tensor] = None) -> Tensor:
    """This rank's summed token losses -> the SP group's mean (:func:`sp_token_mean`).

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
    if topo is not None and topo.loss_group_size > 1:
        loss_sum = sum_over_group(loss_sum, topo.loss_group)
    return loss_sum / torch.as_tensor(num_items, dtype=torch.float32, device=loss_sum.device).clamp_min(1.0)


def load_balancing_loss(router_logits: tuple[Tensor, ...], num_experts: int, top_k: int, valid: Optional[Tensor],
                        topo: Optional[USPTopology], tiles: Optional[list[tuple[int, int]]] = None,
                        batch: int = 1) -> Tensor:
    """The Switch-Transformer load-balancing loss over every token of the SP group (HF's ``load_balancing_loss_func``).

    ``num_experts * sum_e f_e P_e`` with ``f_e`` the share of top-k assignments to expert ``e`` and ``P_e`` its mean
    router probability, over the rows of every MoE layer. Both are means over *all* tokens: under sequence
    parallelism their sums and the token count are summed over the SP group before the product, so every rank gets
    the single-process value, and each rank's backward its own rows' share of the gradient.

    Args:
        router_logits: per MoE layer (or per layer and MLP tile, in order), ``(rows, num_experts)`` pre-softmax.
        num_experts: experts per layer.
        top_k: experts per token.
        valid: ``(b * s_local,)`` bool, the rows that are real tokens (None: all).
        topo: the topology (None or SP size 1: this rank's tokens are the whole sequence).
        tiles: the MLP tiles' ``(start, stop)`` along this rank's sequence when an entry holds one tile's rows.
        batch: ``b``, to lay ``valid`` over tile entries.

    Returns:
        The loss, fp32, the same on every rank of the SP group.
    """
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    full = None if valid is None else valid.reshape(batch, -1)  # (b, s_local)
    tile = 0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # (rows, E)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (rows, k)
        if full is None:
            weight = torch.ones(probs.shape[0], dtype=torch.float32, device=device)
        elif probs.shape[0] == full.numel():
            weight = full.reshape(-1).float()
        else:  # one MLP tile's rows: (b, tile) flattened
            a, b = tiles[tile % len(tiles)]
            weight = full[:, a:b].reshape(-1).float()
            tile += 1
        counts.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probs_sum = probs_sum + (probs * weight.unsqueeze(-1)).sum(0)
        rows = rows + weight.sum()
    if topo is not None and topo.loss_group_size > 1:
        all_reduce_sum_(counts, topo.loss_group, "router loss all-reduce")
        all_reduce_sum_(rows, topo.loss_group, "router loss all-reduce")
        probs_sum = sum_over_group(probs_sum, topo.loss_group)
    rows = rows.clamp_min(1.0)
    return (counts / rows * probs_sum / rows).sum() * num_experts
