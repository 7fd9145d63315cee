"""Config validation, group layout for every factorization, and DeepSpeed accepting the config and mpu."""
from __future__ import annotations

import datetime
import json
import os

import pytest
import torch

from ds_usp.config import LOCAL_SIZE_VARIABLES, USPConfigError, load_usp_config, ranks_per_node_and_source
from ds_usp.splits import default_degrees
from ds_usp.topology import group_ranks

# (config, world_size, expected message fragment)
BAD_CONFIGS = [
    ({"sequence_parallel": "usp", "sequence_parallel_size": 4, "usp": {"ulysses_degree": 3, "ring_degree": 2}}, 4,
     "usp.ulysses_degree (3) x usp.ring_degree (2) = 6 must equal sequence_parallel_size (4)"),
    ({"sequence_parallel": "usp", "sequence_parallel_size": 4, "usp": {"ulysses_degree": 4, "ring_degree": 2}}, 4,
     "usp.ulysses_degree (4) x usp.ring_degree (2) = 8 must equal sequence_parallel_size (4)"),
    ({"sequence_parallel": "usp", "sequence_parallel_size": 4, "usp": {"ulysses_degree": 3}}, 4,
     "usp.ulysses_degree (3) must divide sequence_parallel_size (4); valid values: 1, 2, 4"),
    ({"sequence_parallel": "usp", "sequence_parallel_size": 4, "usp": {"ring_degree": 8}}, 4,
     "usp.ring_degree (8) must divide sequence_parallel_size (4)"),
    ({"sequence_parallel": "usp", "sequence_parallel_size": 3}, 4,
     "sequence_parallel_size (3) must divide the world size (4); valid values here: 1, 2, 4"),
    ({"sequence_parallel": "usp", "sequence_parallel_size": 0}, 4, "sequence_parallel_size (0) must be a positive integer"),
    ({"sequence_parallel": "usp", "sequence_parallel_size": "4"}, 4, "sequence_parallel_size ('4') must be a positive"),
    ({"sequence_parallel": "ulyses"}, 4, "sequence_parallel ('ulyses') is invalid: must be one of 'usp', 'ulysses', 'ring'"),
    ({"sequence_parallel": "ulysses", "usp": {"ring_degree": 2}}, 4,
     'usp.ring_degree (2) must be 1 (or left out) when "sequence_parallel" is "ulysses"'),
    ({"sequence_parallel": "ring", "usp": {"ulysses_degree": 2}}, 4,
     'usp.ulysses_degree (2) must be 1 (or left out) when "sequence_parallel" is "ring"'),
    ({"sequence_parallel": "usp", "usp": {"layout": "zag"}}, 4,
     "usp.layout ('zag') is invalid: must be one of 'contiguous', 'zigzag', 'balanced'"),
    ({"sequence_parallel": "usp", "usp": {"ring_impl": "zag"}}, 4,
     "usp.ring_impl (the old name of usp.layout) ('zag') is invalid: must be one of 'contiguous', 'zigzag', 'balanced'"),
    ({"sequence_parallel": "usp", "usp": {"layout": "basic"}}, 4,
     "usp.layout ('basic') is the old name of 'contiguous': write \"layout\": \"contiguous\""),
    ({"sequence_parallel": "usp", "usp": {"ring_impl": "zigzag", "layout": "contiguous"}}, 4,
     "usp.ring_impl ('zigzag') is the old name of usp.layout ('contiguous'): give one of them"),
    ({"sequence_parallel": "usp", "usp": {"attn_backend": "xformers"}}, 4,
     "usp.attn_backend ('xformers') is invalid: must be one of 'auto', 'torch', 'flash_attn', 'flash_attn_4', 'triton'"),
    ({"sequence_parallel": "usp", "usp": {"native_op": "yes"}}, 4,
     "usp.native_op ('yes') is invalid: must be 'auto', true or false"),
    ({"sequence_parallel": "usp", "usp": {"comm_dtype": "bf16"}}, 4,
     "usp.comm_dtype ('bf16') is invalid: must be one of 'input', 'fp8'"),
    ({"sequence_parallel": "usp", "usp": {"ulysses_degree": 0}}, 4,
     "usp.ulysses_degree (0) is invalid: must be a positive integer"),
    ({"sequence_parallel": "usp", "usp": {"ulysses_degree": 2.0}}, 4,
     "usp.ulysses_degree (2.0) is invalid: must be a positive integer"),
    ({"sequence_parallel": "usp", "usp": {"ulysess_degree": 2}}, 4,
     "usp.ulysess_degree is not a known key; valid keys are: ulysses_degree, ring_degree"),
    ({"sequence_parallel": "usp", "usp": [2, 2]}, 4, "usp ([2, 2]) must be a JSON object"),
    ({"sequence_parallel": "usp", "usp": {"timeout_seconds": 0}}, 4,
     "usp.timeout_seconds (0) is invalid: must be a positive number of seconds"),
    ({"sequence_parallel": "usp", "usp": {"timeout_seconds": float("inf")}}, 4,
     "usp.timeout_seconds (inf) is invalid: must be a positive number of seconds"),
    ({"sequence_parallel": "usp", "usp": {"timeout_seconds": "10"}}, 4,
     "usp.timeout_seconds ('10') is invalid: must be a positive number of seconds"),
    ({"sequence_parallel": "usp", "usp": {"chunked_loss": "yes"}}, 4,
     "usp.chunked_loss ('yes') is invalid: must be 'auto', true or false"),
    ({"sequence_parallel": "usp", "usp": {"activation_checkpointing": "layers"}}, 4,
     "usp.activation_checkpointing ('layers') is invalid: must be 'auto', 'selective', 'full', true (selective) or "
     "false"),
    ({"sequence_parallel": "usp", "usp": {"tile_mib": 0}}, 4, "usp.tile_mib (0) is invalid: must be a positive number "
     "of MiB"),
]


