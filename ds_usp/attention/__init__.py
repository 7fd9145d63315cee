"""The attention algorithms: Ulysses (:mod:`.ulysses`), ring (:mod:`.ring`) and USP (:mod:`.usp`), their checks.

Data flows down the layers of docs/architecture.md: these modules use :mod:`ds_usp.comm`,
:mod:`ds_usp.kernels` and :mod:`ds_usp.native`, never the integration layer.
"""
from ds_usp.attention.usp import (AttentionMask, AttentionRun, USPAttention, attention, ring_attention,
                               ulysses_attention, usp_attention)

__all__ = ["AttentionMask", "AttentionRun", "USPAttention", "attention", "ring_attention", "ulysses_attention",
           "usp_attention"]
