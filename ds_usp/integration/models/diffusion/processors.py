"""ds-usp's attention processors for the families whose own processors call torch's ``scaled_dot_product_attention``
directly (CogVideoX, SD3 / SD3.5): the same projections, QK-norms and RoPE, line for line, on ``(b, s, h, d)``
tensors (the norms act on the head dim and RoPE per token, so the layout changes nothing), and the attention through
the module's :class:`~ds_usp.integration.models.diffusion.routing.AttentionRoute`.

Their ``__call__`` takes the parameters of the processor it replaces, so the attention module's keyword filtering
passes the same arguments; an argument whose value the original would use and these do not implement is refused.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from ds_usp.integration.models.diffusion.routing import route_call


def _no_mask(route: Any, attention_mask: Optional[Tensor], extra: dict) -> None:
    if attention_mask is not None:
        raise ValueError(f"{route.dit.model_name} ({route.module}) is given an attention mask: its processor takes "
                         f"none in one process either (diffusers' CogVideoX / SD3 pipelines pass none)")
    unknown = {k: v for k, v in extra.items() if v is not None}
    if unknown:
        raise ValueError(f"{route.dit.model_name} ({route.module}) is given {', '.join(unknown)}: ds-usp's processor "
                         f"does not implement it (IP-adapter and other processor arguments are not supported under "
                         f"sequence parallelism)")


def _heads(x: Tensor, heads: int) -> Tensor:
    # (b, s, h*d) -> (b, s, h, d)
    return x.view(x.shape[0], x.shape[1], heads, x.shape[2] // heads)


def _projected(x: Tensor, heads: int, to_q: nn.Module, to_k: nn.Module, to_v: nn.Module, norm_q: Optional[nn.Module],
               norm_k: Optional[nn.Module]) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` of ``x`` in heads, ``(b, s, h, d)`` each, q and k normalized where the module has a norm."""
    q, k, v = (_heads(proj(x), heads) for proj in (to_q, to_k, to_v))
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


class CogVideoXUSPProcessor:
    """``CogVideoXAttnProcessor2_0`` over the rank's ``[text, video]`` tokens.

    Args:
        route: the module's route.
    """

    def __init__(self, route: Any) -> None:
        self.route = route

    def __call__(self, attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor,
                 attention_mask: Optional[Tensor] = None, image_rotary_emb: Optional[tuple[Tensor, Tensor]] = None,
                 **extra: Any) -> tuple[Tensor, Tensor]:
        """The joint attention of the rank's text and video tokens.

        Args:
            attn: the attention module.
            hidden_states: ``(b, n, c)`` the rank's video tokens.
            encoder_hidden_states: ``(b, t, c)`` its text tokens.
            attention_mask: must be None.
            image_rotary_emb: ``(cos, sin)``, each ``(n, d)``: the RoPE of the rank's video tokens (5B), or None.
            **extra: nothing else is implemented.

        Returns:
            ``(video (b, n, c), text (b, t, c))``.
        """
        from diffusers.models.embeddings import apply_rotary_emb

        _no_mask(self.route, attention_mask, extra)
        text = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # (b, t + n, c)
        query, key, value = _projected(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v, attn.norm_q,
                                       attn.norm_k)
        if image_rotary_emb is not None:
            query = torch.cat([query[:, :text], apply_rotary_emb(query[:, text:], image_rotary_emb, sequence_dim=1)],
                              dim=1)
            if not attn.is_cross_attention:
                key = torch.cat([key[:, :text], apply_rotary_emb(key[:, text:], image_rotary_emb, sequence_dim=1)],
                                dim=1)
        out = route_call(self.route, query, key, value)  # (b, t + n, h, d)
        out = out.flatten(2, 3)  # (b, t + n, h*d)
        out = attn.to_out[1](attn.to_out[0](out))
        encoder_hidden_states, hidden_states = out.split([text, out.size(1) - text], dim=1)
        return hidden_states, encoder_hidden_states


class JointUSPProcessor:
    """``JointAttnProcessor2_0`` (SD3 / SD3.5) over the rank's ``[image, text]`` tokens, or its image tokens alone
    (SD3.5's second attention, called without text).

    Args:
        route: the module's route.
    """

    def __init__(self, route: Any) -> None:
        self.route = route

    def __call__(self, attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Optional[Tensor] = None,
                 attention_mask: Optional[Tensor] = None, *args: Any, **extra: Any) -> Any:
        """The joint (or image-only) attention of the rank's tokens.

        Args:
            attn: the attention module.
            hidden_states: ``(b, n, c)`` the rank's image tokens.
            encoder_hidden_states: ``(b, t, c)`` its text tokens, or None.
            attention_mask: must be None.
            *args: must be empty.
            **extra: nothing else is implemented.

        Returns:
            ``(image (b, n, c), text (b, t, c))``, or the image alone without text.
        """
        _no_mask(self.route, attention_mask, {**extra, **({"positional arguments": args} if args else {})})
        image = hidden_states.shape[1]
        query, key, value = _projected(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v, attn.norm_q,
                                       attn.norm_k)
        if encoder_hidden_states is not None:
            text_query, text_key, text_value = _projected(encoder_hidden_states, attn.heads, attn.add_q_proj,
                                                          attn.add_k_proj, attn.add_v_proj, attn.norm_added_q,
                                                          attn.norm_added_k)
            query = torch.cat([query, text_query], dim=1)
            key = torch.cat([key, text_key], dim=1)
            value = torch.cat([value, text_value], dim=1)
        out = route_call(self.route, query, key, value).flatten(2, 3).to(query.dtype)  # (b, n [+ t], h*d)
        text_out = None
        if encoder_hidden_states is not None:
            out, text_out = out[:, :image], out[:, image:]
            if not attn.context_pre_only:
                text_out = attn.to_add_out(text_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if encoder_hidden_states is None else (out, text_out)


USP_PROCESSORS = {"cogvideox": CogVideoXUSPProcessor, "joint": JointUSPProcessor}  # a Role's usp_processor