@pytest.mark.parametrize("cfg,world,msg", BAD_CONFIGS, ids=[m[:40] for _, _, m in BAD_CONFIGS])
def test_bad_config_names_the_key(cfg, world, msg):
    with pytest.raises(USPConfigError) as e:
        load_usp_config(cfg, world)
    assert msg in str(e.value)
    assert isinstance(e.value, ValueError)


def test_head_constraints_are_checked_when_heads_are_known():
    cfg = {"sequence_parallel": "usp", "sequence_parallel_size": 4, "usp": {"ulysses_degree": 4}}
    with pytest.raises(USPConfigError, match=r"usp.ulysses_degree \(4\) must divide the number of attention heads \(6\)"):
        load_usp_config(cfg, 4, num_heads=6)
    cfg8 = {"sequence_parallel": "usp", "sequence_parallel_size": 8, "usp": {"ulysses_degree": 4}}
    with pytest.raises(USPConfigError, match=r"incompatible with 6 kv heads"):
        load_usp_config(cfg8, 8, num_heads=24, num_kv_heads=6)
    with pytest.raises(USPConfigError, match=r'"ulysses" puts all 8 sequence-parallel ranks in one Ulysses group, but 8 '
                                             r'does not divide the number of attention heads \(4\); use "sequence_parallel": "usp"'):
        load_usp_config({"sequence_parallel": "ulysses"}, 8, num_heads=4)


def test_timeout_default_and_value():
    from ds_usp.config import DEFAULT_TIMEOUT_SECONDS, process_group_timeout

    cfg = {"sequence_parallel": "usp", "usp": {"timeout_seconds": 42}}
    assert load_usp_config(cfg, 4).timeout_seconds == 42.0 == process_group_timeout(cfg)
    assert load_usp_config({"sequence_parallel": "usp"}, 4).timeout_seconds == DEFAULT_TIMEOUT_SECONDS == 600
    assert process_group_timeout({"sequence_parallel": "usp", "usp": {"timeout_seconds": -1}}) == 600  # refused later
    assert process_group_timeout({}) is None  # sequence parallelism off: DeepSpeed's own default


def test_file_path_and_missing_file(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_parallel": "usp",
                             "sequence_parallel_size": 4, "usp": {"ulysses_degree": 2, "ring_degree": 2}}))
    c = load_usp_config(str(p), 8)
    assert (c.ulysses_degree, c.ring_degree, c.data_parallel_size, c.layout) == (2, 2, 2, "zigzag")
    with pytest.raises(USPConfigError, match="does not exist"):
        load_usp_config(str(tmp_path / "nope.json"), 4)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(USPConfigError, match="not valid JSON"):
        load_usp_config(str(tmp_path / "bad.json"), 4)
    # what DeepSpeed accepts (hjson: comments, trailing commas) is read the same way
    (tmp_path / "hjson.json").write_text('{"sequence_parallel": "ring", // ring only\n "usp": {"ring_impl": "contiguous",},}')
    c = load_usp_config(str(tmp_path / "hjson.json"), 4)
    assert (c.ulysses_degree, c.ring_degree, c.layout) == (1, 4, "contiguous")  # ring_impl: layout's old name


