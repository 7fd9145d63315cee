"""Dynamic sequence parallelism (issue 38): each micro batch's rows on the SP degree they need, losses exact.

``usp.dynamic_sp`` builds the groups of every smaller degree at ``ds_usp.initialize``
(``engine.usp.topo.degrees``). A step's rows are spread over the SP group's 4 ranks in mixed ways: a long row on a
2-rank sub-group beside two short rows on one rank each, one long packed row on all 4, four rows on one rank each.
Every rank shards its own rows with ``ds_usp.shard_batch(rows, engine.usp.topo.degrees[d])`` and calls
``engine(**shard)``; the loss is the token-weighted mean over every row of the step, as one process computes it on the
same rows as one right-padded batch. 3 AdamW steps at ZeRO-2 (2x2: degree 2 is Ulysses 2) and ZeRO-3 (1x4: degree 2
is a ring of 2): every step's loss within 1e-5 relative, every parameter after the last step within 1e-5.
"""
from __future__ import annotations

import pytest
import torch

SGD_LR = 0.1  # the hybrid family's optimizer: an update is its gradient, free of Adam's sign amplification
LR, SEQS = 1e-3, {"A": 37, "B": 9, "C": 14, "D": 61, "E": 11, "F": 23, "G": 5, "H": 17}
# per step: what each of the 4 ranks runs, as (degree, rows); ranks of one sub-group list the same rows
STEPS = [
    [(2, "A"), (2, "A"), (1, "B"), (1, "C")],
    [(4, "D"), (4, "D"), (4, "D"), (4, "D")],
    [(1, "E"), (1, "F"), (1, "G"), (1, "H")],
]


def _model(attn: str):
    from test_vlm import _llama_text  # the same tiny Llama

    return _llama_text(attn)


