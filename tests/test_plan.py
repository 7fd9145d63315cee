"""The planner: its memory predictions against measured peaks, and ``python -m ds_usp.plan`` end to end.

Calibration (``ds_usp.cost.step_memory`` against live bytes): real training steps of an HF Llama on 4 CPU ranks
through ``ds_usp.initialize`` (fp32, AdamW), the per-rank peak of two steps measured as the kernel's high-water mark
``VmHWM`` minus the resident size before the model was built, the largest over the ranks, with glibc's mmap
threshold fixed at 64 KiB so that a freed tensor leaves the resident set (what ``max_memory_allocated`` counts on a
GPU; ``meters.step_peak``, with which benchmarks/plan_calibration.py fitted the constants on 17 rows, these three
among them). The prediction of the same plan within 20% on every row; the fit put them at 1.00-1.10 (the planner's
target is 15%, the largest rank of a run moves by about 5% from run to run).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

WORLD_TIMEOUT = 600
TOLERANCE = 0.20
VOCAB, HIDDEN, INTER, LAYERS = 8000, 256, 688, 4  # 8 heads, 4 key/value heads (meters.step_peak)
ROWS = [  # (S, U, R, ZeRO, usp memory keys)
    (4096, 2, 2, 2, {"activation_checkpointing": False, "tiled_mlp": False, "chunked_loss": False}),
    (8192, 1, 4, 3, {"memory_over_mib": 230}),  # "auto" in the resident set + 230 MiB: the loss in 512-row chunks
    (8192, 4, 1, 1, {"activation_checkpointing": "full", "tiled_mlp": True, "chunked_loss": True, "tile_mib": 8}),
]


@pytest.fixture(scope="module")
def fresh_world4(world4):
    """The shared 4-rank world, restarted once for this module: a peak is measured in ranks whose heap holds nothing of
    the cases other modules ran before (as benchmarks/plan_calibration.py's jobs, which fitted the constants). In a
    clean-clone run of the whole suite, after 500 cases in the same ranks, the three rows measured 0.05 to 0.40 of their
    predictions (8 MiB against 180) and failed; alone, in fresh ranks, they pass."""
    world4.restart()
    return world4


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"S{r[0]}-{r[1]}x{r[2]}-zero{r[3]}")
def test_predicted_peak_within_20_percent(fresh_world4, row):
    from ds_usp.instruments.meters import predicted_peak, step_peak

    seq, u, r, zero, keys = row
    shape = (LAYERS, VOCAB, HIDDEN, INTER)
    results = fresh_world4.run(step_peak, seq, u, r, zero, keys, *shape)
    measured, plan = max(peak for peak, _ in results), results[0][1]
    predicted = predicted_peak(seq, u, r, zero, plan, *shape)
    ratio = predicted / measured
    assert abs(ratio - 1) <= TOLERANCE, (f"{row} ({plan}): predicted {predicted / 2 ** 20:.0f} MiB, measured "
                                         f"{measured / 2 ** 20:.0f} MiB (ratio {ratio:.2f})")


# ------------------------------------------------------------------------------------------------ the CLI


def _plan(*args: str, process: bool = False) -> subprocess.CompletedProcess:
    """``python -m ds_usp.plan ARGS``: its exit code, stdout and stderr. Run in this process (its ``main``, as the
    module runs it) unless ``process``: a fresh interpreter costs 5 s of imports a call, and the tests make 20 of
    them; one call goes through a real ``python -m`` to check the entry point."""
    if process:
        return subprocess.run([sys.executable, "-m", "ds_usp.plan", *args], capture_output=True, text=True,
                              timeout=300)
    import contextlib
    import io

    from ds_usp.plan import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's errors (exit code 2)
            code = e.code
    return subprocess.CompletedProcess(["ds_usp.plan", *args], code, out.getvalue(), err.getvalue())


LLAMA8B = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--vocab", "128256",
           "--intermediate", "14336"]


def test_cli_ranks_plans_and_writes_the_json(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_usp.config import load_usp_config

    out = tmp_path / "ds.json"
    done = _plan(*LLAMA8B, "--seq", "131072", "--nodes", "2", "--gpus-per-node", "8", "--write", str(out))
    assert done.returncode == 0, done.stderr
    assert "plans fit" in done.stdout and "GiB" in done.stdout and "step s" in done.stdout
    written = json.loads(out.read_text())
    cfg = load_usp_config(written, world_size=16)
    assert cfg.enabled and cfg.ulysses_degree * cfg.ring_degree == written["sequence_parallel_size"]
    DeepSpeedConfig(written)  # DeepSpeed takes the file as it is
    rows = json.loads(_plan(*LLAMA8B, "--seq", "131072", "--nodes", "2", "--json").stdout)["plans"]
    fits = [p for p in rows if p["problem"] is None]
    states = [p["params_gib"] + p["grads_gib"] + p["optimizer_gib"] for p in fits]  # 90% of the rest is the step's
    assert fits and all(p["mem_gib"] - held <= 0.9 * (80 - held) + 1e-9 for p, held in zip(fits, states))
    first = fits[0]  # the same plan the table ranks first and --write wrote
    assert (first["U"], first["R"], first["zero"]) == (written["usp"]["ulysses_degree"],
                                                       written["usp"]["ring_degree"],
                                                       written["zero_optimization"]["stage"])
    parts = sum(first[k] for k in ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "attention_gib",
                                   "loss_gib", "fixed_gib"))
    assert abs(parts - first["mem_gib"]) < 1e-6


def test_cli_answers_impossible_requests():
    done = _plan(*LLAMA8B, "--seq", "8000000", "--gpus-per-node", "8", "--gpu-mem", "80")
    assert done.returncode == 1
    assert "nothing fits" in done.stderr and "the longest S that fits here" in done.stderr
    assert "the fewest nodes that fit S=8000000" in done.stderr
    heads = _plan("--hidden", "96", "--layers", "2", "--heads", "3", "--vocab", "100", "--intermediate", "64",
                  "--seq", "4096", "--gpus-per-node", "4", "--zero", "2", "--json")
    refused = {p["problem"] for p in json.loads(heads.stdout)["plans"] if p["U"] > 1}
    assert refused == {"3 heads not divisible by U=2", "3 heads not divisible by U=4"}
    short = _plan(*LLAMA8B, "--seq", "8", "--gpus-per-node", "8", "--top", "1", "--json")
    assert any("shorter than 2 x U x R" in (p["problem"] or "") for p in json.loads(short.stdout)["plans"])
    bad = _plan("--hidden", "64", "--seq", "1024", process=True)
    assert bad.returncode == 2 and "give --model, or all of" in bad.stderr
    split = _plan(*LLAMA8B, "--seq", "8192", "--gpus-per-node", "8", "--ulysses", "3")
    assert split.returncode == 2 and "must divide the 8 GPUs" in split.stderr


def test_cli_prices_one_split():
    """--ulysses/--ring price the layout a user already runs (the published setups of docs/planner.md)."""
    rows = json.loads(_plan(*LLAMA8B, "--seq", "212992", "--nodes", "2", "--ulysses", "8", "--ring", "2", "--zero", "3",
                            "--presets", "off,selective,full", "--json").stdout)["plans"]
    assert {(p["U"], p["R"], p["zero"]) for p in rows} == {(8, 2, 3)} and len(rows) == 3


def test_model_shapes_from_hf_configs(tmp_path):
    """MoE (total vs active), MLA head dims and hybrid linear layers from the config; an unshardable family refused."""
    import transformers

    from ds_usp.integration.models.shape import model_shape

    moe = model_shape(transformers.DeepseekV3Config(num_hidden_layers=3, hidden_size=256, intermediate_size=512,
                                                    moe_intermediate_size=64, n_routed_experts=16,
                                                    num_experts_per_tok=2, num_attention_heads=4,
                                                    num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                                                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                                    first_k_dense_replace=1, n_group=1, topk_group=1,
                                                    vocab_size=1000))
    assert (moe.head_dim, moe.v_head_dim) == (48, 32) and moe.active_params < moe.params - 1000 * 256
    hybrid = model_shape(transformers.Qwen3NextConfig(num_hidden_layers=4, hidden_size=128, vocab_size=1000,
                                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                      linear_num_key_heads=2, linear_num_value_heads=4,
                                                      linear_key_head_dim=32, linear_value_head_dim=32,
                                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64))
    assert (hybrid.attention_layers, hybrid.linear_layers, hybrid.linear_v_heads) == (1, 3, 4)
    jamba = model_shape(transformers.JambaConfig(num_hidden_layers=4, hidden_size=64, vocab_size=100,
                                                 num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                                 attn_layer_offset=1, num_experts=4, expert_layer_period=2,
                                                 expert_layer_offset=1))
    assert jamba.attention_layers == 2  # the two Mamba-1 layers are not priced as attention
    griffin = model_shape(transformers.RecurrentGemmaConfig(hidden_size=64, num_hidden_layers=3, vocab_size=100,
                                                            lru_width=64, num_attention_heads=4, head_dim=16,
                                                            block_types=["recurrent", "recurrent", "attention"]))
    assert griffin.attention_layers == 1
    path = tmp_path / "xlstm.json"
    path.write_text(json.dumps(transformers.xLSTMConfig(embedding_dim=64, num_heads=4, num_blocks=2,
                                                        vocab_size=100).to_dict()))
    done = _plan("--model", str(path), "--seq", "4096")
    assert done.returncode == 1 and "xLSTMForCausalLM" in done.stderr and "does not shard" in done.stderr
    path = tmp_path / "mamba.json"  # sharded, but no attention heads: the cost model cannot price it
    path.write_text(json.dumps(transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100).to_dict()))
    done = _plan("--model", str(path), "--seq", "4096")
    assert done.returncode == 1 and "MambaForCausalLM has no attention heads" in done.stderr


def test_auto_degrees_are_priced_at_the_models_length(monkeypatch):
    """``ds_usp.initialize``'s "auto" degrees: the paper's rule (Ulysses inside a node) unless the cost model prices
    another split 10% faster, at 16384 tokens a rank or at the model's max_position_embeddings when shorter. A tiny
    model of 128 positions on 2 nodes x 2 ranks keeps the rule; the same shape priced at 64K would go ring-only."""
    import transformers

    from ds_usp.config import load_usp_config
    from ds_usp.integration.engine.degrees import choose_degrees
    from ds_usp.integration.models.shape import model_shape

    monkeypatch.setenv("LOCAL_SIZE", "2")
    cfg = load_usp_config({"sequence_parallel": "usp", "sequence_parallel_size": 4}, 4, num_heads=4, num_kv_heads=2)
    assert (cfg.ulysses_degree, cfg.ring_degree, cfg.degrees_chosen_automatically) == (2, 2, True)
    shape = model_shape(transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    short = choose_degrees(cfg, shape, 2, 2, max_positions=128)
    long = choose_degrees(cfg, shape, 2, 2, max_positions=None)
    assert (short.ulysses_degree, short.ring_degree) == (2, 2)
    assert (long.ulysses_degree, long.ring_degree) == (1, 4)


def test_cli_predicts_static_and_dynamic_sp_from_lengths(tmp_path):
    """--lengths: a long-tailed list (or the same as a histogram) priced as static and as dynamic SP on the split of
    the fastest plan with SP; long documents on all ranks, short ones alone."""
    lengths = [9000, 4000, 3000] + [300] * 40 + [60] * 100
    listed = tmp_path / "lengths.txt"
    listed.write_text("\n".join(map(str, lengths)) + "\n")
    histogram = tmp_path / "histogram.json"
    histogram.write_text(json.dumps({"lengths": [9000, 4000, 3000, 300, 60], "counts": [1, 1, 1, 40, 100]}))
    args = (*LLAMA8B, "--seq", "16384", "--nodes", "2", "--gpus-per-node", "2", "--ulysses", "2", "--ring", "2",
            "--zero", "3")
    text = _plan(*args, "--lengths", str(listed))
    assert text.returncode == 0, text.stderr
    assert "static SP" in text.stdout and "dynamic SP" in text.stdout and "(U=2 R=2)" in text.stdout
    got = [json.loads(_plan(*args, "--lengths", str(f), "--json").stdout)["lengths"] for f in (listed, histogram)]
    assert got[0] == got[1]
    found = got[0]
    assert found["static"]["micro_batches"] == [4] * len(found["static"]["micro_batches"])
    assert found["dynamic"]["micro_batches"][0] == 4 and 1 in found["dynamic"]["micro_batches"]
    # 9000 tokens need all 4 ranks; the ring across the 2 nodes is what the short rows save
    assert found["speedup"] > 1.0, found
    assert abs(found["static"]["tokens_per_s"] * found["static"]["seconds"] - sum(lengths)) < 1e-3 * sum(lengths)
    bad = tmp_path / "bad.txt"
    bad.write_text("100\nten\n")
    done = _plan(*args, "--lengths", str(bad))
    assert done.returncode == 1 and "line 2: 'ten' is not 'length' or 'length count'" in done.stderr
    done = _plan(*args, "--seq", "8192", "--lengths", str(listed))
    assert done.returncode == 1 and "a document of 9000 tokens, longer than --seq 8192" in done.stderr


GPU_TOLERANCE = 0.15  # the planner's target


def test_predicted_peak_within_15_percent_of_the_h200_rows():
    """The cost model against ``torch.cuda.max_memory_allocated`` of whole training steps on one H200
    (benchmarks/results/gpu_usp_h200.json: the 1B Llama-3 shape, bf16, ZeRO-3, world size 1, 16K to 128K tokens,
    each row with the features ds-usp's "auto" chose for it: none, the chunked loss with selective checkpointing of
    2 layers, the chunked loss with the MLP in one tile). The H100 rows of issue 40 measured an older chunked loss (a
    bf16 vocab x hidden temporary per chunk where today's code keeps one fp32 product), so they no longer price
    today's code."""
    import re
    from pathlib import Path

    from ds_usp.cost import Features, StepSettings, step_memory
    from ds_usp.plan import shape_by_hand

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_usp_h200.json"
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("peak_GiB")]
    assert len(rows) == 4, rows
    shape = shape_by_hand(argparse.Namespace(hidden=2048, layers=16, heads=32, kv_heads=8, vocab=128256,
                                             intermediate=8192))
    ratios = {}
    for r in rows:
        assert r["params"] == shape.params, "the benchmark's model is not the shape priced here"
        fields = dict(re.findall(r"(\w+)=('[^']*'|[\w.]+)", r["choices"]))
        features = Features(loss_chunk=int(fields["loss_chunk"]), loss_grad_in_forward=fields["loss_grad_in_forward"]
                            == "True", mlp_tiles=int(fields["mlp_tiles"]), checkpoint=fields["checkpoint"].strip("'"),
                            checkpoint_layers=int(fields["checkpoint_layers"]), offload=fields["offload"] == "True")
        ratios[r["S"]] = step_memory(shape, StepSettings(1, 1, 1, 3, features=features), r["S"]).total / 2 ** 30 \
            / r["peak_GiB"]
    assert all(abs(x - 1) <= GPU_TOLERANCE for x in ratios.values()), f"predicted / measured peak per S: {ratios}"


def test_auto_takes_no_feature_the_gpu_does_not_need():
    """The planner's ``auto`` on one 80 GiB GPU, the 1.5B Llama-3 shape of the H100 rows: at 16K the step fits with the
    chunked loss alone (no checkpointing, no tiles); at 128K it checkpoints some layers but offloads nothing, since the
    step fits without it. The JSON it writes leaves the keys "auto" with the GPU's memory."""
    shape = ["--hidden", "2048", "--layers", "16", "--heads", "32", "--kv-heads", "8", "--vocab", "128256",
             "--intermediate", "8192", "--gpus-per-node", "1", "--gpu-mem", "80", "--zero", "3", "--json"]
    for seq, check in ((16384, lambda f: f["loss_chunk"] and not f["checkpoint"] and not f["mlp_tiles"]),
                       (131072, lambda f: f["checkpoint"] and f["checkpoint_layers"] < 16 and not f["offload"])):
        rows = [p for p in json.loads(_plan(*shape, "--seq", str(seq)).stdout)["plans"] if p["features"] == "auto"]
        assert rows and rows[0]["problem"] is None and check(rows[0]["chosen"]), (seq, rows[0])


def test_offloaded_layer_inputs_fit_the_host():
    """Offloaded layer inputs wait in pinned host memory: the planner and "auto" offload only what fits the GPU's
    share of the host (``Hardware.host_budget``), so a host of 128 GiB trains a shorter longest S than one of 2 TiB;
    under selective checkpointing what the policy saves stays on the GPU and is counted there."""
    from dataclasses import replace

    from ds_usp.cost import Features, Hardware, ModelShape, StepSettings, activation_memory, offloaded_bytes
    from ds_usp.plan import auto_settings, largest_fitting_seq

    shape = ModelShape("3b", hidden=3072, attention_layers=28, heads=24, kv_heads=8, head_dim=128, v_head_dim=128,
                       vocab=128256, mlp_width=8192, params=3_600_000_000, active_params=3_600_000_000)
    big, small = Hardware(1, 1, 140.0), Hardware(1, 1, 140.0, host_mem_gib=128.0)
    seq = 786432
    roomy = auto_settings(shape, StepSettings(1, 1, 1, 3), seq, big).features
    tight = auto_settings(shape, StepSettings(1, 1, 1, 3), seq, small).features
    assert roomy.offload and offloaded_bytes(shape, seq, roomy) > small.host_budget(), roomy
    assert offloaded_bytes(shape, seq, tight) <= small.host_budget(), tight
    assert largest_fitting_seq(shape, small, 1 << 22, zero=3, presets=("auto",)) < \
        largest_fitting_seq(shape, big, 1 << 22, zero=3, presets=("auto",))
    selective = Features(loss_chunk=1024, mlp_tiles=4, checkpoint="selective", checkpoint_layers=28)
    kept = [activation_memory(shape, 4096, replace(selective, offload=off), 2, 0.0)[0] for off in (False, True)]
    assert kept[0] - kept[1] == pytest.approx(4096 * 2 * 3072 * 28) and kept[1] > 0, kept  # the inputs alone leave


def test_auto_plans_the_gathered_parameters_and_the_key_value_heads():
    """Issue 65's tight CPU budget: what a layer's attention keeps grows with its key/value heads (counted with
    saved_tensors_hooks: q, k, v, the head-layout output when U > 1, the fp32 LSE), and under ZeRO-3 "auto" plans the
    step's gathered parameters beside what the rank holds, even where the process holds more than the model's states
    (on CPU the resident set, interpreter included: the larger of the two alone left them out)."""
    import types

    import torch

    from ds_usp.config import USPSettings
    from ds_usp.cost import (GIB, HEADROOM, Features, ModelShape, StepSettings, activation_memory, attention_kept,
                             model_state_memory, step_only_states)
    from ds_usp.integration.step.choices import MemoryContext

    per_token = [attention_kept(1, 8, kv, 32, 32, u, 4) for kv, u in ((8, 2), (8, 1), (4, 2))]
    assert per_token == [(256 + 512 + 256 + 8) * 4, (256 + 512 + 8) * 4, (256 + 256 + 256 + 8) * 4]
    shape = ModelShape("long_seq", hidden=256, attention_layers=4, heads=8, kv_heads=8, head_dim=32, v_head_dim=32,
                       vocab=32000, mlp_width=896, params=20_187_392, active_params=12_000_000)
    gqa = ModelShape(**dict(vars(shape), kv_heads=4))
    kept = [activation_memory(s, 4096, Features(), 4, 0.0, ulysses=2)[0] for s in (shape, gqa)]
    assert kept[0] - kept[1] == pytest.approx(4 * 4096 * 2 * 128 * 4)  # 2 h a token and layer (h = 256 = 2 x 128)
    step = StepSettings(2, 2, 1, 3)
    gathered = step_only_states(shape, step, 4)
    assert gathered == shape.params * 4 and step_only_states(shape, StepSettings(2, 2, 1, 2), 4) == 0
    topo = types.SimpleNamespace(ulysses_degree=2, ring_degree=2, sp_size=4, dp_size=1, sp_dp_group=None)
    for held in (0.0, 0.8 * GIB):  # nothing held: the states; a CPU process: its resident set, beyond the states
        ctx = MemoryContext(settings=USPSettings(memory_gib=2.0), fallback_topo=topo, layout="zigzag", hidden=256,
                            intermediate=896, vocab=32000, layers=4, zero3=True, shape=shape, step=step, held=held)
        got = ctx.make_choices(4096, torch.device("cpu"), torch.float32)
        lasting = sum(model_state_memory(shape, step, 4)) - gathered
        assert got.budget == pytest.approx(HEADROOM * (2 * GIB - max(held, lasting) - gathered)), (held, got)
        assert got.gathered == gathered and got.predicted <= got.budget