def test_modes_and_defaults():
    off = load_usp_config({"train_micro_batch_size_per_gpu": 1, "usp": {"ulysses_degree": 2}}, 4)
    assert not off.enabled and off.sequence_parallel_size == 1 and off.data_parallel_size == 4
    uly = load_usp_config({"sequence_parallel": "ulysses", "sequence_parallel_size": 4}, 8)
    assert (uly.ulysses_degree, uly.ring_degree, uly.data_parallel_size) == (4, 1, 2)
    ring = load_usp_config({"sequence_parallel": "ring", "usp": {"layout": "contiguous"}}, 4)
    assert (ring.ulysses_degree, ring.ring_degree, ring.layout) == (1, 4, "contiguous")
    one = load_usp_config({"sequence_parallel": "usp", "sequence_parallel_size": 8, "usp": {"ring_degree": 2}}, 8)
    assert (one.ulysses_degree, one.ring_degree) == (4, 2)
    full = load_usp_config({"sequence_parallel": "usp", "usp": {"attn_backend": "torch", "native_op": False}}, 4, 4)
    assert full.sequence_parallel_size == 4 and full.attn_backend == "torch" and full.native_op is False
    assert full.comm_dtype == "input"
    assert load_usp_config({"sequence_parallel": "usp", "usp": {"comm_dtype": "fp8"}}, 4).comm_dtype == "fp8"


def test_ranks_per_node_from_either_launcher(monkeypatch):
    cfg = {"sequence_parallel": "usp"}
    for var in LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    assert load_usp_config(cfg, 4, num_heads=8).ulysses_degree == 4  # no launcher: one node
    assert ranks_per_node_and_source(4) == (4, "no launcher variable")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun / accelerate launch, 1 rank per node
    assert (load_usp_config(cfg, 4).ulysses_degree, ranks_per_node_and_source(4)) == (1, (1, "LOCAL_WORLD_SIZE"))
    # the deepspeed launcher's LOCAL_SIZE wins: accelerate, inside it with TrainingArguments(use_cpu=True), writes
    # LOCAL_WORLD_SIZE=1 (its CPU default) whatever the launcher started
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert (load_usp_config(cfg, 4, num_heads=8).ulysses_degree, load_usp_config(cfg, 4).ring_degree) == (2, 2)
    assert ranks_per_node_and_source(4) == (2, "LOCAL_SIZE")


def test_automatic_degrees_follow_the_paper(caplog):
    # Ulysses inside a node (4 ranks per node), ring across nodes.
    assert default_degrees(16, 4) == (4, 4)
    assert default_degrees(8, 8, num_heads=32, num_kv_heads=8) == (8, 1)
    assert default_degrees(8, 8, num_heads=12) == (4, 2)          # 8 does not divide 12 heads
    assert default_degrees(8, 8, num_heads=24, num_kv_heads=6) == (2, 4)  # kv heads 6 vs U=4, 8: incompatible
    assert default_degrees(8, 8, num_heads=8, num_kv_heads=1) == (8, 1)   # MQA: replicate the one kv head
    c = load_usp_config({"sequence_parallel": "usp", "sequence_parallel_size": 8}, 16, local_world_size=4,
                        num_heads=8, num_kv_heads=2)
    assert (c.ulysses_degree, c.ring_degree, c.degrees_chosen_automatically) == (4, 2, True)


