"""A tiny HF Llama trained 5 steps with ds_usp.initialize under ZeRO-1/2/3 equals single-process training.

Every step's loss and the parameters after the last step are compared with the same model trained
in one process on the full sequences with the same global batch (the mean over replicas of each
replica's token-weighted loss, which is DeepSpeed's data-parallel semantics). fp32; tolerance:
rtol 1e-4 (atol 1e-6) for losses and parameters. The sequence length (250) is not a multiple of
any shard count, and the ignored labels (-100) fall unevenly over the ranks.

SGD with momentum and gradient clipping at 1.0 in both (DeepSpeed 0.19 clips at 1.0 unless told
otherwise; the clip exercises the global gradient norm over the sequence x data-parallel ranks).
SGD's update is linear in the gradient, so the parameters show how exact the gradients are. Adam
divides each gradient by its own running magnitude, which turns ~1e-9 rounding differences of
near-zero gradients into update differences of up to 2e-4 relative (seen with AdamW at lr 1e-3:
1 element of 4096), whatever the implementation.
"""
from __future__ import annotations

import json

import pytest
import torch

SEQ, VOCAB, STEPS, LR, MOMENTUM, CLIP = 250, 128, 5, 0.02, 0.9, 1.0
TOL = dict(rtol=1e-4, atol=1e-6)
LAYOUTS = [  # (zero stage, U, R, dp, ring_impl)
    (stage, u, r, dp, impl)
    for stage in (1, 2, 3)
    for (u, r, dp, impl) in ((4, 1, 1, "zigzag"), (2, 2, 1, "zigzag"), (1, 4, 1, "zigzag"), (1, 2, 2, "contiguous"))
]


def _llama(attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attention_dropout=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def _batch(index: int) -> dict:
    g = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[:, : 90 + 7 * index] = -100  # the first ranks get far fewer targets than the last ones
    labels[:, 200:205] = -100
    return {"input_ids": ids, "labels": labels}


def _ds_config(stage: int, sp: int, u: int, r: int, impl: str, with_sp: bool = True, comm_dtype: str = "input") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
           "zero_allow_untested_optimizer": True, "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if with_sp:
        cfg.update({"sequence_parallel": "usp", "sequence_parallel_size": sp,
                    "usp": {"ulysses_degree": u, "ring_degree": r, "layout": impl, "comm_dtype": comm_dtype}})
    return cfg


def reference(dp: int) -> tuple[list[float], dict]:
    """Single-process training on the full sequences, global batch = dp sequences per step."""
    model = _llama("sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(model(**_batch(step * dp + i)).loss for i in range(dp)) / dp
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _params(engine, stage: int) -> dict:
    import deepspeed

    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def train_usp(tmp_dir: str, stage: int, u: int, r: int, dp: int, impl: str,
              entry: str = "ds_usp", comm_dtype: str = "input") -> tuple[list[float], dict]:
    """On every rank: ``ds_usp.initialize`` (or, ``entry="deepspeed"``, the plain ``deepspeed.initialize`` after
    ``import ds_usp``) from a JSON file with ``usp.comm_dtype``, 5 steps; returns the replica-mean losses and the
    parameters."""
    import deepspeed
    import torch.distributed as dist

    import ds_usp

    ds_usp.hf.register_usp_attention()
    path = f"{tmp_dir}/usp_{stage}_{u}x{r}x{dp}.json"
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(_ds_config(stage, u * r, u, r, impl, comm_dtype=comm_dtype), f)
    dist.barrier()
    model = _llama("usp")
    init = ds_usp.initialize if entry == "ds_usp" else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=path)
    topo = engine.usp.topo
    assert (topo.ulysses_degree, topo.ring_degree, topo.dp_size) == (u, r, dp)
    assert engine.usp.config.comm_dtype == comm_dtype
    losses = []
    for step in range(STEPS):
        shard = ds_usp.shard_batch(_batch(step * dp + topo.dp_rank), topo, layout=engine.usp.layout)
        logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo)
        engine.backward(loss)
        engine.step()
        replica_loss = loss.detach().clone()  # the whole sequence's loss on every rank
        if dp > 1:
            dist.all_reduce(replica_loss, group=topo.dp_group)
        losses.append(float(replica_loss) / dp)
    return losses, _params(engine, stage)


