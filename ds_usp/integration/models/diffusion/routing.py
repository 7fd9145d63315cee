"""The attention of a sharded diffusers module: its processor's q, k, v of the rank's local sequence, through the USP
attention over the whole sequence (:class:`AttentionRoute`).

diffusers' processors apply QK-norm and RoPE per token before they dispatch, so q and k arrive with their positions
inside them; the route only needs to know the module's streams (their order in the local sequence) to tell the
attention which keys are real and which the model's mask keeps
(:meth:`ds_usp.integration.models.diffusion.state.DiTCall.keys`).
What the route does not implement is refused by name: causal attention, attention dropout, returning the LSE, and
any mask other than the key mask ds-usp cut for the module's streams.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ds_usp.attention import AttentionMask, attention
from ds_usp.integration.models.diffusion.state import DiTContext
from ds_usp.upstream.diffusers import DispatchRoute
from ds_usp.watchdog import run_in_layer

NEUTRAL = ("enable_gqa",)  # dispatch_attention_fn's keywords that change nothing here (ds-usp's attention does GQA)


class AttentionRoute(DispatchRoute):
    """The USP attention of one attention module of a sharded diffusion transformer.

    Args:
        dit: the model's context (its current forward's streams and masks).
        order: the streams the module's local sequence holds, in order.
        module: the module's path in the model (named in errors).
    """

    def __init__(self, dit: DiTContext, order: tuple[str, ...], module: str) -> None:
        self.dit, self.order, self.module = dit, order, module

    def __repr__(self) -> str:  # diffusers' logging prints processors
        return f"ds-usp AttentionRoute({self.module}: {' + '.join(self.order)})"

    def run(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
            is_causal: bool, scale: Optional[float], extra: dict) -> Tensor:
        """The attention of this rank's local sequence against the whole one.

        Args:
            query: ``(b, s, hq, d)`` the rank's local sequence over :attr:`order`.
            key: ``(b, s, hkv, d)``.
            value: ``(b, s, hkv, dv)``.
            attn_mask: None, or the key mask the module's processor built from the mask ds-usp cut (bool, or additive
                with 0 where kept), broadcast over queries.
            dropout_p: must be 0.
            is_causal: must be False.
            scale: the softmax scale (None: ``1/sqrt(d)``).
            extra: the backend's other keywords (:data:`NEUTRAL` ones, or ``return_lse=False``).

        Returns:
            ``(b, s, hq, dv)``.

        Raises:
            ValueError: something the route does not implement, naming the module.
        """
        call = self.dit.call
        if is_causal:
            self._refuse("is_causal=True", "diffusion transformers attend bidirectionally; ds-usp does not guess a "
                         "causal order of their streams")
        if dropout_p:
            self._refuse(f"dropout_p={dropout_p}", "attention dropout is not supported under sequence parallelism")
        unknown = {k: v for k, v in extra.items() if k not in NEUTRAL and v not in (None, False)}
        if unknown:
            self._refuse(", ".join(f"{k}={v!r}" for k, v in unknown.items()), "ds-usp's attention does not implement "
                         "it")
        expected = call.local_length(self.order)
        if query.shape[1] != expected:
            self._refuse(f"{query.shape[1]} tokens", f"this rank holds {expected} tokens of "
                         f"{' + '.join(self.order)}: a tensor of the module's streams was not cut as the family's plan "
                         f"says (docs/models.md)")
        if attn_mask is not None:
            self._check_mask(attn_mask, query.shape[0])
        keys = call.keys(self.order, query.shape[0])
        return run_in_layer(self.module,  # its path names it for the watchdog ("transformer_blocks.7.attn")
                            lambda: attention(query, key, value, self.dit.topo, AttentionMask(causal=False, keys=keys),
                                              self.dit.run, scale), query)

    def _check_mask(self, attn_mask: Tensor, batch: int) -> None:
        """Refuse a mask that is not the key mask ds-usp cut for this module's streams (compared on real tokens, on
        the mask's device: the result is read with the forward's other checks at its end, never here)."""
        s = attn_mask.shape[-1]
        if attn_mask.dim() < 2 or (attn_mask.dim() > 2 and attn_mask.shape[-2] != 1):
            self._refuse(f"attn_mask of shape {tuple(attn_mask.shape)}", "only a key mask, the same for every "
                         "query, is supported")
        call = self.dit.call
        if call.handed(attn_mask, self.order):  # the very part ds-usp handed on (HunyuanVideo's processors)
            return
        kept = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -1.0  # additive: 0 kept, -1e4 / -inf not
        kept = kept.reshape(kept.shape[0], -1, s).all(dim=1).expand(batch, s)  # (b, ..., s) -> (b, s)
        want, real = call.local_mask(self.order, batch, kept.device)
        unknown = "it is not the key mask ds-usp cut for the module's streams (a mask passed through the attention " \
                  "keyword arguments, or one the family's plan does not know)"
        if want.shape[1] != s:
            self._refuse("an attention mask", unknown)
        if not call.closed:  # a recomputation repeats what the forward checked
            call.defer(((kept == want) | ~real).all(), self._refusal("an attention mask", unknown))

    def _refusal(self, what: str, why: str) -> str:
        return f"{self.dit.model_name} ({self.module}) passes {what} to its attention: {why}"

    def _refuse(self, what: str, why: str) -> None:
        raise ValueError(self._refusal(what, why))


def route_call(route: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """``route.run`` for ds-usp's own processors (no mask, no dropout, the default scale)."""
    return route.run(query, key, value, None, 0.0, False, None, {})
