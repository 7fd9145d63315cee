"""A VLM's vision towers under ``usp.vision_tower``: whole on every rank, or each block on the rank's shard of the patches.

``"replicated"`` (the default): every rank encodes every image and frame; the towers' attention is switched from
``"usp"`` to ``"sdpa"``. ``"sharded"``: the towers whose blocks take the patches as one packed sequence with
``cu_seqlens`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and kin) run every block on the rank's shard of the patches
(:func:`_shard_block_call`): the block's input and its per-patch position embeddings are cut to the shard, its
attention is USP over the SP group (bidirectional, the images / frames / windows of ``cu_seqlens`` as documents), and
its output is gathered back (:func:`_gather_block_output`), so what the family does between blocks (Qwen2.5-VL's
window order, Qwen3-VL's deepstack mergers, the final merger) sees whole sequences. The gather's backward sums the
group's gradients before each rank keeps its own patches' (every rank's loss reaches every patch). The blocks'
activations, the tower's memory at length, are then a shard's.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from ds_usp.comm import sum_grads_over_group
from ds_usp.integration.data.batch import host_bounds
from ds_usp.integration.models.attention import VISION_ATTN_NAME, context_of
from ds_usp.integration.models.multimodal import body_and_language_model
from ds_usp.upstream.torch import set_module_attribute
from ds_usp.upstream.transformers import attention_implementation, set_attention_implementation
from ds_usp.log import log_rank0
from ds_usp.sharding import gather_sequence, shard_sequence


def prepare_vision_towers(model: nn.Module, mode: str = "replicated") -> list[str]:
    """Set up a VLM's vision towers for ``usp.vision_tower``; a text model is left alone.

    Args:
        model: the model.
        mode: ``"replicated"``: every sub-config of ``model`` other than its language model's is switched from
            ``"usp"`` to ``"sdpa"`` (each rank encodes every image); ``"sharded"``: the towers whose blocks take
            ``cu_seqlens`` run on the SP group (see the module doc), the other sub-configs as for replicated.

    Returns:
        The configs switched to sdpa (replicated) or the towers sharded.

    Raises:
        ValueError: ``"sharded"`` for a model with no tower ds-usp can shard (named, with the towers it has).
    """
    _, language = body_and_language_model(model)
    if language is None:
        if mode == "sharded":
            raise ValueError(f'usp.vision_tower="sharded": {type(model).__name__} has no vision tower beside a '
                             f'language model; use "replicated" (the default)')
        return []
    towers = [m for m in model.modules() if _shardable_tower(m)] if mode == "sharded" else []
    if mode == "sharded" and not towers:
        raise ValueError(f'usp.vision_tower="sharded": {type(model).__name__}\'s vision tower does not run its '
                         f'patches as one packed sequence with cu_seqlens (Qwen2-VL, Qwen2.5-VL, Qwen3-VL do), so '
                         f'ds-usp cannot shard it; use "replicated" (the default)')
    for tower in towers:
        set_attention_implementation(tower.config, VISION_ATTN_NAME)
        for block in tower.blocks:
            block.register_forward_pre_hook(_shard_block_call, with_kwargs=True)
            block.register_forward_hook(_gather_block_output)
        log_rank0(f"{type(tower).__name__}: {len(tower.blocks)} blocks run on each rank's shard of the patches "
                  f"(usp.vision_tower=\"sharded\")")
    keep = {id(language.config), id(model.config), *(id(t.config) for t in towers)}
    switched = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in keep and attention_implementation(config) == "usp":
            set_attention_implementation(config, "sdpa")
            switched.append(type(config).__name__)
    switched = sorted(set(switched))
    if switched:
        log_rank0(f"the vision tower runs whole images on every rank: {', '.join(switched)} attention set to sdpa")
    return sorted({type(t).__name__ for t in towers}) if towers else switched


def _shardable_tower(module: nn.Module) -> bool:
    """A vision tower whose blocks take the patches as one packed sequence with ``cu_seqlens``."""
    blocks = getattr(module, "blocks", None)
    config = getattr(module, "config", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks) or config is None:
        return False
    return "cu_seqlens" in inspect.signature(type(blocks[0]).forward).parameters


_TOWER_CALL = "_ds_usp_tower_call"  # on a block during its call: (real patch count, documents) for the gather


def _shard_block_call(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before a vision block: its input and its per-patch tensors (position embeddings) cut to this rank's shard."""
    ctx = context_of(block)
    if ctx is None or ctx.unsharded:
        set_module_attribute(block, _TOWER_CALL, None)
        return args, kwargs
    hidden = args[0] if args else kwargs["hidden_states"]
    cu = kwargs.get("cu_seqlens")
    n = hidden.shape[0]
    bounds = None if cu is None else host_bounds(cu)  # read once per tower call, not per block
    if bounds is None or bounds[-1] != n:
        raise ValueError(f"{type(block).__name__} is called without cu_seqlens covering its {n} patches; ds-usp shards "
                         f"a vision block's patches by them")
    docs = [b - a for a, b in zip(bounds, bounds[1:])]

    def cut(x: Any) -> Any:
        if isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] == n:
            return shard_sequence(x, ctx.topo, dim=0, layout=ctx.layout, pad_value=0, doc_lens=docs)
        if isinstance(x, tuple):
            return tuple(cut(y) for y in x)
        return x

    set_module_attribute(block, _TOWER_CALL, (n, docs))
    rest = {k: v if k in ("cu_seqlens", "max_seqlen") else cut(v) for k, v in kwargs.items()}
    return tuple(cut(a) for a in args), rest


def _gather_block_output(block: nn.Module, args: tuple, output: Tensor) -> Tensor:
    """After a vision block: the whole sequence of its output on every rank (see the module doc)."""
    call = getattr(block, _TOWER_CALL, None)
    if call is None:
        return output
    n, docs = call
    ctx = context_of(block)
    return sum_grads_over_group(gather_sequence(output, ctx.topo, dim=0, layout=ctx.layout, seq_len=n,
                                                doc_lens=docs), ctx.topo.sp_group)


