"""The training step of an HF causal LM under sequence parallelism, applied to the model from outside (:func:`apply`).

``ds_usp.initialize`` calls :func:`apply`, which wraps the model the way torchtitan applies parallelisms: the
attention layers know nothing about it. The model's forward becomes :class:`CausalLMStep`, whose paths are its
methods: a call without labels (the model's own forward), the SP loss (:meth:`CausalLMStep.loss`), TRL's fused LM head
(:meth:`CausalLMStep.fused`) and a VLM's body (:meth:`CausalLMStep.multimodal`); a trainer that gives every rank of a
group the whole sequences (:class:`WholeBatches`) has them sharded first (:meth:`CausalLMStep.whole_call`). Each
memory feature lives in its own module:

* :mod:`.loss`: the SP loss through ``lm_head`` in chunks (``usp.chunked_loss``): ``model(input_ids=...,
  shift_labels=...)`` (or ``labels=``) returns ``out.loss`` without ever holding the whole logits; it is the
  token-weighted mean over the SP group's whole sequence, the same on every rank, each rank's gradient its
  exact share. ``out.logits`` is None unless ``return_logits=True``.
* :mod:`.tiling`: every decoder layer's MLP over sequence tiles, recomputed per tile (``usp.tiled_mlp``).
* :mod:`.recompute`: per-layer activation checkpointing, selective or full, and the offload of the kept layer inputs
  (``usp.activation_checkpointing``, ``usp.offload_activations``).
* :mod:`.choices`: the settings and the per-call :class:`~ds_usp.integration.step.choices.StepChoices`.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_usp.cost import StepSettings
from ds_usp.integration.data.batch import IGNORE_INDEX, MULTIMODAL_KEY, VISUAL_KEYS, packed_documents, shard_batch
from ds_usp.integration.data.batch import shift_labels as shift_sequence_labels
from ds_usp.integration.models.attention import context_of
from ds_usp.integration.models.multimodal import body_and_language_model, sharded_language_model
from ds_usp.integration.models.shape import shape_of
from ds_usp.integration.step.choices import MemoryContext, MemorySettings
from ds_usp.integration.step.logprobs import FUSED_HEAD_ATTR, fused_forward
from ds_usp.integration.step.loss import LogitsTail, chunked_lm_loss, load_balancing_loss, sp_loss
from ds_usp.integration.step.recompute import Offload, checkpointed_layer_forward
from ds_usp.integration.step.tail import RouterAux, find_logits_tail, find_router_aux
from ds_usp.integration.step.tiling import GatedParts, gated_parts, tile_bounds, tiled_mlp
from ds_usp.upstream.torch import replace_forward
from ds_usp.log import log_rank0
from ds_usp.sharding import gather_sequence, shard_sequence
from ds_usp.topology import USPTopology

# attribute names of a decoder layer's feed-forward block: dense MLPs and MoE blocks (Mixtral, Qwen3-MoE, GPT-OSS,
# DeepSeek-V3: mlp; Granite-MoE: block_sparse_moe; Jamba: feed_forward; DBRX: ffn)
FEED_FORWARD_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn", "moe")


def feed_forward_blocks(layer: nn.Module) -> list[nn.Module]:
    """The feed-forward blocks (dense MLP or MoE) of a decoder layer, by the attribute names families use.

    Args:
        layer: one decoder layer.

    Returns:
        The blocks found (none for a layer without one).
    """
    return [block for name in FEED_FORWARD_NAMES if isinstance(block := getattr(layer, name, None), nn.Module)]


@dataclass
class ModelTail:
    """What the wrapped forward of a causal LM computes after its decoder, found from the model (tail.py).

    Attributes:
        name: the model's class, named in errors.
        logits: its post-``lm_head`` transform, or None when ds-usp could not reproduce it.
        router: its MoE load-balancing loss, or None.
        router_problem: why the family's router loss cannot be computed under SP (None: it can, or has none).
    """

    name: str
    logits: Optional[LogitsTail]
    router: Optional[RouterAux] = None
    router_problem: Optional[str] = None


def decoder_of(model: nn.Module) -> Optional[nn.Module]:
    """The module that holds the decoder layers (``.layers``): ``get_decoder()``, else the base model or ``.model``
    (Llama 4's ``get_decoder()`` returns the whole causal LM). None when there is none."""
    get_decoder = getattr(model, "get_decoder", None)
    for candidate in (get_decoder() if callable(get_decoder) else None, getattr(model, "base_model", None),
                      getattr(model, "model", None)):
        if isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    return None


def apply(model: nn.Module, settings: MemorySettings, topo: USPTopology, layout: str,
          zero3: bool, step: Optional[StepSettings] = None) -> Optional[MemoryContext]:
    """Wrap an HF causal LM with the SP loss and the memory features, from outside.

    Args:
        model: the model (``get_decoder()`` with ``.layers``, ``get_output_embeddings()``, ``config``), given its
            :class:`~ds_usp.integration.models.attention.USPContext` first (its current call's degree is the one the
            loss runs at).
        settings: the ``usp`` memory keys.
        topo: the topology (used when the model has no USP context).
        layout: the sequence layout (for ``labels=``, which are shifted over the whole sequence).
        zero3: ZeRO-3 is on (tile counts are then agreed over the ranks).
        step: the layout and ZeRO settings the engine trains with (the model's states in the memory budget; None:
            read from ``topo``).

    Returns:
        The shared context, or None when ``model`` is not an HF causal LM (then nothing is wrapped). The
        SP loss of ``model(..., shift_labels=...)`` is always installed on a causal LM, with the model's own
        post-``lm_head`` transform and MoE router loss; the settings decide the chunking, tiling (dense and MoE
        feed-forward blocks, whatever their attribute name), checkpointing and offload.

    Raises:
        ValueError: a feature set to ``true`` cannot be applied to this model (the message says why).
    """
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # a VLM: its language model's sizes
    get_head = getattr(model, "get_output_embeddings", None)
    decoder = decoder_of(model)
    head = get_head() if callable(get_head) else None
    layers = getattr(decoder, "layers", None)
    if cfg is None or decoder is None or head is None or layers is None or not hasattr(head, "weight"):
        problem = (f"{type(model).__name__} is not a HuggingFace causal LM with get_decoder().layers and "
                   f"get_output_embeddings()")
        forced = [k for k in ("chunked_loss", "tiled_mlp", "activation_checkpointing", "offload_activations")
                  if getattr(settings, k) not in ("auto", False, None)]
        if forced:
            raise ValueError(f"usp.{forced[0]} is set, but {problem}; set it to 'auto' or false")
        log_rank0(f"usp memory features and the model's SP loss are off: {problem}")
        return None
    router, router_problem = find_router_aux(model)
    tail = ModelTail(type(model).__name__, find_logits_tail(model, model.forward, decoder, head), router,
                     router_problem)
    if tail.logits is None:
        log_rank0(f"{tail.name} transforms its logits after lm_head in a way ds-usp does not reproduce: its SP loss "
                  f"(labels= / shift_labels=) is refused; compute it from the logits with ds_usp.sp_cross_entropy")
    ctx = MemoryContext(settings=settings, fallback_topo=topo, layout=layout, hidden=cfg.hidden_size,
                        intermediate=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size), vocab=head.weight.shape[0]
                        if head.weight.dim() == 2 and head.weight.numel() else cfg.vocab_size,
                        layers=len(layers), zero3=zero3, usp=context_of(model), shape=shape_of(model), step=step,
                        offload=Offload())
    hf_checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if hf_checkpointing is None:
        hf_checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if hf_checkpointing and settings.activation_checkpointing is not False:
        model.gradient_checkpointing_disable()  # ours keeps the attention's result; two nested would recompute twice
        log_rank0("HF gradient checkpointing is replaced by usp.activation_checkpointing (set it to false to keep HF's)")
    replace_forward(model, functools.wraps(model.forward)(CausalLMStep(model, model.forward, decoder, head, ctx,
                                                                       tail)))
    for index, layer in enumerate(layers):
        for block in feed_forward_blocks(layer):
            replace_forward(block, _tiled_mlp_forward(block.forward, tuple(block.parameters()), ctx,
                                                      gated_parts(block, block.forward)))
            if zero3 and settings.tiled_mlp is not False and not _has_experts(block):
                _gather_once_per_call(block)
        replace_forward(layer, checkpointed_layer_forward(layer.forward, ctx, index))
    return ctx