def _row(name: str) -> dict:
    """One full row; D is two packed documents (positions restarting)."""
    n = SEQS[name]
    g = torch.Generator().manual_seed(ord(name))
    ids = torch.randint(3, 120, (1, n), generator=g)
    labels = ids.clone()
    labels[:, : n // 4] = -100  # a prompt
    positions = torch.arange(n)[None] if name != "D" else torch.cat([torch.arange(25), torch.arange(n - 25)])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _padded(names: list[str]) -> dict:
    """The step's distinct rows as one right-padded batch (the one-process reference); D's documents as two rows."""
    rows = []
    for name in dict.fromkeys(names):
        row = _row(name)
        if name == "D":  # a packed row is its documents
            rows += [{k: v[:, :25] for k, v in row.items()}, {k: v[:, 25:] for k, v in row.items()}]
        else:
            rows.append(row)
    seq = max(r["input_ids"].shape[1] for r in rows)
    pad = lambda x, v: torch.cat([x, torch.full((1, seq - x.shape[1]), v)], dim=1)  # noqa: E731
    return {"input_ids": torch.cat([pad(r["input_ids"], 0) for r in rows]),
            "labels": torch.cat([pad(r["labels"], -100) for r in rows]),
            "attention_mask": torch.cat([pad(torch.ones_like(r["input_ids"]), 0) for r in rows])}


def _reference() -> tuple[list[float], dict]:
    model = _model("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for plan in STEPS:
        loss = model(**_padded([rows for _, rows in plan])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_dynamic(stage: int, u: int, r: int) -> str:
    import deepspeed
    import torch.distributed as dist

    import ds_usp

    want_losses, want_params = _reference()
    ds_usp.hf.register_usp_attention()
    model = _model("usp")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "sequence_parallel": "usp", "sequence_parallel_size": 4,
              "usp": {"ulysses_degree": u, "ring_degree": r, "dynamic_sp": True}}
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
    topo = engine.usp.topo
    assert sorted(topo.degrees) == [1, 2, 4]
    assert topo.degrees[2].ulysses_degree == (2 if u == 2 else 1)
    me = dist.get_rank()
    for step, plan in enumerate(STEPS):
        degree, name = plan[me]
        shard = ds_usp.shard_batch(_row(name), topo.degrees[degree])
        assert ("sp_degree" in shard) == (degree != 4)
        loss = engine(**shard).loss
        engine.backward(loss)
        engine.step()
        assert abs(float(loss) - want_losses[step]) <= 1e-5 * abs(want_losses[step]), \
            f"step {step + 1}: loss {float(loss)} vs one process {want_losses[step]}"
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())) if stage == 3 else _null():
        for name, want in want_params.items():
            torch.testing.assert_close(params[name].detach(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return "ok"


def _null():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("stage,u,r", [(2, 2, 2), (3, 1, 4)], ids=["zero2-2x2", "zero3-1x4"])
def test_dynamic_sp_equals_one_process(world4, stage, u, r):
    assert world4.run(train_dynamic, stage, u, r) == ["ok"] * 4


def refused_degree() -> str:
    import ds_usp

    ds_usp.hf.register_usp_attention()
    model = _model("usp")
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "zero_allow_untested_optimizer": True, "sequence_parallel": "usp", "sequence_parallel_size": 4}
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
    shard = ds_usp.shard_batch(_row("A"), engine.usp.topo)
    try:
        engine(**shard, sp_degree=2)
    except ValueError as e:
        return str(e)
    return "not refused"


def test_a_degree_not_built_is_refused_by_name(world4):
    for message in world4.run(refused_degree):
        assert "runs at sequence-parallel degree 2, but ds_usp.initialize built [4] (set usp.dynamic_sp" in message


# ---- the step planner and the step helper -------------------------------------------------------------------------

LENGTHS = [90, 7, 33, 12, 5, 48, 3, 20, 61, 9, 1, 26]


def test_plan_puts_every_document_once_on_the_degree_it_needs():
    from ds_usp.integration.data.dynamic import plan_step

    for lengths, sp, cap in ((LENGTHS, 4, 24), ([5] * 9, 4, 24), ([96, 95], 4, 24), (LENGTHS, 8, 16), ([3], 1, 8)):
        plan = plan_step(lengths, sp, cap)
        seen = sorted(i for micro in plan for row in micro.rows for i in row)
        assert seen == list(range(len(lengths))), (lengths, plan)
        for micro in plan:
            assert sp % micro.degree == 0 and len(micro.rows) == sp // micro.degree
            for row in micro.rows:
                assert sum(lengths[i] for i in row) <= micro.degree * cap
                if row:  # the row's degree is the smallest that holds its longest document, or higher only
                    # to spread a micro batch of fewer rows over ranks that would sit idle (no higher degree gives
                    # each row its own sub-group)
                    longest = max(lengths[i] for i in row)
                    need = min(d for d in range(1, sp + 1) if sp % d == 0 and longest <= d * cap)
                    filled = sum(1 for r in micro.rows if r)
                    assert micro.degree == need or (micro.degree > need and not any(
                        sp % d == 0 and d > micro.degree and sp // d >= filled for d in range(1, sp + 1)))
    plan = plan_step(LENGTHS, 4, 24)
    # 90 and 61 on all 4, 48 and 33 on two pairs, the six short rows on two pairs rather than two ranks alone
    assert [m.degree for m in plan] == [4, 4, 2, 2], plan
    assert [m.degree for m in plan_step(LENGTHS + [14, 15], 4, 24)] == [4, 4, 2, 1]  # 3 short rows: one each
    with pytest.raises(ValueError, match=r"document 0 has 97 tokens, more than the SP group holds \(4 ranks x 24"):
        plan_step([97], 4, 24)


# Qwen3-Next's two more documents leave the last micro batch (degree 1) with three rows for four ranks: one rank
# holds a padding token only, which the router loss must not count
FAMILY_LENGTHS = {"llama": LENGTHS, "qwen3_next": LENGTHS + [14, 15]}


def _documents(step: int, lengths: list[int] = LENGTHS) -> list[dict]:
    g = torch.Generator().manual_seed(50 + step)
    docs = []
    for n in lengths[step:] + lengths[:step]:
        ids = torch.randint(3, 120, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100
        docs.append({"input_ids": ids, "labels": labels})
    return docs


def _padded_documents(docs: list[dict]) -> dict:
    seq = max(len(d["input_ids"]) for d in docs)
    pad = lambda x, v: torch.cat([x, torch.full((seq - len(x),), v)])  # noqa: E731
    return {"input_ids": torch.stack([pad(d["input_ids"], 0) for d in docs]),
            "labels": torch.stack([pad(d["labels"], -100) for d in docs]),
            "attention_mask": torch.stack([pad(torch.ones_like(d["input_ids"]), 0) for d in docs])}


def _family_model(family: str, attn: str):
    """The tiny model of ``family``: "llama", or "qwen3_next" (Gated DeltaNet layers beside attention, MoE layers with
    their router loss on: the linear-attention state passing and the router loss under sub-degrees)."""
    if family == "llama":
        return _model(attn)
    from test_linear import _config
    from transformers import AutoModelForCausalLM

    config = _config(family)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.1
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def _reference_steps(family: str, tokens_per_rank: int) -> tuple[list[float], object]:
    """One process on the same documents: the llama on each step's documents as one padded batch (the loss is the
    token mean over the whole step); a family with a router loss micro batch by micro batch, as dynamic SP runs it
    (the router loss is a mean over a micro batch's tokens, not a sum, so it is one per micro batch: each micro batch
    its documents as one padded batch, the cross-entropy over the whole step's targets, gradients accumulated)."""
    from ds_usp.integration.data.dynamic import plan_step, step_targets

    reference = _family_model(family, "sdpa")
    opt = torch.optim.AdamW(reference.parameters(), lr=LR) if family == "llama" else \
        torch.optim.SGD(reference.parameters(), lr=SGD_LR)
    want = []
    for step in range(2):
        docs = _documents(step, FAMILY_LENGTHS[family])
        if family == "llama":
            micro = [list(range(len(docs)))]
            targets = None
        else:
            plan = plan_step([len(d["input_ids"]) for d in docs], 4, tokens_per_rank)
            assert any(not row for m in plan for row in m.rows)  # a rank with no documents (one padding token)
            micro = [[i for row in m.rows for i in row] for m in plan]
            targets = torch.tensor(float(step_targets(docs)))
        total = 0.0
        for indices in micro:
            kwargs = {} if targets is None else {"num_items_in_batch": targets}
            loss = reference(**_padded_documents([docs[i] for i in indices]), **kwargs).loss
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        want.append(total)
    return want, reference


def train_steps(stage: int, family: str = "llama") -> str:
    import deepspeed

    import ds_usp
    from ds_usp import dynamic_sp_step

    want, reference = _reference_steps(family, 24)
    ds_usp.hf.register_usp_attention()
    model = _family_model(family, "usp")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}} if family == "llama" else \
        {"type": "SGD", "params": {"lr": SGD_LR}}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "optimizer": optimizer, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage}, "sequence_parallel": "usp", "sequence_parallel_size": 4,
              "usp": {"ulysses_degree": 2, "ring_degree": 2, "dynamic_sp": True}}
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(2):
        got = dynamic_sp_step(engine, _documents(step, FAMILY_LENGTHS[family]), tokens_per_rank=24)
        assert abs(got - want[step]) <= 1e-5 * abs(want[step]), f"step {step + 1}: {got} vs one process {want[step]}"
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())) if stage == 3 else _null():
        for name, p in reference.named_parameters():
            if family == "llama":
                # atol 2e-5 against AdamW steps of 1e-3: Adam divides a near-zero gradient by its own size, so the
                # fp32 summation order of the micro batches shows in a handful of elements (6.6e-6 seen)
                torch.testing.assert_close(params[name].detach(), p.detach(), rtol=1e-5, atol=2e-5,
                                           msg=lambda m: f"{name}: {m}")
            else:  # SGD: each parameter's update is the learning rate times its gradients, compared as a whole
                update, want_update = params[name].detach() - start[name], p.detach() - start[name]
                error = float((update - want_update).norm() / want_update.norm().clamp_min(1e-12))
                assert error <= 1e-4, f"{name}: update {error:.2e} relative off one process's"
    return "ok"


