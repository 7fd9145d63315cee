"""``python -m ds_usp.plan``: the layout, ZeRO stage and memory features for a model on a cluster.

    python -m ds_usp.plan --model meta-llama/Llama-3.1-8B --seq 131072 --nodes 2 --gpus-per-node 8 --gpu-mem 80
    python -m ds_usp.plan --model config.json --seq 65536 --gpus-per-node 8 --write ds.json
    python -m ds_usp.plan --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 --intermediate 14336 \\
        --seq 262144 --nodes 4
    python -m ds_usp.plan --model config.json --seq 65536 --lengths lengths.txt    # static vs dynamic SP
    python -m ds_usp.plan --model wan/transformer/config.json --frames 21 --height 90 --width 160   # a diffusers DiT

Every split of the ranks into ``(U, R, dp)``, ZeRO stage and memory-feature preset is priced by the one cost model
of :mod:`ds_usp.cost` (memory per rank by part, step time by part); the feasible plans are ranked by predicted
step time, the infeasible ones say why, and ``--write`` writes the DeepSpeed JSON of the first (the keys a user
writes: ``"sequence_parallel": "usp"`` and the ``"usp"`` block). The model's shape comes from its HF config: a
local folder or JSON file, a model id whose config is in the local HF cache (nothing is downloaded), or the sizes
given by hand; its parameters are counted on the meta device (no memory), MoE experts split into total and active,
Gated DeltaNet layers counted apart, and a family ds-usp cannot shard refused by name. Instant, no progress.

A diffusers transformer's config (``_class_name``: Wan, Flux, HunyuanVideo, LTX-Video, CogVideoX, SD3, QwenImage) is
priced per block with bidirectional attention; its tokens come from the latent grid the transformer is given
(``--frames --height --width``, e.g. 21 x 90 x 160 for a 720p 81-frame clip through Wan's VAE) over its patch size,
plus ``--text-tokens`` in the joint-attention families (:func:`ds_usp.integration.models.diffusion.shape.dit_tokens`).

``--lengths FILE`` (document lengths, one per line or a JSON list; or a histogram, lines ``length count`` or JSON
``{"lengths": [...], "counts": [...]}``) predicts, for the split of the fastest feasible plan with sequence parallelism, the tokens per second of static SP (every
row packed to ``--seq`` tokens on the whole SP group) and of dynamic SP (:func:`ds_usp.plan_step`: each row on the
smallest degree its longest document needs, ``--seq / sp`` tokens per rank), from the same cost model with each row's
attention priced by its documents (``sum n_i^2``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Sequence

from ds_usp.cost import (GIB, HEADROOM, FeatureModes, Hardware, ModelShape, StepMemory, StepSettings, StepTime,
                         activation_budget, attention_forward_flops, attention_memory, choose_features, features_of,
                         host_held, model_state_memory, offloaded_bytes, step_memory, step_time, tokens_per_rank)
from ds_usp.integration.data.dynamic import plan_step
from ds_usp.integration.models.diffusion.shape import dit_shape, dit_tokens, model_on_meta, read_diffusers_config
from ds_usp.integration.models.shape import model_shape, split_refusal
from ds_usp.splits import degree_split, divisors

# the memory-feature presets the planner tries: name -> (checkpointing, tiled feed-forward, chunked loss, offloaded
# layer inputs); "auto" is what ds-usp's "auto" keys choose (the fastest features that fit, priced per plan);
# "full-offload" is ALST's recipe (with --offload, the optimizer state goes to the host too)
PRESETS = {"auto": ("auto", "auto", "auto", "auto"), "off": ("", False, False, False),
           "selective": ("selective", True, True, False), "full": ("full", True, True, False),
           "full-offload": ("full", True, True, True)}


@dataclass(frozen=True)
class Candidate:
    """One priced plan."""

    settings: StepSettings
    preset: str
    memory: StepMemory
    time: StepTime
    problem: Optional[str] = None  # why it is infeasible (None: it fits)

    def row(self, seq: int) -> dict[str, Any]:
        """The plan as a flat dict (the table and ``--json``)."""
        s = self.settings
        return {"U": s.ulysses, "R": s.ring, "dp": s.dp, "zero": s.zero, "layout": "zigzag", "features": self.preset,
                "chosen": asdict(s.features) if s.features is not None else None,
                "offload": s.offload_optimizer, "mem_gib": self.memory.total / GIB,
                **{f"{k}_gib": v / GIB for k, v in asdict(self.memory).items()},
                "step_s": self.time.total, "compute_s": self.time.compute, "features_s": self.time.features,
                "all_to_all_s": self.time.all_to_all,
                "ring_s": self.time.ring, "ring_exposed_s": self.time.ring_exposed,
                "zero_s": self.time.zero, "tokens_per_s": seq * s.dp / self.time.total if self.time.total else None,
                "problem": self.problem}


# ------------------------------------------------------------------------------------------- model shape


def load_config(model: str) -> Any:
    """An HF config from a folder, a JSON file, or a model id in the local HF cache (never downloaded).

    Raises:
        ValueError: naming what could not be found.
    """
    from transformers import AutoConfig

    if os.path.isfile(model):
        with open(model) as f:
            raw = json.load(f)
        if "model_type" not in raw:
            raise ValueError(f"--model {model}: the JSON has no model_type, so it is no HF config")
        return AutoConfig.for_model(**raw)
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model!r}: no HF config there or in the local HF cache ({e}); give a folder, a "
                         f"config JSON, or the sizes (--hidden --layers --heads --kv-heads --vocab --intermediate)") \
            from None


def shape_by_hand(args: argparse.Namespace) -> ModelShape:
    """A Llama-shaped model from ``--hidden --layers --heads --kv-heads --vocab --intermediate``."""
    h, layers, heads, kv, vocab, inter = (args.hidden, args.layers, args.heads, args.kv_heads or args.heads, args.vocab,
                                          args.intermediate)
    d = h // heads
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h
    total = per_layer * layers + 2 * vocab * h + h
    return ModelShape(name="by hand", hidden=h, attention_layers=layers, heads=heads, kv_heads=kv, head_dim=d,
                      v_head_dim=d, vocab=vocab, mlp_width=inter, params=total, active_params=total - vocab * h)


# ---------------------------------------------------------------------------------------------- planning


def plans(shape: ModelShape, hw: Hardware, seq: int, micro_batch: int = 1, elem_bytes: int = 2,
          zero: Optional[int] = None, offload: bool = False, presets: Sequence[str] = tuple(PRESETS),
          ulysses: Optional[int] = None, ring: Optional[int] = None) -> list[Candidate]:
    """Every plan for the cluster, priced; feasible ones first by predicted step time, then the others.

    Args:
        shape: the model.
        hw: the cluster.
        seq: S.
        micro_batch: sequences per micro-batch (per replica).
        elem_bytes: the training dtype's bytes.
        zero: one ZeRO stage, or None for 1, 2 and 3.
        offload: also try the optimizer in host memory.
        presets: the memory-feature presets to try (:data:`PRESETS`).
        ulysses: only splits of this Ulysses degree (None: every one).
        ring: only splits of this ring degree (None: every one).

    Returns:
        The candidates.
    """
    out = []
    for sp in divisors(hw.world):
        for u in divisors(sp):
            r = sp // u
            if (ulysses and u != ulysses) or (ring and r != ring):
                continue
            refused = split_refusal(shape, u, r, seq)
            for stage in ([zero] if zero else [1, 2, 3]):
                for preset in presets:
                    ckpt, tiled, chunked, off_act = PRESETS[preset]
                    for off in ((False, True) if offload else (False,)):
                        if preset == "auto":
                            s = StepSettings(u, r, hw.world // sp, stage, offload_optimizer=off)
                            s = s if refused else auto_settings(shape, s, seq, hw, micro_batch, elem_bytes)
                        else:
                            s = StepSettings(u, r, hw.world // sp, stage, ckpt, tiled, chunked, off, off_act)
                        if refused:  # not priced: ds-usp would refuse it
                            out.append(Candidate(s, preset, StepMemory(0, 0, 0, 0, 0, 0, 0), StepTime(0, 0, 0, 0, 0),
                                                 refused))
                            continue
                        mem = step_memory(shape, s, seq, micro_batch, elem_bytes)
                        t = step_time(shape, s, seq, hw, micro_batch, elem_bytes)
                        problem = None
                        states = mem.params + mem.grads + mem.optimizer
                        tokens = tokens_per_rank(seq, micro_batch, s.sp)
                        host = offloaded_bytes(shape, tokens, features_of(shape, tokens, s), elem_bytes)
                        if mem.total - states > activation_budget(hw.gpu_mem_gib * GIB, states):
                            problem = f"needs {mem.total / GIB:.1f} GiB of {hw.gpu_mem_gib:g}"
                        elif host > hw.host_budget(host_held(shape, s, elem_bytes)):
                            problem = f"offloads {host / GIB:.1f} GiB to a host of {hw.host_mem_gib:g}"
                        out.append(Candidate(s, preset, mem, t, problem))
    # fastest per token first: a plan with replicas trains dp sequences per step
    return sorted(out, key=lambda c: (c.problem is not None, c.time.total / c.settings.dp, c.memory.total))


def auto_settings(shape: ModelShape, base: StepSettings, seq: int, hw: Hardware, micro_batch: int = 1,
                  elem_bytes: int = 2) -> StepSettings:
    """``base`` with the features ds-usp's ``"auto"`` keys choose on this hardware (the same rule as
    :meth:`ds_usp.integration.step.choices.MemoryContext.make_choices`: the fastest that fit :data:`HEADROOM` of the
    GPU's memory left beside the model's states)."""
    tokens = tokens_per_rank(seq, micro_batch, base.sp)
    padded = tokens_per_rank(seq, 1, base.sp) * base.sp
    budget = activation_budget(hw.gpu_mem_gib * GIB, sum(model_state_memory(shape, base, elem_bytes)))
    att = attention_memory(micro_batch, padded, shape.heads, shape.kv_heads, shape.head_dim, base.ulysses, base.ring,
                           elem_bytes)
    features, _, _ = choose_features(shape, tokens, FeatureModes(), budget, hw, elem_bytes, att.backward_peak,
                                     attention_forward_flops(shape, padded, micro_batch) / base.sp,
                                     host_budget=hw.host_budget(host_held(shape, base, elem_bytes)),
                                     ulysses=base.ulysses)
    return replace(base, features=features)


def largest_fitting_seq(shape: ModelShape, hw: Hardware, seq: int, **kw: Any) -> Optional[int]:
    """The longest sequence some plan fits, to 1% (bisection below ``seq``; None: not even 1024 tokens)."""
    def fits(s: int) -> bool:
        return any(c.problem is None for c in plans(shape, hw, s, **kw))

    lo, hi = 1024, seq
    if not fits(lo):
        return None
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def smallest_fitting_cluster(shape: ModelShape, hw: Hardware, seq: int, **kw: Any) -> Optional[int]:
    """The fewest nodes (doubling, up to 1024) some plan fits at ``seq`` (None: none)."""
    nodes = hw.nodes
    while nodes < 1024:
        nodes *= 2
        if any(c.problem is None for c in plans(shape, replace(hw, nodes=nodes), seq, **kw)):
            return nodes
    return None


def _count_degrees(degrees: Sequence[int]) -> str:
    """``[4, 4, 2, 1]`` as "2 at degree 4, 1 at degree 2, 1 at degree 1" (a histogram's plan has thousands)."""
    return ", ".join(f"{degrees.count(d)} at degree {d}" for d in sorted(set(degrees), reverse=True))


def read_lengths(path: str) -> list[int]:
    """Document lengths from a file: one per line or a JSON list; or a histogram (lines ``length count``, or JSON
    ``{"lengths": [...], "counts": [...]}``), expanded.

    Raises:
        ValueError: naming the file and what is wrong in it.
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--lengths {path}: {e.strerror}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        raw = None
    if isinstance(raw, dict):
        pairs = list(zip(raw.get("lengths", []), raw.get("counts", [])))
    elif isinstance(raw, list):
        pairs = [(x, 1) for x in raw]
    else:
        pairs = []
        for i, line in enumerate(text.splitlines(), 1):
            parts = line.split("#")[0].split()
            if not parts:
                continue
            if len(parts) > 2 or not all(p.isdigit() for p in parts):
                raise ValueError(f"--lengths {path}, line {i}: {line.strip()!r} is not 'length' or 'length count'")
            pairs.append((int(parts[0]), int(parts[1]) if len(parts) == 2 else 1))
    bad = [p for p in pairs if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in p)]
    if bad or not pairs:
        raise ValueError(f"--lengths {path}: " + (f"{bad[0]} is not a positive (length, count)" if bad else
                                                   "no lengths in it"))
    return [n for n, count in pairs for _ in range(count)]


def length_plans(shape: ModelShape, hw: Hardware, settings: StepSettings, lengths: Sequence[int], seq: int,
                 elem_bytes: int = 2) -> dict[str, Any]:
    """Predicted tokens/s of static and dynamic SP on these documents (one SP group's view; replicas scale both).

    Static: rows packed to ``seq`` tokens, each on the whole SP group. Dynamic: :func:`plan_step` with ``seq / sp``
    tokens per rank; a micro batch lasts as long as its slowest row, each degree split as ``ds_usp.initialize`` splits
    it (:func:`ds_usp.splits.degree_split`). Every
    row is priced by :func:`ds_usp.cost.step_time` with its own documents; ZeRO's collectives once per step.

    Returns:
        ``{"static": {...}, "dynamic": {...}, "speedup": dynamic / static}``, each with ``tokens_per_s``,
        ``seconds`` and the micro batches' degrees.
    """
    sp, cap = settings.sp, max(1, seq // settings.sp)
    out: dict[str, Any] = {}
    for name, degrees in (("static", [sp]), ("dynamic", None)):
        micro_batches = plan_step(lengths, sp, cap, degrees)
        seconds = 0.0
        for micro in micro_batches:
            u, r = degree_split(settings.ulysses, micro.degree, shape.kv_heads)
            s = replace(settings, ulysses=u, ring=r)
            times = [step_time(shape, s, sum(lengths[i] for i in row) or 1, hw, elem_bytes=elem_bytes,
                               doc_lens=[lengths[i] for i in row] or [1]) for row in micro.rows]
            seconds += max(t.compute + t.all_to_all + t.ring_exposed for t in times)
        seconds += step_time(shape, settings, cap * sp, hw, elem_bytes=elem_bytes).zero
        out[name] = {"tokens_per_s": sum(lengths) / seconds, "seconds": seconds,
                     "micro_batches": [m.degree for m in micro_batches]}
    out["speedup"] = out["dynamic"]["tokens_per_s"] / out["static"]["tokens_per_s"]
    return out


def ds_config(c: Candidate, micro_batch: int, bf16: bool = True, memory_gib: Optional[float] = None) -> dict[str, Any]:
    """The DeepSpeed JSON of a plan: DeepSpeed's keys and ds-usp's (what a user writes)."""
    s = c.settings
    zero: dict[str, Any] = {"stage": s.zero}
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ckpt, tiled, chunked, off_act = PRESETS[c.preset]
    usp = {"ulysses_degree": s.ulysses, "ring_degree": s.ring, "layout": "zigzag",
           "activation_checkpointing": ckpt or False, "tiled_mlp": tiled, "chunked_loss": chunked,
           "offload_activations": off_act}
    if memory_gib is not None:  # "auto" then chooses per step within this memory, as the planner did
        usp["memory_gib"] = memory_gib
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": bf16}, "zero_optimization": zero, "sequence_parallel": "usp",
            "sequence_parallel_size": s.sp, "usp": usp}


# ------------------------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_usp.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF config: a folder, a config JSON, or a model id in the local HF cache")
    for flag in ("--hidden", "--layers", "--heads", "--kv-heads", "--vocab", "--intermediate"):
        p.add_argument(flag, type=int, help="the model's size by hand (instead of --model)")
    p.add_argument("--seq", type=int, help="sequence length (a diffusers model's: from --frames --height --width)")
    for flag, what in (("--frames", "latent frames (1 for an image model)"), ("--height", "latent height"),
                       ("--width", "latent width")):
        p.add_argument(flag, type=int, help=f"a diffusers model's {what}, as its transformer's hidden_states has it")
    p.add_argument("--text-tokens", type=int, default=0,
                   help="text tokens of a joint-attention diffusers model (Flux, HunyuanVideo, SD3, ...)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--host-mem", type=float, default=2048.0,
                   help="GiB of host memory per node, shared by its GPUs (offloaded activations and optimizer state)")
    p.add_argument("--intra-bw", type=float, default=300.0, help="GB/s a rank sends inside a node")
    p.add_argument("--inter-bw", type=float, default=25.0, help="GB/s a rank sends across nodes")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU")
    p.add_argument("--efficiency", type=float, default=0.5, help="share of the peak the matmuls reach")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--zero", default="auto", choices=["1", "2", "3", "auto"])
    p.add_argument("--ulysses", type=int, help="price only this Ulysses degree (default: every one)")
    p.add_argument("--ring", type=int, help="price only this ring degree (default: every one)")
    p.add_argument("--offload", action="store_true", help="also try the optimizer state in host memory")
    p.add_argument("--presets", default=",".join(PRESETS),
                   help=f"memory-feature presets to try, comma-separated from {', '.join(PRESETS)}")
    p.add_argument("--fp32", action="store_true", help="train in fp32 (default bf16)")
    p.add_argument("--top", type=int, default=10, help="feasible plans to print")
    p.add_argument("--write", metavar="DS_JSON", help="write the first plan's DeepSpeed JSON here")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument("--lengths", metavar="FILE", help="document lengths (or a histogram): predict static vs dynamic SP")
    return p


class _Refused(Exception):
    """Input the planner cannot answer for: printed on stderr, exit code 1."""


def _checked_args(p: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> tuple[argparse.Namespace, Any]:
    """``(args, diffusers config or None)``: the arguments checked, ``--seq`` from the latent grid for a DiT.

    Raises:
        _Refused: the latent grid is not one the family takes.
        SystemExit: a bad argument (argparse's error).
    """
    args = p.parse_args(argv)
    dit = read_diffusers_config(args.model) if args.model else None
    if dit is not None:  # a diffusion transformer: its tokens from the latent grid
        if args.height is None or args.width is None:
            p.error("a diffusers model's tokens come from its latent grid: give --height and --width (and --frames "
                    "for a video model) as its transformer's hidden_states has them")
        try:
            tokens = dit_tokens(dit, args.frames or 1, args.height, args.width, args.text_tokens)
        except (ValueError, KeyError) as e:
            raise _Refused(e) from e
        args = argparse.Namespace(**{**vars(args), "seq": tokens})
    elif args.seq is None:
        p.error("--seq is required (or --model with a diffusers config and its latent grid)")
    for name, value in (("--seq", args.seq), ("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                        ("--micro-batch", args.micro_batch)):
        if value < 1:
            p.error(f"{name} ({value}) must be at least 1")
    world = args.nodes * args.gpus_per_node
    degree = (args.ulysses or 1) * (args.ring or 1)
    if any(v is not None and v < 1 for v in (args.ulysses, args.ring)) or world % degree:
        p.error(f"--ulysses ({args.ulysses}) x --ring ({args.ring}) must divide the {world} GPUs")
    if args.gpu_mem <= 0:
        p.error(f"--gpu-mem ({args.gpu_mem}) must be positive")
    presets = [x for x in args.presets.split(",") if x]
    if not presets or any(x not in PRESETS for x in presets):
        p.error(f"--presets {args.presets!r}: choose from {', '.join(PRESETS)}")
    return args, dit


def _shape_of_args(p: argparse.ArgumentParser, args: argparse.Namespace, dit: Any) -> ModelShape:
    """The model's shape: a diffusers config's, an HF config's, or the sizes given by hand.

    Raises:
        _Refused: the config cannot be read.
    """
    by_hand = [args.hidden, args.layers, args.heads, args.vocab, args.intermediate]
    try:
        if dit is not None:
            return dit_shape(model_on_meta(dit))
        if args.model:
            return model_shape(load_config(args.model))
    except ValueError as e:
        raise _Refused(e) from e
    if any(v is None for v in by_hand):
        p.error("give --model, or all of --hidden --layers --heads --vocab --intermediate")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    try:
        return shape_by_hand(args)
    except ValueError as e:
        raise _Refused(e) from e


def _dynamic_prediction(shape: ModelShape, hw: Hardware, args: argparse.Namespace, good: list[Candidate]) \
        -> Optional[dict]:
    """Static against dynamic SP for ``--lengths`` on the fastest plan with SP (None without ``--lengths``).

    Raises:
        _Refused: the lengths cannot be read, or a document is longer than ``--seq``.
    """
    try:
        lengths = read_lengths(args.lengths) if args.lengths else None
    except ValueError as e:
        raise _Refused(e) from e
    if lengths is None or not good:
        return None
    if max(lengths) > args.seq:
        raise _Refused(f"--lengths has a document of {max(lengths)} tokens, longer than --seq {args.seq}")
    chosen = next((i for i, c in enumerate(good) if c.settings.sp > 1), 0)  # SP is what the lengths change
    dynamic = length_plans(shape, hw, good[chosen].settings, lengths, args.seq, 4 if args.fp32 else 2)
    dynamic["plan"] = chosen + 1
    dynamic["lengths"] = lengths
    return dynamic


def _print_dynamic(args: argparse.Namespace, good: list[Candidate], dynamic: dict) -> None:
    lengths = dynamic["lengths"]
    s = good[dynamic["plan"] - 1].settings
    print(f"{len(lengths)} documents ({sum(lengths)} tokens, longest {max(lengths)}) on the SP group of the "
          f"fastest plan with one (#{dynamic['plan']}) "
          f"(U={s.ulysses} R={s.ring}): static SP {dynamic['static']['tokens_per_s']:.0f} tokens/s "
          f"({len(dynamic['static']['micro_batches'])} rows of {args.seq}), dynamic SP "
          f"{dynamic['dynamic']['tokens_per_s']:.0f} tokens/s (micro batches: "
          f"{_count_degrees(dynamic['dynamic']['micro_batches'])}): {dynamic['speedup']:.2f}x")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print (and optionally write) the plans; returns the exit code (1: nothing fits or bad input)."""
    p = _parser()
    try:
        args, dit = _checked_args(p, argv)
        shape = _shape_of_args(p, args, dit)
        hw = Hardware(args.nodes, args.gpus_per_node, args.gpu_mem, args.peak_tflops, args.intra_bw, args.inter_bw,
                      args.efficiency, host_mem_gib=args.host_mem)
        kw = dict(micro_batch=args.micro_batch, elem_bytes=4 if args.fp32 else 2,
                  zero=None if args.zero == "auto" else int(args.zero), offload=args.offload,
                  presets=[x for x in args.presets.split(",") if x], ulysses=args.ulysses, ring=args.ring)
        found = plans(shape, hw, args.seq, **kw)
        good = [c for c in found if c.problem is None]
        dynamic = _dynamic_prediction(shape, hw, args, good)
    except _Refused as e:
        print(f"ds_usp.plan: {e}", file=sys.stderr)
        return 1
    if args.json:
        rows = None if dynamic is None else {k: v for k, v in dynamic.items() if k != "lengths"}
        print(json.dumps({"model": asdict(shape), "seq": args.seq, "hardware": asdict(hw),
                          "plans": [c.row(args.seq) for c in found], "lengths": rows}, indent=1))
    else:
        _print(shape, hw, args, good[:args.top], [c for c in found if c.problem][:5], len(good), len(found))
        if dynamic is not None:
            _print_dynamic(args, good, dynamic)
    if not good:
        seq_ok = largest_fitting_seq(shape, hw, args.seq, **kw)
        nodes_ok = smallest_fitting_cluster(shape, hw, args.seq, **kw)
        print(f"ds_usp.plan: nothing fits {shape.name} at S={args.seq} on {hw.nodes} x {hw.gpus_per_node} GPUs of "
              f"{hw.gpu_mem_gib:g} GiB" + (f"; the longest S that fits here: {seq_ok}" if seq_ok else "")
              + (f"; the fewest nodes that fit S={args.seq}: {nodes_ok}" if nodes_ok else "")
              + ("" if args.offload else "; --offload may help"), file=sys.stderr)
        return 1
    if args.write:
        with open(args.write, "w") as f:
            json.dump(ds_config(good[0], args.micro_batch, bf16=not args.fp32, memory_gib=hw.gpu_mem_gib), f, indent=2)
        print(f"wrote {args.write}: launch it with deepspeed --num_nodes {hw.nodes} --num_gpus {hw.gpus_per_node} "
              f"your_program.py --deepspeed_config {args.write}")
    return 0


def _print(shape: ModelShape, hw: Hardware, args: argparse.Namespace, good: list[Candidate], bad: list[Candidate],
           n_good: int, n_all: int) -> None:
    print(f"{shape.name}: {shape.params / 1e9:.2f}B parameters ({shape.active_params / 1e9:.2f}B active), "
          f"{shape.attention_layers} attention + {shape.linear_layers} linear layers; S={args.seq}, "
          f"{hw.nodes} x {hw.gpus_per_node} GPUs, {hw.gpu_mem_gib:g} GiB each; {n_good} of {n_all} plans fit")
    head = (f"{'#':>2} {'U':>3} {'R':>3} {'dp':>3} {'ZeRO':>4} {'features':>9} {'offl':>4} | {'GiB':>6} = "
            f"{'param':>6} {'grad':>6} {'optim':>6} {'activ':>6} {'attn':>6} {'loss':>6} {'fixed':>5} | "
            f"{'step s':>8} = {'comp':>7} {'feat':>6} {'a2a':>6} {'ring':>6} {'zero':>6} | {'tok/s':>9}")
    print(head)
    print("-" * len(head))
    for i, c in enumerate(good, 1):
        s, m, t = c.settings, c.memory, c.time
        print(f"{i:>2} {s.ulysses:>3} {s.ring:>3} {s.dp:>3} {s.zero:>4} {c.preset:>9} {'yes' if s.offload_optimizer else '':>4}"
              f" | {m.total / GIB:>6.1f} = {m.params / GIB:>6.1f} {m.grads / GIB:>6.1f} {m.optimizer / GIB:>6.1f} "
              f"{m.activations / GIB:>6.1f} {m.attention / GIB:>6.1f} {m.loss / GIB:>6.1f} {m.fixed / GIB:>5.1f} | "
              f"{t.total:>8.2f} = {t.compute:>7.2f} {t.features:>6.2f} {t.all_to_all:>6.2f} {t.ring_exposed:>6.2f} "
              f"{t.zero:>6.2f} | "
              f"{args.seq * s.dp / t.total:>9.0f}")
    auto = [(i, c) for i, c in enumerate(good, 1) if c.settings.features is not None]
    for i, c in auto[:3]:
        print(f"#{i} auto: {c.settings.features.describe(shape.layers)}")
    if bad:
        print("not feasible (first few):")
        for c in bad:
            s = c.settings
            print(f"   U={s.ulysses} R={s.ring} dp={s.dp} ZeRO-{s.zero} {c.preset}: {c.problem}")
    print("(ring: the part not hidden behind the attention's compute; step time assumes the matmuls reach "
          f"{hw.efficiency:.0%} of {hw.peak_tflops:g} TFLOP/s)")


if __name__ == "__main__":
    raise SystemExit(main())