@pytest.mark.parametrize("world", [4, 8])
def test_plan_partitions_the_world_for_every_factorization(world):
    for u in range(1, world + 1):
        for r in range(1, world // u + 1):
            if world % (u * r):
                continue
            p = group_ranks(u, r, world)
            for kind, size in (("ulysses", u), ("ring", r), ("sp", u * r), ("dp", world // (u * r)), ("sp_dp", world)):
                groups = getattr(p, kind)
                flat = sorted(x for g in groups for x in g)
                assert flat == list(range(world)), (kind, u, r)
                assert all(len(g) == size for g in groups), (kind, u, r)
            for g in p.ulysses:  # contiguous
                assert list(g) == list(range(g[0], g[0] + u))
            for g in p.ring:  # stride U
                assert all(b - a == u for a, b in zip(g, g[1:]))
            for g in p.sp:
                assert list(g) == list(range(g[0], g[0] + u * r))
            for g in p.dp:  # same SP position in every replica
                assert all(b - a == u * r for a, b in zip(g, g[1:]))
    with pytest.raises(ValueError, match=r"ulysses_degree \(3\) x ring_degree \(1\) = 3 must divide the world size \(4\)"):
        group_ranks(3, 1, 4)


# ---------------------------------------------------------------- multi-process cases


def _factorizations(world):
    return [(u, r) for u in range(1, world + 1) for r in range(1, world + 1) if world % (u * r) == 0]


def build_all_layouts(world):
    """On every rank: build every (U, R, dp) layout and check each group really connects its ranks."""
    import torch.distributed as dist

    from ds_usp.topology import USPTopology

    rank = dist.get_rank()
    seen = []
    for u, r in _factorizations(world):
        topo = USPTopology.build(u, r)
        assert topo.sp_rank == topo.ring_rank * u + topo.ulysses_rank
        assert topo.ulysses_ranks[topo.ulysses_rank] == rank and topo.ring_ranks[topo.ring_rank] == rank
        for group, ranks in ((topo.ulysses_group, topo.ulysses_ranks), (topo.ring_group, topo.ring_ranks),
                             (topo.sp_group, topo.sp_ranks), (topo.dp_group, topo.dp_ranks),
                             (topo.sp_dp_group, tuple(range(world)))):
            assert dist.get_world_size(group) == len(ranks)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)  # the group connects exactly these ranks
            assert t.item() == float(sum(ranks)), (u, r, ranks, t.item())
        mpu = topo.mpu
        assert mpu.get_data_parallel_world_size() == world // (u * r)
        assert mpu.get_sequence_parallel_world_size() == u * r
        assert mpu.get_sequence_data_parallel_world_size() == world
        assert mpu.get_model_parallel_world_size() == 1 and dist.get_world_size(mpu.get_model_parallel_group()) == 1
        assert not hasattr(mpu, "initialize_sequence_parallel")
        seen.append((u, r, topo.ulysses_ranks, topo.ring_ranks, topo.sp_ranks, topo.dp_ranks))
    return seen


def _check_layouts(world, results):
    for u, r in _factorizations(world):
        plan = group_ranks(u, r, world)
        for rank, per_rank in enumerate(results):
            entry = next(e for e in per_rank if e[:2] == (u, r))
            assert entry[2:] == tuple(plan.member_of(k, rank) for k in ("ulysses", "ring", "sp", "dp"))


def test_groups_world4(world4):
    _check_layouts(4, world4.run(build_all_layouts, 4))


def test_groups_world8(world8):
    _check_layouts(8, world8.run(build_all_layouts, 8))


def rebuild_after_groups_are_destroyed():
    """A topology built after groups were destroyed (a new SP size, a re-initialized engine) still builds: torch names a
    locally synchronized group by its ranks and the number of groups alive, so a second one-rank group would get the
    first's name here; the first is reused instead."""
    import torch.distributed as dist

    from ds_usp.topology import USPTopology

    def destroy_all_but_the_one_rank_group(topo):
        # each group the topology made, once (with one replica sp is sp_dp, the default group, which stays)
        for g in topo.own_groups():
            dist.destroy_process_group(g)

    extra = dist.new_group(list(range(dist.get_world_size())))  # alive when first's one-rank group is made
    first = USPTopology.build(2, 2)
    dist.destroy_process_group(extra)
    destroy_all_but_the_one_rank_group(first)
    second = USPTopology.build(2, 2)
    third = USPTopology.build(1, 4, timeout=datetime.timedelta(seconds=600))  # another timeout: the same group
    destroy_all_but_the_one_rank_group(third)
    assert second.model_parallel_group is first.model_parallel_group is third.model_parallel_group
    t = torch.ones(1)
    dist.all_reduce(t, group=second.sp_group)
    return t.item()


def test_rebuild_after_groups_are_destroyed(world4):
    assert world4.run(rebuild_after_groups_are_destroyed) == [4.0] * 4


def bad_inputs_fail_on_every_rank_before_any_collective():
    """Every rank raises the same error; the world is still healthy afterwards (no half-done collective)."""
    import torch.distributed as dist

    from ds_usp.topology import USPTopology

    messages = []
    for cfg, world, _ in BAD_CONFIGS:
        try:
            load_usp_config(cfg, world)
        except USPConfigError as e:
            messages.append(str(e))
    try:
        USPTopology.build(3, 1)
    except ValueError as e:
        messages.append(str(e))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return messages


def test_errors_on_every_rank(world4):
    per_rank = world4.run(bad_inputs_fail_on_every_rank_before_any_collective)
    assert len(per_rank[0]) == len(BAD_CONFIGS) + 1
    assert all(m == per_rank[0] for m in per_rank)
    for (_, _, expected), got in zip(BAD_CONFIGS, per_rank[0]):
        assert expected in got
    assert "must divide the world size (4)" in per_rank[0][-1]


def plain_deepspeed_without_the_key():
    """DeepSpeed with ds-usp imported: a file without "sequence_parallel" (the "usp" block ignored) is plain DeepSpeed."""
    import deepspeed

    import ds_usp  # noqa: F401 - installs the deepspeed.initialize hook

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": 2}, "usp": {"ulysses_degree": 2, "ring_degree": 2, "layout": "zigzag"}}
    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert not hasattr(engine, "usp")  # DeepSpeed's own engine, untouched
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    return engine.train_batch_size()


def test_plain_deepspeed_without_the_key(world4):
    # Runs before any ds-usp mpu is handed to DeepSpeed in this world (DeepSpeed keeps it in a global).
    assert world4.run(plain_deepspeed_without_the_key) == [4] * 4


def deepspeed_accepts_the_config(tmp_dir, stage):
    """DeepSpeed accepts the keys next to its own when the caller built ds-usp's mpu itself (the call goes through)."""
    import deepspeed
    import torch.distributed as dist

    from ds_usp.topology import USPTopology

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": stage},
           "sequence_parallel": "usp", "sequence_parallel_size": 2,
           "usp": {"ulysses_degree": 2, "ring_degree": 1, "layout": "contiguous", "attn_backend": "torch",
                   "native_op": False}}
    path = f"{tmp_dir}/ds_{stage}.json"
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(cfg, f)
    dist.barrier()
    torch.manual_seed(0)
    usp = load_usp_config(path, dist.get_world_size())
    topo = USPTopology.build(usp.ulysses_degree, usp.ring_degree)
    model = torch.nn.Linear(8, 8)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=path, mpu=topo.mpu)
    assert engine.dp_world_size == 2 and engine.seq_dp_world_size == 4 and engine.sequence_parallel_size == 2
    assert engine.train_batch_size() == 2  # micro 1 x 2 replicas: SP ranks do not multiply the batch
    loss = engine(torch.ones(1, 8)).sum()
    engine.backward(loss)
    engine.step()
    return float(loss)