@pytest.mark.parametrize("stage,family", [(2, "llama"), (3, "llama"), (2, "qwen3_next"), (3, "qwen3_next")])
def test_dynamic_sp_step_equals_one_process(world4, stage, family):
    """12 documents of 1 to 90 tokens per step, 24 tokens per rank: micro batches at degrees 4 and 2 (the short rows
    spread over pairs), gradients accumulated over them, the loss normalized by the whole step's targets; 2 AdamW
    steps equal one process. Qwen3-Next (2 documents more: degrees 4, 2 and 1, one rank without a document in the
    last; SGD): Gated DeltaNet state passed over a degree's ranks, MoE router loss over each micro batch's tokens."""
    assert world4.run(train_steps, stage, family) == ["ok"] * 4


# ---- the one loop over a plan's micro batches, and its two boundary callbacks --------------------------------------

class _RecordingEngine:
    """What a DeepSpeed engine is asked during a dynamic-SP step, in order."""

    def __init__(self) -> None:
        self.calls: list = []

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.calls.append(("boundary", is_boundary))

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        self.calls.append(("backward", float(loss.detach()), scale_wrt_gas))


class _RecordingAccelerator:
    """What accelerate's ``Accelerator`` is asked during the Trainer's dynamic-SP step: ``sync_gradients`` as the
    property with a setter that the real one has, and a ``backward`` that hands it on (as accelerate's does)."""

    def __init__(self) -> None:
        self.calls: list = []
        self._sync = True

    @property
    def sync_gradients(self) -> bool:
        return self._sync

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self._sync = value

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append(("backward", float(loss.detach()), dict(sync_gradients=self.sync_gradients)))


@pytest.mark.parametrize("micro", [1, 3])
def test_one_loop_marks_only_the_last_micro_batch_as_the_boundary(micro):
    """``run_micro_batches`` with the engine's callback (``ds_usp.dynamic_sp_step``) and accelerate's (the Trainer):
    each micro batch's loss, then its backward; the accumulation boundary on the last only; the losses in order."""
    from ds_usp.integration.step.dynamic import accelerator_backward, engine_backward, run_micro_batches

    shards = [{"x": torch.tensor(float(k + 1), requires_grad=True)} for k in range(micro)]
    engine, accelerator = _RecordingEngine(), _RecordingAccelerator()
    losses = run_micro_batches(shards, lambda shard: shard["x"] * 2, engine_backward(engine))
    assert [float(x) for x in losses] == [2.0 * (k + 1) for k in range(micro)]
    assert not any(x.requires_grad for x in losses)
    want = []
    for k in range(micro):
        want += [("boundary", k == micro - 1), ("backward", 2.0 * (k + 1), False)]
    assert engine.calls == want
    run_micro_batches(shards, lambda shard: shard["x"] * 2, accelerator_backward(accelerator))
    assert accelerator.calls == [("backward", 2.0 * (k + 1), {"sync_gradients": k == micro - 1})
                                 for k in range(micro)]