def _has_experts(block: nn.Module) -> bool:
    return any("expert" in name.lower() for name, _ in block.named_modules())


def _gather_once_per_call(block: nn.Module) -> None:
    """A dense MLP block as a ZeRO-3 leaf module (DeepSpeed's ``set_z3_leaf_module``): its weights gathered once when
    the block is called and its gradients reduced once after its backward, instead of DeepSpeed's fetch/release hooks
    on each of its ``Linear`` layers at every tile (forward and backward), CPU work that outgrows a tile's matmuls on
    GPUs at length. MoE blocks are left alone: a leaf would gather every expert at once."""
    from deepspeed.utils import set_z3_leaf_module

    set_z3_leaf_module(block, True)


def _tiled_mlp_forward(original: Callable[[Tensor], Tensor], params: tuple, ctx: MemoryContext,
                       gated: Optional[GatedParts]) -> Callable:
    @functools.wraps(original)
    def forward(x: Tensor) -> Tensor:
        tiles = ctx.choices.mlp_tiles if ctx.choices is not None else 0
        if not tiles or x.dim() != 3:
            return original(x)
        return tiled_mlp(x, original, tiles, params, gated)
    return forward


# sharded with the batch, besides the ids, labels, positions and mask
WHOLE_KEYS = ("seq_lens", "cu_seq_lens_q", *VISUAL_KEYS)
# what a padding-free collator derives from the documents, which the shard derives again
DERIVED_KEYS = ("cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass
class WholeBatches:
    """A trainer whose batches are whole sequences, the same on every rank of an SP group: the model's forward shards
    them (:meth:`CausalLMStep.whole_call`), so any Trainer subclass's ``compute_loss`` and ``prediction_step`` run
    unchanged.

    Attributes:
        pad_token_id: the token the shards' end padding takes.
        caller: the ``compute_loss`` running now (named when it asks for logits to compute a loss from).
        whole_logits: a prediction step: ``out.logits`` are the whole sequences'.
        paused: the batches given now are shards already (dynamic SP's micro batches).
    """

    pad_token_id: int = 0
    caller: Optional[str] = None
    whole_logits: bool = False
    paused: bool = False

    @contextlib.contextmanager
    def _while(self, field: str, value: Any, after: Any) -> Iterator[None]:
        setattr(self, field, value)
        try:
            yield
        finally:
            setattr(self, field, after)

    def calling(self, caller: str) -> contextlib.AbstractContextManager:
        """While ``caller`` (a ``compute_loss``) runs: named if it asks for logits to compute a loss from."""
        return self._while("caller", caller, None)

    def predicting(self, whole_logits: bool) -> contextlib.AbstractContextManager:
        """While a prediction step runs: ``out.logits`` are the whole sequences' when ``whole_logits``."""
        return self._while("whole_logits", whole_logits, False)

    def shards_given(self) -> contextlib.AbstractContextManager:
        """While the batches given are shards already (dynamic SP's micro batches): not sharded again."""
        return self._while("paused", True, False)


def feed_whole_batches(model: nn.Module, feed: WholeBatches) -> None:
    """Make ``model``'s wrapped forward take whole sequences (:class:`WholeBatches`).

    Args:
        model: the model ``ds_usp.initialize`` adapted (or a wrapper holding it).
        feed: the feed's settings, kept and changed by the trainer.

    Raises:
        ValueError: no module of ``model`` has ds-usp's causal-LM forward (not a causal LM ds-usp wrapped).
    """
    steps = [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), CausalLMStep)]
    if not steps:
        raise ValueError(f"{type(model).__name__} has no causal-LM forward of ds-usp's: the HF Trainer path of "
                         f"\"sequence_parallel\" trains causal LMs and VLMs (get_decoder().layers and an lm_head)")
    for step in steps:
        step.take_whole_batches(feed)


