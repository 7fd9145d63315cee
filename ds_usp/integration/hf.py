"""HuggingFace transformers integration: a ``"usp"`` attention implementation.

    ds_usp.hf.register_usp_attention()            # once, before building the model
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="usp")
    engine, *_ = ds_usp.initialize(model=model, config="ds.json", ...)   # attaches the topology

Every attention layer of the model then runs :func:`ds_usp.usp_attention` on this rank's shard of
the sequence. The model itself is unchanged; the topology is attached to its modules by
:func:`attach` (``ds_usp.initialize`` calls it), so nothing is kept in module globals of ds-usp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import Tensor, nn

from ds_usp.topology import USPTopology
from ds_usp.attention import usp_attention
from ds_usp.integration.data import docs_from_cu_seq_lens

ATTN_NAME = "usp"
_CONTEXT_ATTR = "_usp_context"


@dataclass(frozen=True)
class USPContext:
    """What the attention layers of a model need to run USP.

    Attributes:
        topo: the topology.
        layout: ``"contiguous"`` or ``"zigzag"`` (how batches are sharded).
        attn_backend: local kernel choice (``usp.attn_backend``).
        native_op: ``usp.native_op``: ``"auto"``, ``True`` or ``False``.
    """

    topo: USPTopology
    layout: str
    attn_backend: str = "auto"
    native_op: Union[bool, str] = "auto"


def usp_hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                     cu_seq_lens_q: Optional[Tensor] = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers attention-interface function running USP.

    Args:
        module: the attention layer (carries the :class:`USPContext` set by :func:`attach`).
        query: ``(b, hq, s_local, d)`` as transformers passes it.
        key: ``(b, hkv, s_local, d)``.
        value: ``(b, hkv, s_local, d)``.
        attention_mask: must be ``None`` (the ``"usp"`` mask interface makes HF pass none; documents and
            padding come as ``cu_seq_lens_q``).
        dropout: must be 0.
        scaling: softmax scale.
        is_causal: overrides ``module.is_causal``.
        sliding_window: the layer's window as HF passes it (a query sees itself and the
            ``sliding_window - 1`` tokens before it), None for full attention.
        cu_seq_lens_q: cumulative document lengths over the *global* rows (from
            :func:`ds_usp.integration.data.shard_batch`): packed documents and the real length.
        **kwargs: other transformers arguments (ignored).

    Returns:
        ``((b, s_local, hq, d), None)``.

    Raises:
        RuntimeError: the model was not attached to a topology.
        ValueError: an attention mask or dropout was given.
    """
    ctx = getattr(module, _CONTEXT_ATTR, None)
    if ctx is None:
        raise RuntimeError('this model uses attn_implementation="usp" but has no USP topology: wrap it with '
                           "ds_usp.initialize(...) or call ds_usp.hf.attach(model, context) first")
    if attention_mask is not None:
        raise ValueError("usp attention does not take an attention mask: pack sequences instead of padding them; "
                         "ds_usp.shard_batch passes the documents and the real length as cu_seq_lens_q")
    if dropout:
        raise ValueError(f"usp attention does not support attention dropout ({dropout}); set attention_dropout=0")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    seq_len, docs = None, None
    if cu_seq_lens_q is not None:
        seq_len, docs = docs_from_cu_seq_lens(cu_seq_lens_q, query.shape[0])
        docs = None if all(len(row) == 1 for row in docs) else docs
    window = None
    if sliding_window is not None:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    # (b, h, s, d) -> (b, s, h, d): ds-usp's layout
    out = usp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), ctx.topo,
                        causal=causal, layout=ctx.layout, softmax_scale=scaling, seq_len=seq_len,
                        attn_backend=ctx.attn_backend, native_op=ctx.native_op, doc_lens=docs, window=window)
    return out, None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The ``"usp"`` mask interface: HF builds no mask (the attention takes documents and windows itself)."""
    return None


def register_usp_attention() -> str:
    """Register :func:`usp_hf_attention` with transformers as ``attn_implementation="usp"`` (idempotent).

    Also registers a mask function for ``"usp"`` that builds nothing, so that packed rows (position ids
    restarting at 0) do not make HF materialize a ``(s x s)`` mask.

    Returns:
        The implementation name, ``"usp"``.

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, usp_hf_attention)
    AttentionMaskInterface.register(ATTN_NAME, no_mask)
    return ATTN_NAME


def attach(model: nn.Module, context: USPContext) -> None:
    """Give every module of ``model`` the USP context its ``"usp"`` attention layers read.

    Args:
        model: the (HuggingFace) model.
        context: the topology and layout.
    """
    for m in model.modules():
        setattr(m, _CONTEXT_ATTR, context)
