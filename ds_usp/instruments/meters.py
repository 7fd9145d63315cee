"""A byte meter on ``torch.distributed`` and a live-bytes meter of a training step, for the tests and the benchmarks
(nothing of the library imports it).

:class:`CommCounter` counts the bytes this rank hands to ``torch.distributed``; :func:`measure_attention` runs
one USP attention layer under it. tests/test_comm_volume.py checks the closed forms of :mod:`ds_usp.cost`
against them, and benchmarks/comm_volume.py prints both. :func:`step_peak` measures a Llama training step's peak
in live bytes and :func:`predicted_peak` is the planner's figure for it (tests/test_plan.py,
benchmarks/plan_calibration.py); :func:`peak_growth` is any function's resident growth (tests/test_memory.py).
Both import it as ``ds_usp.instruments.meters``.
"""
from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ds_usp.cost import Volume


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter:
    """Count the bytes this rank sends through ``torch.distributed`` while inside :meth:`phase`.

    The functions are wrapped on the ``torch.distributed`` module object, where ds-usp looks them up
    (``dist.all_to_all_single``, ``dist.batch_isend_irecv``) at call time; ``isend``/``irecv``
    themselves are left alone because ``batch_isend_irecv`` recognises sends by identity with them.

    * ``all_to_all_single``: the input's chunks for the other ranks (equal splits: ``(W-1)/W`` of it).
    * ``batch_isend_irecv``: the tensors of its ``isend`` ops.
    * anything else (all_gather, all_reduce, broadcast, send, ...): the input's bytes times the
      number of other ranks, as ``other``.
    """

    _OTHER = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor",
              "all_to_all", "send", "gather", "scatter", "reduce", "all_gather_object", "broadcast_object_list")

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self._phase: Optional[str] = None

    def _add(self, kind: str, n: int) -> None:
        if self._phase is not None:
            phase = self.counts.setdefault(self._phase, {})
            phase[kind] = phase.get(kind, 0) + n

    def volume(self, phase: str) -> Volume:
        """What was counted in ``phase``.

        Args:
            phase: the name given to :meth:`phase`.

        Returns:
            The :class:`Volume`.
        """
        c = self.counts.get(phase, {})
        return Volume(c.get("all_to_all", 0), c.get("ring", 0), c.get("other", 0))

    @contextmanager
    def phase(self, phase: str) -> Iterator["CommCounter"]:
        """Count the sends made inside the block under ``phase`` (the wrappers are installed only meanwhile).

        Args:
            phase: a name, e.g. ``"fwd"``.

        Yields:
            The counter.
        """
        a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

        def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                              group: Any = None, async_op: bool = False) -> Any:
            world, me = dist.get_world_size(group), dist.get_rank(group)
            if input_split_sizes is None:
                sent = _nbytes(input) * (world - 1) // world
            else:
                row = _nbytes(input) // max(input.shape[0], 1)
                sent = sum(n for i, n in enumerate(input_split_sizes) if i != me) * row
            self._add("all_to_all", sent)
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def batch_isend_irecv(p2p_op_list: Any) -> Any:
            for op in p2p_op_list:
                if getattr(op.op, "__name__", "") == "isend":
                    self._add("ring", _nbytes(op.tensor))
            return batch(p2p_op_list)

        def other(name: str, fn: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                tensors = [x for x in args if isinstance(x, torch.Tensor)]
                peers = dist.get_world_size(kwargs.get("group")) - 1 if name != "send" else 1
                self._add("other", sum(_nbytes(x) for x in tensors[-1:]) * peers)
                return fn(*args, **kwargs)
            return wrapped

        replacements = {"all_to_all_single": all_to_all_single, "batch_isend_irecv": batch_isend_irecv}
        replacements.update({name: other(name, getattr(dist, name)) for name in self._OTHER if hasattr(dist, name)})
        saved = {name: getattr(dist, name) for name in replacements}
        for name, fn in replacements.items():
            setattr(dist, name, fn)
        self._phase = phase
        self.counts.setdefault(phase, {})
        try:
            yield self
        finally:
            self._phase = None
            for name, fn in saved.items():
                setattr(dist, name, fn)


def measure_attention(topo: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                      warmup: bool = True, **kwargs: Any) -> tuple[Volume, Volume, int]:
    """Run one :func:`ds_usp.usp_attention` forward and backward on these shards and meter it.

    Every rank of ``topo``'s SP group must call it with shards of the same shapes. With ``warmup``
    one unmetered call comes first, so that what is counted is a layer's steady state (the first call
    of a new input signature also checks, with a small all-gather, that all ranks agree on it).

    Args:
        topo: the :class:`ds_usp.USPTopology`.
        q: this rank's q shard ``(b, s_local, H, D)``; ``requires_grad`` is set here.
        k: this rank's k shard.
        v: this rank's v shard.
        dout: the output gradient to backpropagate.
        warmup: run one unmetered forward+backward first.
        **kwargs: passed to ``usp_attention`` (``causal``, ``layout``, ``seq_len``, ``native_op``...).

    Returns:
        ``(forward, backward, saved)``: the two :class:`Volume` of this rank and the bytes autograd
        saved for the backward in distinct storages other than the inputs and the output.
    """
    from ds_usp.attention import usp_attention

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if warmup:
        usp_attention(q, k, v, topo, **kwargs).backward(dout)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    counter = CommCounter()
    with counter.phase("fwd"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = usp_attention(q, k, v, topo, **kwargs)
    for x in (q, k, v, out):
        saved.pop(x.untyped_storage().data_ptr(), None)
    with counter.phase("bwd"):
        out.backward(dout)
    return counter.volume("fwd"), counter.volume("bwd"), sum(saved.values())


# ---------------------------------------------------------------------------- live bytes of a training step

M_MMAP_THRESHOLD = -3  # mallopt's parameter
STEP_HEADS, STEP_KV_HEADS = 8, 4
_WARM: list = []  # set once this process has run a step


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024


def peak_growth(fn: Callable[[], Any]) -> int:
    """Bytes the process's resident set grew to at its peak while ``fn`` ran (kernel high-water mark).

    Memory an earlier run freed stays in glibc's heap and would hide this run's growth, so it is given back to the
    kernel first (``malloc_trim``): the baseline is then what is alive.

    Args:
        fn: what to measure, called once without arguments.

    Returns:
        The growth in bytes (Linux with glibc: ``/proc/self`` and ``libc.so.6``).
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _kib("VmRSS:")
    fn()
    return _kib("VmHWM:") - base


def _llama_shape(layers: int, vocab: int, hidden: int, mlp: int) -> Any:
    from ds_usp.cost import ModelShape

    d = hidden // STEP_HEADS
    params = 2 * vocab * hidden + layers * (2 * hidden * hidden + 2 * hidden * STEP_KV_HEADS * d + 3 * hidden * mlp
                                            + 2 * hidden) + hidden
    return ModelShape("llama", hidden, layers, STEP_HEADS, STEP_KV_HEADS, d, d, vocab, mlp, params,
                      params - vocab * hidden)


FEATURE_FIELDS = ("loss_chunk", "loss_grad_in_forward", "mlp_tiles", "checkpoint", "checkpoint_layers", "offload")


def step_peak(seq: int, u: int, r: int, zero: int, keys: dict, layers: int, vocab: int, hidden: int,
              mlp: int) -> tuple[int, tuple]:
    """This rank's peak, in live bytes, of two training steps of an HF Llama (fp32, AdamW, 8 heads, 4 key/value
    heads) through ``ds_usp.initialize``, above the resident size before the model was built; and the features its
    ``usp`` memory ``keys`` chose (:class:`ds_usp.cost.Features`' fields, as a dict).

    Live bytes, as ``max_memory_allocated`` counts them on a GPU: glibc's mmap threshold is fixed at 64 KiB, so a
    freed tensor leaves the resident set at once (with glibc's default the heap keeps freed blocks resident, a
    slack that depends on the order of allocations); then ``VmHWM`` after ``5 > /proc/self/clear_refs``. The
    process's first call also runs its step once unmeasured: that step allocates what the process keeps.

    Args:
        seq: the global sequence length.
        u: the Ulysses degree.
        r: the ring degree (``u * r`` ranks: every rank of the process group calls it).
        zero: the ZeRO stage.
        keys: ``usp`` config keys of the memory features (``{}``: ``"auto"``); ``memory_over_mib`` sets
            ``usp.memory_gib`` to the ranks' largest resident set before the model is built plus that many MiB.
        layers: decoder layers.
        vocab: vocabulary size.
        hidden: hidden size.
        mlp: the MLP's intermediate size.

    Returns:
        ``(peak, plan)``: this rank's peak growth in bytes and the features the step ran with.
    """
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ds_usp

    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    if not _WARM:
        _WARM.append(True)
        step_peak(seq, u, r, zero, keys, layers, vocab, hidden, mlp)
    ds_usp.hf.register_usp_attention()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts at the resident size
    base = _kib("VmRSS:")
    keys = dict(keys)
    if "memory_over_mib" in keys:  # one config on every rank: the largest resident set
        rss = torch.tensor([float(base)], dtype=torch.float64)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        keys["memory_gib"] = (float(rss) + keys.pop("memory_over_mib") * 2 ** 20) / 2 ** 30
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=STEP_HEADS, num_key_value_heads=STEP_KV_HEADS,
                      max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "sequence_parallel": "usp",
        "sequence_parallel_size": u * r, "usp": {"ulysses_degree": u, "ring_degree": r, "native_op": False, **keys}})
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    shard = ds_usp.shard_batch({"input_ids": ids}, engine.usp.topo, layout=engine.usp.layout)
    for _ in range(2):
        dist.barrier()
        engine.backward(engine(**shard).loss)
        engine.step()
    choices = engine.usp.memory.choices
    plan = {name: getattr(choices, name) for name in FEATURE_FIELDS}  # the features the step ran with
    peak = _kib("VmHWM:") - base
    engine.destroy()
    return peak, plan


def predicted_peak(seq: int, u: int, r: int, zero: int, plan: Any, layers: int, vocab: int, hidden: int,
                   mlp: int, cal: Any = None) -> float:
    """``ds_usp.cost.step_memory`` of the step :func:`step_peak` ran with ``plan`` (fp32), with ``cal`` (default:
    the library's constants).

    Args:
        seq: the global sequence length.
        u: the Ulysses degree.
        r: the ring degree.
        zero: the ZeRO stage.
        plan: the features (a dict, as :func:`step_peak` returns them), or, as results written before the planner
            chose them, ``(checkpoint, tiled MLP, chunked loss, tile_mib)``.
        layers: decoder layers.
        vocab: vocabulary size.
        hidden: hidden size.
        mlp: the MLP's intermediate size.
        cal: a :class:`ds_usp.cost.Calibration` (default: the library's constants).

    Returns:
        The predicted peak in bytes.
    """
    from ds_usp.cost import Calibration, Features, StepSettings, step_memory

    if isinstance(plan, dict):
        settings = StepSettings(u, r, 1, zero, features=Features(**plan))
    else:
        checkpoint, tiled, chunked, tile_mib = plan
        settings = StepSettings(u, r, 1, zero, checkpoint, tiled, chunked, tile_mib=tile_mib or 128.0)
    return step_memory(_llama_shape(layers, vocab, hidden, mlp), settings, seq, 1, elem_bytes=4,
                       cal=cal or Calibration()).total