def test_deepspeed_initialize_accepts_the_keys(world4, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dscfg"))
    for stage in (1, 3):
        losses = world4.run(deepspeed_accepts_the_config, d, stage)
        assert len(set(losses)) == 1


CONFIG_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent / "ds_configs"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    raw = json.loads(path.read_text())
    assert isinstance(raw.get("_comment"), str) and "\n" not in raw["_comment"] and raw["_comment"]
    sp = raw.get("sequence_parallel_size", 4)  # absent: the whole world (cpu_long_seq.json: 4 CPU ranks)
    c = load_usp_config(path, world_size=sp, local_world_size=min(sp, 8), num_heads=32, num_kv_heads=8)
    assert c.enabled and c.ulysses_degree * c.ring_degree == sp
    assert c.ulysses_degree <= 8  # the all-to-all never leaves a node of 8
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeed itself accepts the file (and ignores the USP keys); HF Trainer configs get their "auto"
    # values as HF fills them for one sequence per replica and step (ds_configs/hf_trainer.json)
    filled = _fill_hf_auto(raw, replicas=1)
    DeepSpeedConfig(filled if filled != raw else str(path))


_HF_AUTO = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "warmup_min_lr": 0.0,
            "warmup_max_lr": 1e-3, "warmup_num_steps": 3, "total_num_steps": 30}


def _fill_hf_auto(cfg, replicas: int):
    """``cfg`` with HF's ``"auto"`` values filled (train_batch_size counts replicas, as ds_usp.integration.trainers.trainer does)."""
    if isinstance(cfg, dict):
        out = {k: (_HF_AUTO[k] if v == "auto" and k in _HF_AUTO else _fill_hf_auto(v, replicas)) for k, v in cfg.items()}
        if out.get("train_batch_size") == "auto":
            out["train_batch_size"] = replicas * out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"]
        return out
    return cfg


def test_reliability_doc_counts_the_bad_configs():
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "reliability.md")) as f:
        stated = re.search(r"\+ (\d+) config values", f.read())
    assert stated and int(stated.group(1)) == len(BAD_CONFIGS)


def test_config_docs_table_is_the_schema():
    """docs/config.md's key table is rendered from the schema (ds_usp.config.reference_table): one source of truth."""
    from ds_usp.config import reference_table

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "config.md")).read()
    assert reference_table() in doc, ("docs/config.md's key table differs from the schema; paste this in:\n"
                                      + reference_table())
