"""Linear attention under USP: Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo Hybrid), Kimi Delta Attention (Kimi
Linear) and Mamba-2's scan with Ulysses for heads and state passing across the ring
(:func:`gated_delta_attention`), short causal convolutions over a sharded sequence (LFM2:
:func:`sharded_causal_conv`) and Mamba-1's selective scan (:func:`sharded_selective_scan`); the single-process
pieces in :mod:`.delta`.

A sibling of :mod:`ds_usp.attention` (softmax attention): the same all-to-all for heads, a state exchange instead
of K/V blocks across the ring. Data flows down the layers of docs/architecture.md: it uses the attention layer's
all-to-all, :mod:`ds_usp.comm` and :mod:`ds_usp.sharding`, never the integration layer.
"""
from ds_usp.linear.conv import sharded_causal_conv
from ds_usp.linear.selective import sharded_linear_recurrence, sharded_selective_scan
from ds_usp.linear.sp import check_linear_heads, gated_delta_attention

__all__ = ["check_linear_heads", "gated_delta_attention", "sharded_causal_conv", "sharded_linear_recurrence",
           "sharded_selective_scan"]
