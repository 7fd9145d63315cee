"""A family's plan applied to a model: the model's forward that starts each call (:class:`DiTForward`), the hooks
that cut its inputs and outputs into the rank's part of each stream, hand its blocks the rank's key masks and
prefix counts, and gather the image stream before the final projection, and its attention modules routed to the
USP attention (:func:`install`).

Hooks bind a module's arguments by name from its class's ``forward`` signature (diffusers calls blocks positionally
under gradient checkpointing, and HunyuanVideo always does). A hook on a block runs in the block's ``__call__``,
outside a checkpoint that ds-usp's per-block checkpointing puts around the block's ``forward``, so the checkpoint
keeps the rank's cut inputs, never the whole ones.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from ds_usp.comm import disagreements
from ds_usp.integration.models.diffusion.plans import IMAGE, Cut, FamilyPlan, Role
from ds_usp.integration.models.diffusion.processors import USP_PROCESSORS
from ds_usp.integration.models.diffusion.routing import AttentionRoute
from ds_usp.integration.models.diffusion.state import DiTCall, DiTContext
from ds_usp.upstream.diffusers import (backend_takes_route, check_forward_parameters, give_route,
                                                   set_processor)


# what the ranks of an SP group that were given different whole inputs must do (the end of the errors saying so)
SAME_INPUTS = ("every rank of a group must give the same whole inputs (the same batch, noise and timesteps: seed them "
               "per data-parallel replica, and draw samples with "
               "DistributedSampler(num_replicas=engine.usp.topo.dp_size, rank=engine.usp.topo.dp_rank))")


def modules_at(model: nn.Module, pattern: str) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` of every module a plan path names (``*``: every member of a block list; a missing optional
    attribute such as SD3's ``attn2`` on a block without it yields nothing).

    Raises:
        ValueError: a path whose fixed part the model does not have.
    """
    def walk(module: nn.Module, parts: list[str], done: str) -> Iterator[tuple[str, nn.Module]]:
        if not parts:
            yield done, module
            return
        head, rest = parts[0], parts[1:]
        if head == "*":
            for i, child in enumerate(module):
                yield from walk(child, rest, f"{done}.{i}" if done else str(i))
            return
        child = getattr(module, head, None) if not head.isdigit() else module[int(head)]
        if child is None and not rest and done:
            return  # an optional module (SD3's attn2 where the block has no dual attention)
        if not isinstance(child, nn.Module):
            raise ValueError(f"{type(model).__name__} has no module {pattern!r}: ds-usp's plan for the family no "
                             f"longer fits the installed diffusers (docs/models.md)")
        yield from walk(child, rest, f"{done}.{head}" if done else head)

    if pattern == "":
        yield "", model
        return
    yield from walk(model, pattern.split("."), "")


def cut_value(call: DiTCall, value: Any, cut: Cut) -> Any:
    """This rank's part of ``value`` by ``cut`` (tensors of other dimensions, and ones with a single token along the
    cut's dimension, which broadcast over the stream, are left whole)."""
    if isinstance(value, (tuple, list)):
        return type(value)(cut_value(call, v, cut) for v in value)
    if not isinstance(value, Tensor) or (cut.ndim is not None and value.dim() != cut.ndim):
        return value
    if value.shape[cut.dim] == 1:  # one value for every token of the stream
        return value
    return call.cut(value, cut.stream, cut.dim)


def cut_key_mask(call: DiTCall, mask: Tensor, order: tuple[str, ...]) -> Tensor:
    """Record a key mask over ``order`` (its last dimension: the streams' whole lengths, in order) and return the
    rank's part of it, in the same order (padding masked). A mask object already cut in this forward (the one
    HunyuanVideo and QwenImage give every block; a block recomputed with its saved inputs) gets its part back at once;
    another is compared with the forward's mask on its device (:meth:`DiTCall.take_mask`), never read here.

    Raises:
        ValueError: a mask whose length is not the streams' (or that depends on the query).
    """
    done = call.cut_of(mask, order)
    if done is not None:
        return done
    known = {s: call.streams[s].length for s in order if s in call.streams}
    unknown = [s for s in order if s not in known]
    total = mask.shape[-1]
    if len(unknown) == 1:  # the one stream not cut yet takes the rest
        known[unknown[0]] = total - sum(known.values())
    if len(unknown) > 1 or sum(known.values()) != total or (mask.dim() > 2 and mask.shape[-2] != 1):
        raise ValueError(f"{call.model_name}: a key mask of shape {tuple(mask.shape)} over {' + '.join(order)} "
                         f"({', '.join(f'{s} {n}' for s, n in known.items())} tokens) is not one ds-usp can cut")
    kept = mask if mask.dtype == torch.bool else (mask > -1.0 if mask.is_floating_point() else mask != 0)
    kept = kept.reshape(kept.shape[0], -1, total).all(dim=1)  # (b, ..., S) -> (b, S)
    parts, at = [], 0
    for name in order:
        n = known[name]
        call.stream(name, n)
        call.take_mask(name, kept[:, at:at + n])
        parts.append(call.cut(mask[..., at:at + n], name, mask.dim() - 1, pad=0))
        at += n
    return call.hand_on(mask, order, torch.cat(parts, dim=-1))