class CausalLMStep:
    """The forward of an HF causal LM under sequence parallelism (what :func:`apply` makes ``model.forward``).

    Args:
        model: the causal LM.
        original: its own forward.
        decoder: the module holding its decoder layers (:func:`decoder_of`).
        head: its ``lm_head``.
        ctx: the memory context its layers share.
        tail: what it computes after the decoder.
    """

    def __init__(self, model: nn.Module, original: Callable, decoder: nn.Module, head: nn.Module,
                 ctx: MemoryContext, tail: ModelTail) -> None:
        self.model, self.original, self.decoder, self.head, self.ctx, self.tail = (model, original, decoder, head,
                                                                                   ctx, tail)
        self.whole: Optional[WholeBatches] = None  # set by a trainer that gives every rank whole sequences

    def take_whole_batches(self, feed: WholeBatches) -> None:
        """From now on, calls get whole sequences (:class:`WholeBatches`), sharded here."""
        self.whole = feed

    def __call__(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                 position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                 shift_labels: Optional[Tensor] = None, return_logits: bool = False,
                 num_items_in_batch: Optional[Tensor] = None, output_router_logits: Optional[bool] = None,
                 **kwargs: Any) -> Any:
        """The model's call: without labels its own forward; with them the SP loss; with ``fused_lm_head=True``
        TRL's per-token log-probs of the whole batch. Under :class:`WholeBatches` (a trainer's batches, every rank of
        the group the same whole sequences) the inputs are sharded here first (:meth:`whole_call`)."""
        args = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                    shift_labels=shift_labels, return_logits=return_logits, num_items_in_batch=num_items_in_batch,
                    output_router_logits=output_router_logits)
        if self.whole is not None and not self.whole.paused and not kwargs.get("fused_lm_head", False):
            return self.whole_call(args, kwargs)
        return self.shard_call(**args, **kwargs)

    def shard_call(self, input_ids: Optional[Tensor], attention_mask: Optional[Tensor],
                   position_ids: Optional[Tensor], labels: Optional[Tensor], shift_labels: Optional[Tensor],
                   return_logits: bool, num_items_in_batch: Optional[Tensor], output_router_logits: Optional[bool],
                   **kwargs: Any) -> Any:
        """The call on this rank's shard (what ``engine(**shard_batch(...))`` gives), or TRL's fused call."""
        multimodal = kwargs.pop(MULTIMODAL_KEY, None)
        if multimodal is not None and labels is None and shift_labels is None:
            raise ValueError("a multimodal shard is trained with its shift_labels (ds_usp.shard_batch gives them)")
        routed = self._routed(output_router_logits)
        if self.tail.router is not None:
            kwargs["output_router_logits"] = routed
        if kwargs.pop("fused_lm_head", False):  # TRL's fused LM head (GRPO, RLOO, DPO): the whole batch on every rank
            return self.fused(input_ids, attention_mask, position_ids, labels, shift_labels, num_items_in_batch,
                              routed, kwargs)
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        self._choose(ref.shape[0] * ref.shape[1], ref.device)
        if labels is None and shift_labels is None:
            out = self.original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                **kwargs)
            if routed and getattr(out, "router_logits", None):
                out["aux_loss"] = self._router_loss(out, attention_mask, *ref.shape[:2])  # the group's, not the shard's
            return out
        return self.loss(input_ids, attention_mask, position_ids, labels, shift_labels, return_logits,
                         num_items_in_batch, routed, multimodal, kwargs)

    def whole_call(self, args: dict, kwargs: dict) -> Any:
        """A trainer's whole sequences (every rank of the SP group holds the same batch): sharded with
        :func:`ds_usp.shard_batch` (labels shifted over the whole sequence first), then the SP loss of the shard,
        which is the group's whole loss on every rank (over ``num_items_in_batch`` when given, HF's count of the
        step's targets on every rank, so the Trainer's own arithmetic holds). Without labels: in training refused by
        name (a loss computed from logits would see only this rank's shard), in evaluation the whole sequences'
        logits, gathered over the group.

        Raises:
            ValueError: a training forward without labels, ``shift_labels`` given whole, or a sequence-long input
                ds-usp does not know how to shard (named).
        """
        feed, ctx = self.whole, self.ctx
        ids = args["input_ids"]
        if ids is None:
            raise ValueError(f"{self.tail.name} is given no input_ids: ds-usp shards a trainer's batches by them")
        if args["shift_labels"] is not None:
            raise ValueError("the batch carries shift_labels: under sequence parallelism ds-usp shifts the labels over "
                             "the whole sequence itself; give the collator's labels instead")
        if args["labels"] is None and self.model.training and torch.is_grad_enabled():
            raise ValueError(f"{feed.caller or 'the training step'} calls {self.tail.name} without labels, to compute "
                             f"the loss from its logits: under sequence parallelism each rank holds one shard of every "
                             f"sequence and ds-usp never builds the whole logits, so that loss would be wrong. Let the "
                             f"model compute its loss (pass labels; its loss_function with num_items_in_batch is the "
                             f"sequence-parallel loss over the group), or train without \"sequence_parallel\"")
        batch = {k: args[k] for k in ("input_ids", "labels", "position_ids", "attention_mask") if args[k] is not None}
        batch.update({k: kwargs.pop(k) for k in WHOLE_KEYS if kwargs.get(k) is not None})
        derived = DERIVED_KEYS if args["position_ids"] is None else (*DERIVED_KEYS, "seq_lens", "cu_seq_lens_q")
        for key in derived:  # derived again from the documents; packed rows' documents from their position_ids,
            batch.pop(key, None)  # as the model's own attention finds them (a collator's cu_seq_lens may add rows)
            kwargs.pop(key, None)
        unknown = sorted(k for k, v in kwargs.items()
                         if isinstance(v, Tensor) and tuple(v.shape[:2]) == tuple(ids.shape))
        if unknown:
            raise ValueError(f"the batch's {', '.join(unknown)} run along the sequence, and ds-usp does not know how "
                             f"to shard them under sequence parallelism: drop them from the batch")
        shard = shard_batch(batch, ctx.topo, layout=ctx.layout, pad_token_id=feed.pad_token_id)
        targets = shard.pop("shift_labels")
        wanted = feed.whole_logits or args["labels"] is None
        out = self.shard_call(**shard, labels=None, shift_labels=targets if args["labels"] is not None else None,
                              return_logits=args["return_logits"] or wanted,
                              num_items_in_batch=args["num_items_in_batch"],
                              output_router_logits=args["output_router_logits"], **kwargs)
        if wanted and getattr(out, "logits", None) is not None:
            docs = packed_documents(shard["cu_seq_lens_q"], ids.shape[0])[1]
            out["logits"] = gather_sequence(out.logits, ctx.topo, dim=1, layout=ctx.layout, seq_len=ids.shape[1],
                                            doc_lens=docs)  # (b, S, V): the whole sequences, on every rank
        return out

    # ---- the paths ---------------------------------------------------------------------------------------------
    def loss(self, input_ids: Optional[Tensor], attention_mask: Optional[Tensor], position_ids: Optional[Tensor],
             labels: Optional[Tensor], shift_labels: Optional[Tensor], return_logits: bool,
             num_items_in_batch: Optional[Tensor], routed: bool, multimodal: Optional[dict], kwargs: dict) -> Any:
        """The SP loss of this rank's shard (the token-weighted mean over the group's whole sequence)."""
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        ctx, tail = self.ctx, self.tail
        if tail.logits is None:
            raise ValueError(f"{tail.name} transforms its logits after lm_head in a way ds-usp's SP loss does not "
                             f"reproduce (see docs/models.md): call it without labels / shift_labels and compute the "
                             f"loss from out.logits with ds_usp.sp_cross_entropy")
        kwargs.setdefault("use_cache", False)  # a loss is wanted: no KV cache (HF builds one when config.use_cache)
        if multimodal is not None:  # a VLM: its body on the whole sequence, its language model on the shard
            out = self.multimodal(multimodal, kwargs)
        else:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **kwargs)
        hidden = out[0]  # (b, s_local, H)
        if shift_labels is None:  # labels of this rank's shard: shift them over the whole sequence
            seq, docs = packed_documents(kwargs.get("cu_seq_lens_q"), labels.shape[0])
            full = gather_sequence(labels, ctx.topo, dim=1, layout=ctx.layout, seq_len=seq, doc_lens=docs)  # (b, S)
            shift_labels = shard_sequence(shift_sequence_labels(full, docs), ctx.topo, dim=1, layout=ctx.layout,
                                          pad_value=IGNORE_INDEX, doc_lens=docs)
        choices = ctx.choices
        logits = tail.logits.apply(self.head(hidden)) if return_logits or not choices.loss_chunk else None
        if choices.loss_chunk:
            loss = chunked_lm_loss(hidden, self.head, shift_labels, ctx.topo, choices.loss_chunk,
                                   choices.loss_grad_in_forward, num_items_in_batch, tail.logits)
        else:  # the whole logits, plain autograd: (b, s, V) -> (b*s, V)
            loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift_labels.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
            loss = sp_loss(loss_sum, shift_labels, ctx.topo, num_items_in_batch)
            logits = logits if return_logits else None
        aux = None
        if routed:
            aux = self._router_loss(out, attention_mask, *hidden.shape[:2])
            loss = loss + tail.router.coef * aux
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits,
                                         past_key_values=getattr(out, "past_key_values", None),
                                         hidden_states=getattr(out, "hidden_states", None),
                                         attentions=getattr(out, "attentions", None),
                                         router_logits=getattr(out, "router_logits", None))

    def fused(self, input_ids: Optional[Tensor], attention_mask: Optional[Tensor], position_ids: Optional[Tensor],
              labels: Optional[Tensor], shift_labels: Optional[Tensor], num_items_in_batch: Optional[Tensor],
              routed: bool, kwargs: dict) -> Any:
        """TRL's ``fused_lm_head=True`` call: the whole batch on every rank of the group, each running its shard
        (:func:`ds_usp.integration.step.logprobs.fused_forward`)."""
        from trl.trainer.utils import FusedCausalLMOutput

        tail = self.tail
        settings = getattr(self.model, FUSED_HEAD_ATTR, None)
        if settings is None:
            raise ValueError(f"{tail.name} is called with fused_lm_head=True (TRL's fused LM head) under sequence "
                             f"parallelism, but its temperature is unknown to ds-usp: train with ds_usp.USPGRPOTrainer, "
                             f"USPRLOOTrainer or USPDPOTrainer instead of TRL's own trainers")
        if tail.logits is None:
            raise ValueError(f"{tail.name} transforms its logits after lm_head in a way ds-usp does not reproduce (see "
                             f"docs/models.md), so its per-token log-probs under sequence parallelism are refused")
        documented = [k for k in ("seq_lens", "cu_seq_lens_q", *DERIVED_KEYS)
                      if kwargs.pop(k, None) is not None]  # a padding-free collator's: found from position_ids
        if documented and position_ids is None:
            raise ValueError(f"fused_lm_head=True with {', '.join(documented)} but no position_ids: under sequence "
                             f"parallelism ds-usp finds packed documents from the position_ids TRL's collator gives")
        visual = sorted(k for k in VISUAL_KEYS if kwargs.get(k) is not None)
        if visual:  # the decoder below is the text model: it would drop them without a word
            raise ValueError(f"{tail.name} is given {', '.join(visual)} with fused_lm_head=True: RL and preference "
                             f"training of vision-language models is not supported under sequence parallelism yet")
        aux = []

        def run_decoder(shard: dict, real: Tensor) -> Tensor:
            ids = shard["input_ids"]
            self._choose(ids.numel(), ids.device)
            usp = context_of(self.model)
            if usp is not None:
                usp.set_documents(shard["cu_seq_lens_q"])  # for layers that do not pass the documents on
            inputs = {k: v for k, v in shard.items() if k != "shift_labels"}
            out = self.decoder(**inputs, **{**kwargs, "use_cache": False})
            if routed:
                aux.append(self._router_loss(out, real, *ids.shape))
            return out[0]

        fields = fused_forward(run_decoder, self.head, tail.logits, self.ctx.topo, self.ctx.layout, settings,
                               input_ids, attention_mask, position_ids, labels, shift_labels, num_items_in_batch,
                               chunk=lambda tokens: self.ctx.choices.loss_chunk or tokens)
        if aux:
            fields["loss"] = fields["loss"] + tail.router.coef * aux[0]
        return FusedCausalLMOutput(**fields, aux_loss=aux[0] if aux else None)

    def multimodal(self, multimodal: dict, kwargs: dict) -> Any:
        """A VLM's body on the whole sequence (its visual inputs resolved there), its language model on the shard."""
        body, language = body_and_language_model(self.model)
        if body is None:
            raise ValueError(f"{self.tail.name} is given visual inputs, but ds-usp finds no VLM body with a "
                             f"language_model in it (docs/models.md lists the vision-language families)")
        inputs = dict(multimodal)
        documents = {"docs": inputs.pop("docs"), **{k: kwargs[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k",
                                                                             "max_length_q", "max_length_k")}}
        with sharded_language_model(language, self.ctx.topo, self.ctx.layout, documents):
            return body(**inputs, use_cache=False)

    # ---- shared pieces -------------------------------------------------------------------------------------------
    def _choose(self, tokens: int, device: torch.device) -> None:
        """The memory features of this call, from the tokens this rank holds."""
        weight = self.head.weight
        self.ctx.choose(tokens, device, weight.dtype if weight.is_floating_point() else torch.float32)

    def _routed(self, output_router_logits: Optional[bool]) -> bool:
        """Whether the call adds the MoE router loss (refused by name when the family's cannot be computed)."""
        router = self.tail.router
        routed = bool(output_router_logits if output_router_logits is not None else
                      (router is not None and router.default_on))
        if routed and router is None:  # a dense model has none to add; an MoE family whose loss ds-usp cannot compute
            if self.tail.router_problem:
                raise ValueError(f"output_router_logits: {self.tail.router_problem}; set output_router_logits=False")
            return False
        return routed

    def _router_loss(self, out: Any, attention_mask: Optional[Tensor], rows: int, length: int) -> Tensor:
        """The MoE load-balancing loss over the SP group's whole sequence."""
        choices, router = self.ctx.choices, self.tail.router
        tiles = tile_bounds(length, choices.mlp_tiles) if choices is not None and choices.mlp_tiles else None
        valid = None if attention_mask is None else attention_mask.reshape(-1) != 0
        return load_balancing_loss(tuple(out.router_logits), router.num_experts, router.top_k, valid, self.ctx.topo,
                                   tiles, rows)

