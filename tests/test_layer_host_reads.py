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