class DiTForward:
    """The forward of a sharded diffusion transformer (what :func:`install` makes ``model.forward``): it starts the
    call's :class:`~ds_usp.integration.models.diffusion.state.DiTCall`, refuses what the plan refuses, checks at the
    first call that the SP group's ranks were given the same inputs, reads the plan's mask parameter to the host (the
    forward's one read of its key mask, before any block) and agrees its runs across the group (one small all-gather
    when they are new; the attentions' valid keys are then prepared and agreed before the blocks,
    :meth:`~ds_usp.integration.models.diffusion.state.DiTCall.agree_mask`), cuts the plan's root inputs and runs the
    model's own forward, whose output comes back whole (gathered before the final projection) once the checks its
    blocks made on the device are read (one read, :meth:`~ds_usp.integration.models.diffusion.state.DiTCall.finish`).

    Args:
        model: the model.
        original: its own forward.
        plan: its family's plan.
        dit: its context.
    """

    def __init__(self, model: nn.Module, original: Callable, plan: FamilyPlan, dit: DiTContext) -> None:
        self.name, self.original, self.plan, self.dit = type(model).__name__, original, plan, dit
        self.signature = inspect.signature(original)
        self.cuts = plan.inputs.get("", {})
        root = [plan.mask_root.parameter] if plan.mask_root is not None else []
        missing = [n for n in (*self.cuts, *plan.refused, *root) if n not in self.signature.parameters]
        if missing:
            raise ValueError(f"{self.name}.forward takes no {', '.join(missing)}: ds-usp's plan for the family no "
                             f"longer fits the installed diffusers (docs/models.md)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's call, on whole inputs (the same on every rank of the SP group); returns its whole output."""
        bound = self.signature.bind(*args, **kwargs)
        given = bound.arguments
        self._refuse(given)
        call = self.dit.begin()
        if not self.dit.inputs_checked:
            self._check_same_inputs(given)
        root = self.plan.mask_root
        if root is not None and isinstance(given.get(root.parameter), Tensor):
            call.expect_mask(root, given[root.parameter])
            call.agree_mask(SAME_INPUTS)  # and the valid keys of the orders whose streams are known now or later
        for name, cut in self.cuts.items():
            if given.get(name) is not None:
                given[name] = cut_value(call, given[name], cut)
        out = self.original(*bound.args, **bound.kwargs)
        if not call.gathered:
            raise RuntimeError(f"{self.name}: its {self.plan.gather} did not run in the forward, so its output was "
                               f"never gathered from the ranks' parts: ds-usp's plan for the family no longer fits it")
        call.finish()
        return out

    def _refuse(self, given: dict) -> None:
        for name, why in self.plan.refused.items():
            if given.get(name) is not None:
                raise ValueError(f"{self.name} is called with {name}: {why}")
        extra = given.get(self.plan.lora_kwargs) if self.plan.lora_kwargs else None
        if extra and set(extra) - {"scale"}:
            raise ValueError(f"{self.name} is called with {self.plan.lora_kwargs} "
                             f"{sorted(set(extra) - {'scale'})}: only a LoRA 'scale' is supported under sequence "
                             f"parallelism (IP-adapter embeddings and processor arguments are not)")

    def _check_same_inputs(self, given: dict) -> None:
        """Every rank of the SP group must give the same whole inputs (one small all-gather, at the first call)."""
        facts = {name: value if isinstance(value, Tensor) else repr(value) for name, value in given.items()
                 if isinstance(value, (Tensor, int, float, str, bool))}
        differ = disagreements(facts, self.dit.topo.sp_group, "the inputs of a sharded diffusion transformer")
        if differ:
            holders = "; ".join(f"{name}: ranks {' vs '.join(map(str, ranks.values()))}"
                                for name, ranks in differ.items())
            raise ValueError(f"{self.name} is called with different {', '.join(sorted(differ))} on the ranks of one "
                             f"sequence-parallel group ({holders}): {SAME_INPUTS}")
        self.dit.checked_inputs()


def _input_hook(dit: DiTContext, signature: inspect.Signature, cuts: dict[str, Cut],
                mask: Optional[tuple[str, tuple[str, ...]]], count: Optional[tuple[str, str]]) -> Callable:
    """A forward pre-hook cutting a module's inputs, its key mask and its prefix count (see :class:`FamilyPlan`)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        call = dit.call
        bound = signature.bind_partial(module, *args, **kwargs)
        given = bound.arguments
        for name, cut in cuts.items():
            if given.get(name) is not None:
                given[name] = cut_value(call, given[name], cut)
        if mask is not None and isinstance(given.get(mask[0]), Tensor):
            given[mask[0]] = cut_key_mask(call, given[mask[0]], mask[1])
        if count is not None and isinstance(given.get(count[0]), int):
            given[count[0]] = call.known(count[1]).prefix_count(given[count[0]])
        return bound.args[1:], bound.kwargs
    return hook


def _output_hook(dit: DiTContext, cuts: tuple[Optional[Cut], ...]) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        call = dit.call
        return type(output)(x if cut is None else cut_value(call, x, cut) for x, cut in zip(output, cuts))
    return hook


def _gather_hook(dit: DiTContext) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return dit.call.gather(output, IMAGE, 1)
    return hook


def route_attention(model: nn.Module, plan: FamilyPlan, dit: DiTContext) -> int:
    """Route every attention module the plan gives a role to the USP attention.

    Returns:
        How many modules were routed.

    Raises:
        ValueError: a module whose processor is not the family's (IP-adapter, fused projections, PAG...), or whose
            attention backend cannot take ds-usp's route.
    """
    routed = 0
    for pattern, role in plan.roles.items():
        for path, module in modules_at(model, pattern):
            _route(module, path, role, dit)
            routed += 1
    if not routed:
        raise ValueError(f"{type(model).__name__} has no attention module ds-usp's plan names; the plan no longer "
                         f"fits the installed diffusers")
    return routed


def _route(module: nn.Module, path: str, role: Role, dit: DiTContext) -> None:
    processor = getattr(module, "processor", None)
    found = type(processor).__name__
    if found != role.processor:
        raise ValueError(f"{dit.model_name}'s {path} uses the attention processor {found}, not the family's "
                         f"{role.processor}: ds-usp shards only the family's own attention (IP-adapter, fused "
                         f"projections, PAG and other custom processors are not supported under sequence "
                         f"parallelism; build or load the model again for the family's own)")
    route = AttentionRoute(dit, role.order, path)
    dit.attends(role.order)
    if role.usp_processor is not None:
        set_processor(module, USP_PROCESSORS[role.usp_processor](route))
        return
    problem = backend_takes_route(processor)
    if problem:
        raise ValueError(f"{dit.model_name}'s {path}: {problem}")
    give_route(module, route)


def install(model: nn.Module, plan: FamilyPlan, dit: DiTContext) -> None:
    """Register the plan's hooks on ``model`` and route its attention modules (the root forward is
    :class:`DiTForward`, made by the caller).

    Raises:
        ValueError: the model does not fit the plan (a module, parameter or processor it names), naming it.
        UpstreamChanged: a hooked module's forward no longer takes a parameter the plan names.
    """
    hooked: dict[str, dict] = {}
    for pattern, cuts in plan.inputs.items():
        if pattern:
            for path, module in modules_at(model, pattern):
                hooked.setdefault(path, {"module": module, "cuts": {}})["cuts"].update(cuts)
    for table, key in ((plan.key_masks, "mask"), (plan.prefix_counts, "count")):
        for pattern, entry in table.items():
            for path, module in modules_at(model, pattern):
                hooked.setdefault(path, {"module": module, "cuts": {}})[key] = entry
    for path, entry in hooked.items():
        module = entry["module"]
        required = [*entry["cuts"], *([entry["mask"][0]] if "mask" in entry else [])]
        signature = check_forward_parameters(module, required)
        count = entry.get("count")
        if count is not None and count[0] not in signature.parameters:
            count = None  # a block that does not take it (HunyuanVideo's plain blocks ignore the first-frame count)
        module.register_forward_pre_hook(_input_hook(dit, signature, entry["cuts"], entry.get("mask"), count),
                                         with_kwargs=True)
    for pattern, cuts in plan.outputs.items():
        for _, module in modules_at(model, pattern):
            module.register_forward_hook(_output_hook(dit, cuts))
    gathered = list(modules_at(model, plan.gather))
    gathered[0][1].register_forward_hook(_gather_hook(dit))
    route_attention(model, plan, dit)