def train_all_ranks_sampler(stage: int, u: int, r: int) -> tuple[list[float], dict]:
    """On every rank: the user's own DataLoader with an ordinary DistributedSampler over all 4 ranks (each rank its
    own sample per step), wrapped in ds_usp.USPDataLoader, which trains the SP group's samples in turn; gradient
    accumulation over the group's sp samples. Returns the losses of each optimizer step (the mean over the world's
    4 samples) and the parameters."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import ds_usp

    ds_usp.hf.register_usp_attention()
    sp = u * r
    cfg = _ds_config(stage, sp, u, r, "zigzag")
    cfg["gradient_accumulation_steps"] = sp
    model = _llama("usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    topo = engine.usp.topo
    samples = [{k: v[0] for k, v in _batch(i).items()} for i in range(4 * STEPS)]
    loader = DataLoader(samples, batch_size=1, sampler=DistributedSampler(samples, num_replicas=4,
                                                                          rank=dist.get_rank(), shuffle=False))
    shards = ds_usp.USPDataLoader(loader, topo, layout=engine.usp.layout)
    assert shards.per_rank and len(shards) == STEPS * sp
    losses, total = [], torch.zeros(())
    for micro, shard in enumerate(shards):
        loss = engine(**shard).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach()
        if (micro + 1) % sp == 0:  # an optimizer step: every rank's sample of the world trained once
            if topo.dp_size > 1:
                dist.all_reduce(total, group=topo.dp_group)
            losses.append(float(total) / 4)
            total = torch.zeros(())
    return losses, _params(engine, stage)


def train_plain(tmp_dir: str) -> tuple[list[float], dict]:
    """The same JSON without "sequence_parallel": plain DeepSpeed data parallelism on 4 ranks."""
    import torch.distributed as dist

    import ds_usp

    path = f"{tmp_dir}/plain.json"
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(_ds_config(2, 1, 1, 1, "zigzag", with_sp=False), f)
    dist.barrier()
    model = _llama("sdpa")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=path)
    assert engine.usp.topo is None and not engine.usp.config.enabled
    losses = []
    for step in range(STEPS):
        loss = engine(**_batch(step * 4 + dist.get_rank())).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / 4)
    return losses, _params(engine, 2)


@pytest.fixture(scope="module")
def references():
    return {dp: reference(dp) for dp in (1, 2, 4)}


def _compare(got: tuple[list[float], dict], want: tuple[list[float], dict], what: str) -> None:
    losses, params = got
    ref_losses, ref_params = want
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL,
                               msg=lambda m: f"{what} losses {losses} vs {ref_losses}: {m}")
    assert params.keys() == ref_params.keys()
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], **TOL, msg=lambda m: f"{what} {name}: {m}")


def test_plain_deepspeed_with_the_same_file(world4, tmp_path_factory, references):
    # First in this world: DeepSpeed keeps the last mpu it was given in a global.
    results = world4.run(train_plain, str(tmp_path_factory.mktemp("plain")))
    _compare(results[0], references[4], "plain DeepSpeed")


def test_plain_deepspeed_initialize_is_usp(world4, tmp_path_factory, references):
    """After ``import ds_usp`` the plain ``deepspeed.initialize`` with the USP file trains exactly as
    ds_usp.initialize."""
    d = str(tmp_path_factory.mktemp("plain_usp"))
    results = world4.run(train_usp, d, 2, 2, 2, 1, "zigzag", entry="deepspeed")
    _compare(results[0], references[1], "deepspeed.initialize with the USP file")


@pytest.mark.parametrize("stage,u,r,dp,impl", LAYOUTS,
                         ids=[f"zero{s}-{u}x{r}-dp{dp}-{i}" for s, u, r, dp, i in LAYOUTS])
def test_usp_training_equals_single_process(world4, tmp_path_factory, references, stage, u, r, dp, impl):
    results = world4.run(train_usp, str(tmp_path_factory.mktemp("usp")), stage, u, r, dp, impl)
    for rank in range(4):
        torch.testing.assert_close(torch.tensor(results[rank][0]), torch.tensor(results[0][0]))  # all ranks agree
    _compare(results[0], references[dp], f"ZeRO-{stage} U={u} R={r} dp={dp}")
    assert results[0][0][-1] < results[0][0][0]  # and it learns


def hf_family_matches(family: str) -> float:
    """One forward+backward of a tiny Qwen2 / Mistral through attn_implementation="usp" (2x2, zigzag)."""
    import transformers

    import ds_usp
    from ds_usp.integration.models.attention import USPContext, attach

    ds_usp.hf.register_usp_attention()
    cfg_cls, kw = {"qwen2": (transformers.Qwen2Config, {}), "mistral": (transformers.MistralConfig,
                                                                            {"sliding_window": None})}[family]
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **kw)
    batch = _batch(3)
    torch.manual_seed(0)
    ref_model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    ref = ref_model(**batch).loss
    ref.backward()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="usp", dtype=torch.float32)
    topo = ds_usp.USPTopology.build(2, 2)
    attach(model, USPContext(topo=topo, layout="zigzag"))
    shard = ds_usp.shard_batch(batch, topo, layout="zigzag")
    loss = ds_usp.sp_cross_entropy(model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits,
                                   shard["shift_labels"], topo)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    for (name, p), (_, rp) in zip(model.named_parameters(), ref_model.named_parameters()):
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=topo.sp_group)  # what DeepSpeed sums over the SP ranks
        torch.testing.assert_close(g, rp.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{family} {name}: {m}")
    return float(ref)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_hf_families(world4, family):
    assert len(set(world4.run(hf_family_matches, family))) == 1


@pytest.mark.parametrize("stage,u,r", [(2, 2, 1), (3, 2, 2)])
def test_a_distributed_sampler_over_all_ranks_equals_single_process(world4, references, stage, u, r):
    """Bring your own loader: an ordinary DistributedSampler over the world, each SP group taking its ranks' samples
    in turn (1x2 x dp 2 under ZeRO-2, 2x2 under ZeRO-3), equals one process on the same 4 samples per step."""
    results = world4.run(train_all_ranks_sampler, stage, u, r)
    for got in results:
        _compare(got, references[4], f"all-ranks sampler {u}x{r} ZeRO-{stage}")


def test_fp8_wire_trains_close_to_single_process(world4, tmp_path_factory, references):
    """``usp.comm_dtype = "fp8"`` from the JSON reaches the attention: 2x2 under ZeRO-2 trains within 2% of the
    single-process losses, and not exactly on them (the wire is compressed)."""
    results = world4.run(train_usp, str(tmp_path_factory.mktemp("fp8")), 2, 2, 2, 1, "zigzag", comm_dtype="fp8")
    losses, ref = torch.tensor(results[0][0]), torch.tensor(references[1][0])
    torch.testing.assert_close(losses, ref, rtol=2e-2, atol=0, msg=lambda m: f"fp8 wire {losses} vs {ref}: {m}")
    assert float((losses - ref).abs().max()) > 1e-6, "the fp8 wire left every loss exact: was it applied?"
    assert losses[-1] < losses[0]


def test_a_zero3_training_leaves_no_thread_behind(world4, tmp_path_factory):
    """After each case the world's ranks free its engines and process groups (tests/dist_harness.py,
    ``_release_groups``). A ZeRO-3 engine kept alive, as DeepSpeed's module-level references to its model would keep
    it, holds 6 gloo groups whose 18 threads poll for the rest of the world's life: 0.1 core a world of 4 every 30
    groups, taken from the cases that follow. Two ZeRO-3 trainings in a row: the second leaves no thread more."""
    d = str(tmp_path_factory.mktemp("threads"))
    world4.run(train_usp, d, 3, 2, 2, 1, "zigzag")
    first = world4.threads()
    world4.run(train_usp, d, 3, 2, 2, 1, "zigzag")
    assert world4.threads() <= first, f"a ZeRO-3 training left {world4.threads() - first} threads a rank"
