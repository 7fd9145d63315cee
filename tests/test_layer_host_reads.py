"""No host read inside a decoder layer: the documents of a batch are decoded once per model call, not per layer.

``ds_usp.shard_batch`` gives every shard ``cu_seq_lens_q`` (packed rows and plain rows alike); the model's call decodes
it once, before its first layer, into one immutable value that every attention layer reads, and checks it across the
ranks there. Inside the decoder layers the host then reads no tensor value and makes no tensor of host data, in the
forward and in the recomputation of checkpointed layers alike (on a GPU each such read waits for the device).

On a 2-rank gloo world, a 2-layer tiny Llama (``attn_implementation="usp"``, HF gradient checkpointing) trains a few
steps on fresh shards (new ``cu_seq_lens`` tensors each step, packings that change from step to step, plain rows in
between); :class:`ds_usp.instruments.work_meter.LayerHostReads` counts, while a decoder layer's forward runs (in the
recomputation: while a module inside it runs, since transformers recomputes a layer's forward below its hooks),
``Tensor.tolist``, ``.item``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``.cpu``, ``.numpy`` and
``torch.tensor`` / ``torch.as_tensor`` calls. After the first step (which checks each layer's shapes across the ranks
once) the record is 0 per forward and 0 per recomputation, on a Ulysses and on a ring split.

The same holds in a hybrid model's layers (tiny Qwen3.5: Gated DeltaNet layers and a softmax attention layer; tiny
LFM2: short convolutions), where factories given no device (``torch.arange``, ``torch.zeros``...: host tensors on a
GPU, copied to it after) are counted too: the convolution channels, halo tables and documents of each position are
made once per shape and device, not per call; and the attention backend is looked up
(:func:`ds_usp.kernels.available_backends`) 0 times per step after the first (before: 5 per step for one attention
layer, forward, recomputation and backward; 9 host-made tensors per forward and per recomputation in Qwen3.5's
three Gated DeltaNet layers, 3 in LFM2's three convolutions).

In one process: a tensor is read once whoever asks (and not at all when ds-usp made it), again after an in-place
write, and the caches (tensors read, documents and signatures agreed across ranks) are bounded.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import get_topo

WORLD_TIMEOUT = 300
SEQ = 96
# per step: the documents of the packed row (None: a plain row); each step's packing differs from the one before
PACKINGS = ([30, 1, 40, 25], None, [50, 46], [7, 60, 29], None)


def _batch(step: int) -> dict:
    """One row of ``SEQ`` tokens: packed as ``DataCollatorWithFlattening`` does (positions restart at 0) or plain."""
    from test_training import VOCAB

    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    docs = PACKINGS[step]
    if docs is None:
        return {"input_ids": ids}
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)}


def count_layer_host_reads(u: int, r: int, layout: str) -> list[dict]:
    """On every rank: the steps of :data:`PACKINGS` with a fresh shard each, the host reads inside the decoder layers
    counted per step (:meth:`ds_usp.instruments.work_meter.LayerHostReads.counts`, with the call sites)."""
    import ds_usp
    from ds_usp.instruments.work_meter import LayerHostReads
    from ds_usp.integration.models.attention import USPContext, attach
    from test_training import _llama

    ds_usp.hf.register_usp_attention()
    topo = get_topo(u, r)
    model = _llama("usp")
    attach(model, USPContext(topo=topo, layout=layout))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    steps = []
    for step in range(len(PACKINGS)):
        shard = ds_usp.shard_batch(_batch(step), topo, layout=layout)
        inputs = {k: v for k, v in shard.items() if k != "shift_labels"}
        with LayerHostReads(model.model.layers) as reads:
            logits = model(**inputs, use_cache=False).logits
            loss = ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo)
            loss.backward()
        steps.append({**reads.counts(), "sites": reads.sites(), "loss": float(loss.detach())})
        model.zero_grad()
    return steps


def test_no_host_read_inside_decoder_layers_after_the_first_step(world2):
    found = []  # every step after the first with a host read or a host-made tensor inside the layers
    for u, r, layout in ((2, 1, "zigzag"), (1, 2, "contiguous")):
        per_rank = world2.run(count_layer_host_reads, u, r, layout)
        for rank, steps in enumerate(per_rank):
            for step, counts in enumerate(steps):
                calls = counts["fwd"]["module_calls"]  # every layer recomputed: each of its modules called again
                assert calls > 0 and counts["recompute"]["module_calls"] == calls, counts
                got = {phase: (counts[phase]["reads"], counts[phase]["made"]) for phase in ("fwd", "recompute")}
                if step > 0 and got != {"fwd": (0, 0), "recompute": (0, 0)}:  # the first checks shapes across ranks
                    row = "plain" if PACKINGS[step] is None else "packed"
                    found.append(f"(U, R) = {(u, r)}, rank {rank}, step {step} ({row} row): (host reads, host-made "
                                 f"tensors) {got}:\n    " + "\n    ".join(counts["sites"]))
        # the ranks agree on each step's loss (the SP loss of the same sequence)
        assert [s["loss"] for s in per_rank[0]] == [s["loss"] for s in per_rank[1]]
    assert not found, "host reads inside the decoder layers:\n  " + "\n  ".join(found)


class _Reads(torch.overrides.TorchFunctionMode):
    """Counts ``Tensor.tolist`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))


def test_documents_are_read_once_per_tensor_and_the_caches_are_bounded():
    from ds_usp.attention.checks import Recent
    from ds_usp.attention.documents import Documents
    from ds_usp.integration.data import batch

    cu = torch.tensor([0, 5, 12, 20, 24], dtype=torch.int32)  # 2 rows of 12: [5, 7] and [8, 4]
    with _Reads() as reads:
        first = batch.documents_of(cu, 2)
        assert batch.documents_of(cu, 2) is first and batch.host_bounds(cu) == (0, 5, 12, 20, 24)
    assert reads.count == 1  # one read of the tensor, whoever asks
    assert first == Documents(2, 12, ((5, 7), (8, 4))) and hash(first) == hash(Documents(2, 12, ((5, 7), (8, 4))))
    assert first.starts == ((0, 5), (0, 8)) and first.tensor.tolist() == [[5, 7], [8, 4]]
    cu[1] = 6  # an in-place write: read again
    assert batch.documents_of(cu, 2).lens == ((6, 6), (8, 4))
    assert batch.documents_of(cu, 1).lens == ((6, 6, 8, 4),)  # 1 row of 24
    with _Reads() as reads:  # what ds-usp makes is known without a read; one document per row: no lengths
        made = batch.cu_seq_lens(None, 2, 9, "cpu")
        assert batch.documents_of(made, 2) == Documents(2, 9) and batch.packed_documents(made, 2) == (9, None)
    assert reads.count == 0
    with pytest.raises(ValueError, match=r"cu_seq_lens \(\[0, 5, 11\]\.\.\.\) does not describe 2 rows"):
        batch.documents_of(torch.tensor([0, 5, 11]), 2)
    for _ in range(3 * batch._READS_SIZE):
        batch.host_bounds(torch.tensor([0, 4]))
    assert len(batch._READS) <= batch._READS_SIZE
    recent = Recent(3)
    for key in range(5):
        recent.add(key)
    assert len(recent) == 3 and not recent.seen(1) and recent.seen(2)
    recent.add(5)  # 2 was seen last: 3 goes
    assert recent.seen(2) and not recent.seen(3)


# ------------------------------------------------------------------ hybrid models: linear attention, convolutions

HYBRID_VOCAB = 128


def _hybrid_batch(step: int) -> dict:
    """As :func:`_batch`, in the tiny hybrid models' vocabulary."""
    batch = _batch(step)
    return {**batch, "input_ids": batch["input_ids"] % (HYBRID_VOCAB - 3) + 3}


def count_hybrid_host_work(family: str, u: int, r: int, layout: str) -> list[dict]:
    """On every rank: :func:`count_layer_host_reads` for a tiny hybrid model of ``test_linear`` (Qwen3.5's Gated
    DeltaNet layers beside softmax attention, or LFM2's short convolutions), and per step the backend lookups
    (:func:`ds_usp.kernels.available_backends` calls: every backend asked whether it can run) while it trains."""
    from test_linear import _config
    from transformers import AutoModelForCausalLM

    import ds_usp
    from ds_usp import kernels
    from ds_usp.instruments.work_meter import LayerHostReads
    from ds_usp.integration.models.attention import USPContext, attach
    from ds_usp.integration.models.hybrid import wrap_linear_layers

    ds_usp.hf.register_usp_attention()
    topo = get_topo(u, r)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="usp", dtype=torch.float32)
    attach(model, USPContext(topo=topo, layout=layout, native_op=False))
    assert wrap_linear_layers(model) > 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    lookups = [0]
    asked = kernels.available_backends

    def counted(device):
        lookups[0] += 1
        return asked(device)

    kernels.available_backends = counted
    steps = []
    try:
        for step in range(len(PACKINGS)):
            shard = ds_usp.shard_batch(_hybrid_batch(step), topo, layout=layout)
            inputs = {k: v for k, v in shard.items() if k != "shift_labels"}
            lookups[0] = 0
            with LayerHostReads(model.model.layers) as reads:
                logits = model(**inputs, use_cache=False).logits
                loss = ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo)
                loss.backward()
            steps.append({**reads.counts(), "sites": reads.sites(), "lookups": lookups[0],
                          "loss": float(loss.detach())})
            model.zero_grad()
    finally:
        kernels.available_backends = asked
    return steps


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_no_host_made_tensor_nor_backend_lookup_in_hybrid_layers_after_the_first_step(world2, family):
    """Qwen3.5's Gated DeltaNet layers (their channels of the convolution filter), LFM2's short convolutions (the
    halo's index tables, the documents of each position) and the softmax attention layers beside them (the
    backend): nothing is made of host data nor looked up per layer call once the first step has run."""
    found = []
    for u, r, layout in ((2, 1, "zigzag"), (1, 2, "zigzag")):
        per_rank = world2.run(count_hybrid_host_work, family, u, r, layout)
        for rank, steps in enumerate(per_rank):
            for counts in steps:  # every layer recomputed: each of its modules called again (else nothing is checked)
                calls = counts["fwd"]["module_calls"]
                assert calls > 0 and counts["recompute"]["module_calls"] == calls, counts
            for step, counts in enumerate(steps[1:], 1):
                got = {phase: (counts[phase]["reads"], counts[phase]["made"]) for phase in ("fwd", "recompute")}
                if got != {"fwd": (0, 0), "recompute": (0, 0)} or counts["lookups"]:
                    found.append(f"(U, R) = {(u, r)}, rank {rank}, step {step}: (host reads, host-made tensors) "
                                 f"{got}, backend lookups {counts['lookups']}:\n    " + "\n    ".join(counts["sites"]))
        assert [s["loss"] for s in per_rank[0]] == [s["loss"] for s in per_rank[1]]
    assert not found, f"{family}: host work inside the layers:\n  " + "\n  ".join(found)


def test_layer_tables_and_the_backend_are_kept_per_shape_and_device():
    """What the meter cannot see on CPU (a ``.to(device)`` of a host tensor is no copy there): the linear layers'
    channel and halo tables, the documents of each position, Llama 4's NoPE query factors and the backend are made
    once per key and handed out again (the same objects), from bounded caches."""
    from ds_usp.integration.models.attention import _temperature_ratio
    from ds_usp.kernels import resolve_backend
    from ds_usp.linear import conv, sp

    cpu = torch.device("cpu")
    cached = ((sp._channels, (2, 16, 4, 16, 1, 2, cpu)),
              (_temperature_ratio, (8.0, 0.1, 64, 2, 2, 1, "zigzag", None, cpu, torch.float32)),  # Llama 4's NoPE
              (conv._device_halo_rows, (96, 2, 2, "zigzag", None, 4, 1, cpu)),
              (conv._document_ids, (((0, 30, 31, 71),), 96, 96, cpu)),
              (resolve_backend, ("auto", cpu, torch.float32)))
    for fn, args in cached:
        assert fn(*args) is fn(*args) and fn.cache_info().maxsize == 64, fn
    assert conv._document_ids(((0, 30),), 40, 48, cpu).tolist() == [[0] * 30 + [1] * 10 + [2] * 8]
    assert resolve_backend("auto", cpu, torch.float32).name == "torch"


@torch.library.custom_op("ds_usp_tests::read_in_a_custom_op", mutates_args=())
def _read_in_a_custom_op(x: torch.Tensor) -> torch.Tensor:
    """A custom operator whose body reads its input on the host (as ds-usp's attention ops run their bodies)."""
    x.tolist()
    return x.clone()


@_read_in_a_custom_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _EveryKind(torch.nn.Module):
    """One call of each host read and host-made tensor the meter knows, a line each (their sites are the lines)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        x.tolist()
        x[0].item()
        bool(x[0] > 0)
        torch.equal(x, x)
        x.to("cpu")
        x.nonzero()
        x[x > 0]
        torch.tensor([1, 2])
        torch.from_numpy(np.ones(2))
        torch.arange(3)
        int(x[0])
        float(x[0])
        x.cpu()
        x.numpy()
        torch.as_tensor([1.0])
        _read_in_a_custom_op(x)
        x.to(x.device)  # not a read: on a GPU, the device
        torch.arange(3, device=x.device)  # not host-made: given a device
        return x * 2


def test_the_meters_count_every_kind_of_host_read_and_host_made_tensor_at_its_site():
    """Both meters (the layer meter and the step meter) see each kind the issue names at its own line, and nothing
    else: ``.to(x.device)`` and a factory given a device are neither."""
    import inspect

    from ds_usp.instruments.work_meter import LayerHostReads, StepMeter

    layer = _EveryKind()
    source, start = inspect.getsourcelines(_EveryKind.forward)
    first = start + next(i for i, line in enumerate(source) if "x.tolist()" in line)
    with LayerHostReads([layer]) as reads:
        layer(torch.ones(3))
    inside = [s for s in reads.sites() if s.endswith(" _read_in_a_custom_op")]  # the op's body: its own site
    assert [s.split(" ")[1:4] for s in inside] == [["reads", ".tolist", "1x"]], reads.sites()
    lines = {int(s.split(" at ")[1].split(":")[1].split(" ")[0]) - first: s.split(" ")[1:3] for s in reads.sites()
             if s not in inside}
    assert lines == {0: ["reads", ".tolist"], 1: ["reads", ".item"], 2: ["reads", ".__bool__"],
                     3: ["reads", ".equal"], 4: ["reads", ".to('cpu')"], 5: ["reads", ".nonzero"],
                     6: ["reads", ".__getitem__"], 7: ["made", ".tensor"], 8: ["made", ".from_numpy"],
                     9: ["made", ".arange"], 10: ["reads", ".__int__"], 11: ["reads", ".__float__"],
                     12: ["reads", ".cpu"], 13: ["reads", ".numpy"], 14: ["made", ".as_tensor"]}, reads.sites()
    assert reads.counts()["fwd"] == {"reads": 12, "made": 4, "module_calls": 0}
    assert torch.from_numpy.__module__ != __name__ and torch.from_numpy.__name__ == "from_numpy"  # unwrapped after
    with StepMeter() as meter:
        layer(torch.ones(3))
    body = [site.site for (_, site) in meter.syncs if site.site.endswith(" _read_in_a_custom_op")]
    synced = sorted(int(site.site.split(":")[1].split(" ")[0]) - first for (_, site) in meter.syncs
                    if site.site not in body)
    made = sorted(int(site.site.split(":")[1].split(" ")[0]) - first for (_, site) in meter.host_made)
    assert len(body) == 1 and synced == [0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13] and made == [7, 8, 14], \
        meter.summary()
    assert meter.total.host_made == 3  # arange given no device is a host tensor, not made of host data


# ------------------------------------------------------------ every input kind, through ds_usp.initialize's engine
# Each kind: (the model, its batch of a step, its decoder layers). Full checkpointing: every layer is recomputed.

KIND_STEPS = 3


def _window_llm():
    """Mistral with a 16-token sliding window, shorter than a document and than a rank's piece."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from test_training import VOCAB

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="usp", dtype=torch.float32)


def _qwen3_next():
    """Qwen3-Next's shape: Gated DeltaNet layers and a gated softmax attention layer, a sparse MoE in every layer
    (transformers' grouped experts: its eager loop over the experts reads the host in transformers' own code)."""
    from test_linear import _config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config("qwen3_next"), attn_implementation="usp", dtype=torch.float32,
                                            experts_implementation="grouped_mm")


def _vlm():
    from test_vlm import _gemma3

    return _gemma3("usp")


def _text_batch(step: int) -> dict:
    batch = _hybrid_batch(step)
    return {**batch, "labels": batch["input_ids"]}


def _vlm_batch(step: int) -> dict:
    """Gemma 3's batch with its image blocks moved by ``step`` tokens: spans that change every step (the last 7 tokens
    are text, so no block wraps around)."""
    from test_vlm import _gemma3_batch

    batch = _gemma3_batch(step)
    return {k: v.roll(step, dims=-1) if k != "pixel_values" else v for k, v in batch.items()}


KINDS = {"window": (_window_llm, _text_batch, lambda m: m.model.layers),
         "qwen3_next": (_qwen3_next, _text_batch, lambda m: m.model.layers),
         "vlm": (_vlm, _vlm_batch, lambda m: m.model.language_model.layers)}


def _given(shard: dict, given: str) -> dict:
    """The shard as a caller gives it: ``shard`` (ds-usp's own), ``position_ids`` (the README loop: positions that
    restart per document, no ``cu_seq_lens``) or ``cu_seq_lens`` (the caller's own tensors, not ds-usp's)."""
    lens = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if given == "position_ids":
        return {k: v for k, v in shard.items() if k not in lens}
    if given == "cu_seq_lens":
        return {**shard, **{k: shard[k].clone() for k in lens[:2]}}
    return shard


def count_host_work_of_kind(kind: str, given: str, u: int, r: int) -> list[dict]:
    """On every rank: ``kind``'s model (``"llama"`` or one of :data:`KINDS`) trained :data:`KIND_STEPS` steps
    through ``ds_usp.initialize``'s engine with full checkpointing, its shards given as ``given``; per step the host
    work inside its decoder layers (:class:`ds_usp.instruments.work_meter.LayerHostReads`)."""
    import ds_usp
    from ds_usp.instruments.work_meter import LayerHostReads
    from test_training import _llama

    build, batch, layers = KINDS.get(kind, (lambda: _llama("usp"), _text_batch, lambda m: m.model.layers))
    ds_usp.hf.register_usp_attention()
    model = build()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,
                                                                                         "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "sequence_parallel": "usp", "sequence_parallel_size": u * r,
              "usp": {"ulysses_degree": u, "ring_degree": r, "activation_checkpointing": "full"}}
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
    steps = []
    for step in range(KIND_STEPS):
        shard = _given(ds_usp.shard_batch(batch(step), engine.usp.topo), given)
        with LayerHostReads(layers(engine.module)) as reads:
            loss = engine(**shard).loss
            engine.backward(loss)
        engine.step()
        steps.append({**reads.counts(), "sites": reads.sites(), "loss": float(loss.detach())})
    return steps


@pytest.mark.parametrize("kind, given, u, r", [("llama", "position_ids", 1, 2), ("llama", "cu_seq_lens", 2, 1),
                                               ("window", "shard", 1, 2), ("vlm", "shard", 2, 1),
                                               ("qwen3_next", "shard", 1, 2)])
def test_no_host_work_inside_the_layers_for_every_input_kind(world2, kind, given, u, r):
    """Packed rows given as ``position_ids`` resets and as the caller's ``cu_seq_lens``, a sliding window, a VLM's
    image spans (Gemma 3: bidirectional image blocks in sliding-window layers) and Qwen3-Next's hybrid layers: after
    the first step, 0 host reads and 0 host-made tensors inside the decoder layers, in the forward and in the
    recomputation, through the engine."""
    found = []
    per_rank = world2.run(count_host_work_of_kind, kind, given, u, r)
    for rank, steps in enumerate(per_rank):
        for step, counts in enumerate(steps):
            calls = counts["fwd"]["module_calls"]
            assert calls > 0 and counts["recompute"]["module_calls"] == calls, counts  # every layer recomputed
            got = {phase: (counts[phase]["reads"], counts[phase]["made"]) for phase in ("fwd", "recompute")}
            if step > 0 and got != {"fwd": (0, 0), "recompute": (0, 0)}:
                found.append(f"rank {rank}, step {step}: (host reads, host-made tensors) {got}:\n    "
                             + "\n    ".join(counts["sites"]))
    assert [s["loss"] for s in per_rank[0]] == [s["loss"] for s in per_rank[1]]
    assert not found, f"{kind} given as {given}: host work inside the layers:\n  " + "\n  ".join(found)
