"""The long-sequence memory features (ds_usp/integration/step.forward.py): exact, and each one saves what it should.

Exactness, on a 4-rank gloo world: a tiny HF Llama trained 5 steps through the standard HF idiom
``engine(input_ids=..., position_ids=..., shift_labels=...).loss`` with the chunked loss, tiled MLP,
activation checkpointing and offload forced on (tiles made tiny so that every loss chunk and MLP
tile loop runs several times), under ZeRO-1/2/3 and (U, R) = (4, 1), (2, 2), (1, 4), equals
single-process training of the same model on the full sequences (tests/test_training.py's
reference; rtol 1e-4 as there). ``labels=`` (shifted over the whole sequence by ds-usp) and both
ways of taking the loss's gradient (in the forward, or recomputed in the backward) are covered.

Memory, in one run each (kernel high-water mark ``VmHWM`` after resetting it): the chunked loss at
S=4096, vocab 32000 peaks below half of the whole-logits loss; the tiled MLP below half of the
untiled one; activation checkpointing of a 6-layer model below 0.6 of no checkpointing.
"""
from __future__ import annotations

import json
import re
from typing import Optional

import pytest
import torch

from ds_usp.instruments.meters import peak_growth
from test_training import STEPS, VOCAB, _batch, _compare, _ds_config, _llama, _params, reference

FORCED = {"chunked_loss": True, "tiled_mlp": True, "activation_checkpointing": "selective",
          "offload_activations": True, "tile_mib": 0.01}  # 0.01 MiB: 20-token loss chunks at vocab 128
CASES = [  # (zero stage, U, R, memory keys, labels=)
    (1, 2, 2, FORCED, False),
    (2, 4, 1, FORCED, True),
    (3, 1, 4, FORCED, False),
    (3, 2, 2, dict(FORCED, activation_checkpointing="full", tile_mib=1.0), False),  # grads taken in the forward
    (2, 2, 2, dict(FORCED, tile_mib=1.0, activation_checkpointing=False), True),
    (2, 4, 1, {"chunked_loss": False, "tiled_mlp": False, "activation_checkpointing": False,
               "offload_activations": False, "tile_mib": 128}, False),  # all off: still the SP loss, unchunked
]


def train_with_features(tmp_dir: str, stage: int, u: int, r: int, memory: dict, use_labels: bool) -> tuple:
    """On every rank: ds_usp.initialize with the memory keys, 5 steps through ``engine(...).loss``."""
    import torch.distributed as dist

    import ds_usp

    ds_usp.hf.register_usp_attention()
    cfg = _ds_config(stage, u * r, u, r, "zigzag")
    cfg["usp"].update(memory)
    if stage == 3:  # partition every parameter, lm_head included (small ones would otherwise stay whole)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = f"{tmp_dir}/mem_{stage}_{u}x{r}_{dist.get_rank()}.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    model = _llama("usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=path)
    topo = engine.usp.topo
    losses, plans = [], []
    for step in range(STEPS):
        batch = _batch(step)
        shard = ds_usp.shard_batch(batch, topo, layout=engine.usp.layout)
        kwargs = {"shift_labels": shard["shift_labels"]}
        if use_labels:  # this rank's shard of the unshifted labels; ds-usp shifts them over the whole sequence
            kwargs = {"labels": ds_usp.shard_sequence(batch["labels"], topo, dim=1, layout=engine.usp.layout,
                                                      pad_value=-100)}
        if stage == 3 and step == 0:  # an evaluation first: ZeRO-3's prefetching then differs between a
            with torch.no_grad():     # checkpointed layer's forward and its recomputation
                engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"], **kwargs)
        out = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"], **kwargs)
        assert out.logits is None
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss))  # the whole sequence's loss on every rank
        plans.append(engine.usp.memory.choices)
    if stage == 3 and memory["tiled_mlp"]:  # gathered once per block call, not per Linear per tile
        from deepspeed.utils import z3_leaf_module

        assert all(z3_leaf_module(layer.mlp) for layer in engine.module.model.layers)
    plan = plans[-1]
    assert bool(plan.loss_chunk) == memory["chunked_loss"] and bool(plan.mlp_tiles) == memory["tiled_mlp"]
    assert plan.checkpoint == (memory["activation_checkpointing"] or "")
    return losses, _params(engine, stage), plan


@pytest.fixture(scope="module")
def single_process():
    return reference(1)


@pytest.mark.parametrize("stage,u,r,memory,use_labels", CASES,
                         ids=[f"zero{s}-{u}x{r}-{m['activation_checkpointing']}-tile{m['tile_mib']}"
                              f"{'-labels' if lab else ''}" for s, u, r, m, lab in CASES])
def test_features_on_equal_single_process(world4, tmp_path_factory, single_process, stage, u, r, memory, use_labels):
    results = world4.run(train_with_features, str(tmp_path_factory.mktemp("mem")), stage, u, r, memory, use_labels)
    for rank in range(4):
        assert results[rank][0] == results[0][0]  # every rank reports the same (whole-sequence) loss
    _compare(results[0][:2], single_process, f"ZeRO-{stage} {u}x{r} {memory}")
    plan = results[0][2]
    # the chunked loss takes its gradients in the forward (the same memory as recomputing them, one matmul less);
    # usp.tile_mib caps its chunk: 0.01 MiB is 20 rows at vocab 128, several chunks per rank
    assert plan.loss_grad_in_forward
    if memory["chunked_loss"]:
        cap = int(memory["tile_mib"] * 2 ** 20 // (VOCAB * 4))
        assert min(plan.loss_chunk, plan.tokens) == min(plan.tokens, cap), plan


# ---------------------------------------------------------------------------------------- memory


def test_chunked_loss_peaks_below_half_of_whole_logits():
    import torch.nn.functional as F

    from ds_usp.integration.step.loss import chunked_lm_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 32000, bias=False)
    hidden = torch.randn(1, 4096, 64, requires_grad=True)
    labels = torch.randint(0, 32000, (1, 4096))

    def whole() -> None:
        F.cross_entropy(head(hidden).float().view(-1, 32000), labels.view(-1)).backward()

    def chunked() -> None:  # 128 MiB of fp32 logits per chunk: 1048 tokens
        chunked_lm_loss(hidden, head, labels, None, chunk=1048, grad_in_forward=False).backward()

    whole()  # warm up both paths once (first-call allocations)
    chunked()
    w, c = peak_growth(whole), peak_growth(chunked)
    assert c < 0.5 * w, f"chunked loss peak {c / 2**20:.0f} MiB vs whole logits {w / 2**20:.0f} MiB"


@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grads-in-forward", "recomputed"])
def test_chunked_loss_in_bf16_peaks_within_what_the_planner_predicts(grad_in_forward):
    """The cost model's loss bytes (what ``"auto"`` plans a chunk size into) hold the chunked loss's real peak in a
    2-byte dtype, and not by much: in bf16 a chunk holds its fp32 logits and, beside them, the matmul's bf16 output
    or the bf16 gradient (6 bytes per row and vocabulary entry). A model counting only the fp32 logits chose 32768-row
    chunks at 128K tokens on an H200 whose bf16 gradient then did not fit (docs/benchmarks.md)."""
    from ds_usp.cost import Calibration, Hardware, ModelShape, _Pricer
    from ds_usp.integration.step.loss import chunked_lm_loss

    tokens, hidden_size, vocab, chunk = 4096, 8, 32000, 1024  # narrow: bf16 matmuls are slow on CPU
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(torch.bfloat16)
    hidden = torch.randn(1, tokens, hidden_size, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))

    def run() -> None:
        chunked_lm_loss(hidden, head, labels, None, chunk=chunk, grad_in_forward=grad_in_forward).backward()
        hidden.grad = head.weight.grad = None

    run()  # warm-up
    measured = peak_growth(run)
    shape = ModelShape("toy", hidden=hidden_size, attention_layers=1, heads=1, kv_heads=1, head_dim=64,
                       v_head_dim=64, vocab=vocab, mlp_width=256, params=0, active_params=0)
    predicted = _Pricer(shape, tokens, 2, 0.0, 0.0, Hardware(), Calibration()).loss(chunk)
    assert measured <= predicted <= 1.3 * measured, (measured / 2**20, predicted / 2**20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tiled_mlp_peaks_within_what_the_planner_predicts(dtype):
    """One tile of a gated MLP (forward and backward, as a tiled block's backward recomputes it) holds at most
    :data:`ds_usp.cost.MLP_LIVE` tokens x intermediate tensors, and not by much. Measured in a fresh interpreter
    (7.1-7.2 there): inside this suite's process the heap's state added up to one more (8.2)."""
    import subprocess
    import sys

    from ds_usp.cost import MLP_LIVE

    code = f"""
import torch
from ds_usp.instruments.meters import peak_growth
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP
from ds_usp.integration.step.tiling import gated_parts, tiled_mlp
tokens, width, dtype = 4096, 4096, torch.{str(dtype).split('.')[-1]}
torch.manual_seed(0)
mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=width, num_attention_heads=4,
                                num_key_value_heads=4)).to(dtype)  # narrow: bf16 matmuls are slow on CPU
x = torch.randn(1, tokens, 16, dtype=dtype, requires_grad=True)
parts = gated_parts(mlp, mlp.forward)
assert parts is not None
def run():
    y = tiled_mlp(x, mlp.forward, 1, tuple(mlp.parameters()), parts)
    y.backward(torch.ones_like(y))
run(); run()  # gradients allocated: the steady state
print(peak_growth(run) / (tokens * width * x.element_size()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = float(out.stdout.split()[-1])
    assert 0.75 * MLP_LIVE <= measured <= MLP_LIVE, measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_cross_entropy(dtype):
    """Value and gradients (hidden, weight, bias) of the chunked loss against autograd through the whole logits, for
    both gradient paths, a chunk that does not divide the tokens and ignored labels; a loss scaled after the fact
    (the backward multiplies by the incoming gradient in place); a second backward through gradients taken in the
    forward is refused, not silently scaled twice."""
    import torch.nn.functional as F

    from ds_usp.integration.step.loss import chunked_lm_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(48, 500, bias=True).to(dtype)
    hidden = torch.randn(2, 37, 48, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 500, (2, 37))
    labels[0, :5] = -100
    ref = 3.0 * F.cross_entropy(head(hidden).float().view(-1, 500), labels.view(-1), ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, (hidden, head.weight, head.bias))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for grad_in_forward in (True, False):
        for chunk in (1, 10, 256):
            loss = 3.0 * chunked_lm_loss(hidden, head, labels, None, chunk=chunk, grad_in_forward=grad_in_forward)
            grads = torch.autograd.grad(loss, (hidden, head.weight, head.bias), retain_graph=True)
            assert abs(float(loss.detach()) - float(ref.detach())) < tol * float(ref)
            for g, r in zip(grads, ref_grads):
                assert float((g.float() - r.float()).abs().max()) <= tol * float(r.float().abs().max()), (
                    grad_in_forward, chunk)
            if grad_in_forward:
                with pytest.raises(RuntimeError, match="second backward"):
                    torch.autograd.grad(loss, hidden)


def test_tiled_mlp_peaks_below_half_of_untiled():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from ds_usp.integration.step.tiling import TiledMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=8192))
    x = torch.randn(1, 4096, 64, requires_grad=True)
    dout = torch.randn(1, 4096, 64)
    mlp(x).backward(dout)
    whole_grad = x.grad.clone()
    x.grad = None
    TiledMLP.apply(x, mlp.forward, 8, ()).backward(dout)
    torch.testing.assert_close(x.grad, whole_grad, rtol=1e-5, atol=1e-6)

    w = peak_growth(lambda: mlp(x).backward(dout))
    t = peak_growth(lambda: TiledMLP.apply(x, mlp.forward, 8, ()).backward(dout))
    assert t < 0.5 * w, f"tiled MLP peak {t / 2**20:.0f} MiB vs untiled {w / 2**20:.0f} MiB"


def checkpointing_peaks(seq: int = 2048) -> tuple[int, int]:
    """On every rank (2x2): one forward+backward of a 6-layer Llama, without and with selective checkpointing (the
    ratio measured 0.25-0.33 at S = 2048, 4096 and 8192 alike; 2048 takes a quarter of 8192's time)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ds_usp
    from ds_usp.integration.models.attention import USPContext, attach
    from ds_usp.integration.step.forward import MemorySettings, apply

    ds_usp.hf.register_usp_attention()
    topo = ds_usp.USPTopology.build(2, 2)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    shard = ds_usp.shard_batch({"input_ids": ids}, topo)
    peaks = []
    for ckpt in (False, "selective"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="usp")
        attach(model, USPContext(topo=topo, layout="zigzag"))
        apply(model, MemorySettings(chunked_loss=True, tiled_mlp=False, activation_checkpointing=ckpt,
                                    offload_activations=False), topo, "zigzag", zero3=False)

        def step() -> None:
            model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                  shift_labels=shard["shift_labels"]).loss.backward()

        step()  # warm-up: first-call allocations
        peaks.append(peak_growth(step))
    return peaks[0], peaks[1]


def test_checkpointing_peaks_below_six_tenths(world4):
    for off, on in world4.run(checkpointing_peaks):
        assert on < 0.6 * off, f"checkpointed peak {on / 2**20:.0f} MiB vs {off / 2**20:.0f} MiB without"


def mlp_passes(family: str) -> tuple[int, int, float]:
    """On every rank (2x2): one step of a 2-layer model with selective checkpointing and a tiled MLP; how many times
    a layer's ``down_proj`` ran its forward, the tiles, and the largest relative gradient difference from the same step
    with neither."""
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    import ds_usp
    from ds_usp.integration.models.attention import USPContext, attach
    from ds_usp.integration.step.forward import MemorySettings, apply

    ds_usp.hf.register_usp_attention()
    topo = ds_usp.USPTopology.build(2, 2)
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    cfg = LlamaConfig(**base) if family == "llama" else Gemma2Config(**base, head_dim=16)
    ids = torch.randint(0, 128, (1, 1024), generator=torch.Generator().manual_seed(0))
    shard = ds_usp.shard_batch({"input_ids": ids}, topo)
    runs = []
    for on in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="usp")
        attach(model, USPContext(topo=topo, layout="zigzag"))
        ctx = apply(model, MemorySettings(chunked_loss=True, tiled_mlp=on, activation_checkpointing=on and "selective",
                                          offload_activations=False, tile_mib=0.05), topo, "zigzag", zero3=False)
        calls = [0]
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
              shift_labels=shard["shift_labels"]).loss.backward()
        runs.append((calls[0], ctx.choices.mlp_tiles, {n: p.grad for n, p in model.named_parameters()}))
    (_, _, want), (passes, tiles, got) = runs
    err = max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n in want)
    return passes, tiles, err


def test_checkpoint_recompute_does_not_run_the_tiled_mlp_again(world4):
    """``down_proj``'s forward runs once per tile in a Llama step: in the forward. A checkpointed Llama layer's
    recomputation stops once the tiled MLP's input is back (the first version saved it only after every tile had run
    again), and a gated MLP's tiled backward recomputes ``gate`` and ``up`` only (11 matmuls per tile, not 12).
    Gemma 2 runs it twice per tile (its post-feed-forward norm saves the MLP's output, which the recomputation must
    rebuild); both exact."""
    for family, want in (("llama", 1), ("gemma2", 2)):
        for passes, tiles, err in world4.run(mlp_passes, family):
            assert tiles > 1 and passes == want * tiles, f"{family}: {passes} down_proj calls for {tiles} tiles"
            assert err < 1e-5, f"{family}: gradients differ by {err:.2e} (relative)"


def test_only_dense_mlp_blocks_become_zero3_leaves():
    """Under ZeRO-3 with the tiled MLP a dense block is a ZeRO-3 leaf (its weights gathered once per call: at world
    size 1 with 24 tiles, 113 fetches a step instead of 1265, the same losses); an MoE block is not (a leaf would
    gather every expert at once)."""
    from transformers import LlamaConfig, MixtralConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from ds_usp.integration.step.forward import _has_experts

    base = dict(hidden_size=32, intermediate_size=64)
    assert not _has_experts(LlamaMLP(LlamaConfig(**base)))
    assert _has_experts(MixtralSparseMoeBlock(MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2)))


def test_auto_takes_the_fastest_features_that_fit_the_budget():
    """``"auto"``: nothing when the step fits the rank's memory; as the budget shrinks, the chunked loss first (rows a
    multiple of 128, as many as fit), then tiles and checkpointing of only as many layers as needed; the choice fits
    the budget it was given and ``false`` keeps a feature off. The budget is ``usp.memory_gib`` (on CPU, where the
    host's memory would otherwise decide), less the model's states (the rank is told it holds nothing else); a
    ``usp.memory_gib`` that no plan fits is refused by name, with the memory the smallest plan needs."""
    from ds_usp.config import USPSettings
    from ds_usp.cost import GIB, ModelShape, StepSettings, model_state_memory
    from ds_usp.integration.step.choices import HEADROOM, MemoryBudgetError, MemoryContext

    shape = ModelShape("toy", hidden=256, attention_layers=4, heads=4, kv_heads=4, head_dim=64, v_head_dim=64,
                       vocab=32000, mlp_width=896, params=20_000_000, active_params=12_000_000)
    step = StepSettings(1, 1, 1, 2)
    states = sum(model_state_memory(shape, step, 4))

    def plan(tokens: int, gib: float, **settings):
        ctx = MemoryContext(settings=USPSettings(memory_gib=gib, **settings), fallback_topo=_one_rank(), layout="zigzag",
                            hidden=256, intermediate=896, vocab=32000, layers=4, zero3=False, shape=shape, step=step,
                            held=0.0)
        return ctx.make_choices(tokens, torch.device("cpu"), torch.float32)

    roomy = plan(4096, 64.0)
    assert (roomy.loss_chunk, roomy.mlp_tiles, roomy.checkpoint, roomy.offload) == (0, 0, "", False)
    previous = None
    for gib in (2.0, 1.2, 0.9, 0.75):  # less and less room beside the model's states
        got = plan(16384, gib)
        budget = HEADROOM * (gib * GIB - states)
        assert got.budget == pytest.approx(budget) and got.predicted <= budget, (gib, got)
        assert got.loss_chunk % 128 == 0 and got.loss_chunk > 0, got  # the whole fp32 logits never fit here
        assert not got.offload  # CPU: no host to offload to
        if previous is not None:
            assert got.seconds >= previous.seconds and got.predicted <= previous.predicted + 1e-6 * GIB, (previous, got)
        previous = got
    assert previous.checkpoint and 0 < previous.checkpoint_layers <= 4 and previous.mlp_tiles > 0, previous
    with pytest.raises(MemoryBudgetError, match=r"usp.memory_gib \(0.5\) is too small .* full checkpointing of "
                       r"4/4 layers.* Set usp.memory_gib to at least ([0-9.]+)") as refused:
        plan(16384, 0.5)  # nothing fits; the plan that holds least checkpoints every layer fully
    need = float(refused.value.args[0].split("at least ")[1].split(",")[0])
    least = plan(16384, need)  # the least memory_gib the refusal names fits
    assert least.predicted <= least.budget and least.checkpoint_layers == 4, least
    with pytest.raises(MemoryBudgetError):
        plan(16384, need - 0.01)
    offs = dict(chunked_loss=False, tiled_mlp=False, activation_checkpointing=False, offload_activations=False)
    off = plan(16384, 64.0, **offs)
    assert (off.loss_chunk, off.mlp_tiles, off.checkpoint, off.offload) == (0, 0, "", False)
    with pytest.raises(MemoryBudgetError, match="whole logits, MLP whole, no checkpointing"):
        plan(16384, need, **offs)  # what fits with the features is refused when the keys turn them off
    forced = plan(4096, 64.0, activation_checkpointing="full", tiled_mlp=True)
    assert forced.checkpoint == "full" and forced.checkpoint_layers == 4 and forced.mlp_tiles >= 1


def test_without_memory_gib_the_budget_is_the_device_memory(monkeypatch):
    """Without ``usp.memory_gib`` the rank's memory is the device's: a GPU's total memory (its properties read once,
    at the first call), on CPU the host's available memory; the budget is the headroom of it beside the model's
    states, as with a given ``usp.memory_gib`` of the same size. One process, no world: the GPU is a stand-in of
    ``torch.cuda.get_device_properties`` (the rank is told it holds nothing else, so nothing else is read)."""
    import types

    from ds_usp.config import USPSettings
    from ds_usp.cost import GIB, HEADROOM, ModelShape, StepSettings, model_state_memory
    from ds_usp.integration.step import choices as chosen

    shape = ModelShape("toy", hidden=256, attention_layers=4, heads=4, kv_heads=4, head_dim=64, v_head_dim=64,
                       vocab=32000, mlp_width=896, params=20_000_000, active_params=12_000_000)
    step = StepSettings(1, 1, 1, 2)
    states = sum(model_state_memory(shape, step, 4))
    read = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: read.append(device) or types.SimpleNamespace(total_memory=int(80 * GIB)))
    monkeypatch.setattr(chosen, "host_memory_per_rank", lambda: 24 * GIB)

    def budget(device: str, **settings) -> float:
        ctx = chosen.MemoryContext(settings=USPSettings(**settings), fallback_topo=_one_rank(), layout="zigzag",
                                   hidden=256, intermediate=896, vocab=32000, layers=4, zero3=False, shape=shape,
                                   step=step, held=0.0)
        got = ctx.make_choices(4096, torch.device(device), torch.float32)
        ctx.make_choices(8192, torch.device(device), torch.float32)
        return got.budget

    device = budget("cuda")
    assert device == pytest.approx(HEADROOM * (80 * GIB - states))  # the GPU's 80 GiB
    assert len(read) == 1  # read at the first call only
    assert budget("cuda", memory_gib=20.0) == pytest.approx(HEADROOM * (20 * GIB - states))  # a given one wins
    assert len(read) == 1  # and reads no device
    assert budget("cuda", memory_gib=80.0) == pytest.approx(device)  # the device's memory, as if it were given
    assert budget("cpu") == pytest.approx(HEADROOM * (24 * GIB - states))  # CPU: the host's available memory


def _one_rank():
    """A topology stand-in for one rank (the planner reads its degrees)."""
    import types

    return types.SimpleNamespace(ulysses_degree=1, ring_degree=1, sp_size=1, dp_size=1, sp_dp_group=None)


ABOVE_THE_FLOOR_MIB = 48  # the tight budget: this much over the least the refusal names (resident sets move a little)


def steps_within_budget(over_mib: list[Optional[float]]) -> list[tuple]:
    """On every rank (2x2, ZeRO-2, AdamW): for each of ``over_mib``, ``usp.memory_gib`` = the ranks' largest resident
    set before ``ds_usp.initialize`` plus that many MiB (None: the least ``usp.memory_gib`` the last refusal named,
    plus :data:`ABOVE_THE_FLOOR_MIB`), and the first step (the optimizer's states are made in it) at S = 4096 of a
    Llama with vocab 32000. Per budget: the features chosen (or the refusal), the budget and the rank's high-water
    mark over the step, in GiB."""
    import ctypes
    import gc

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ds_usp
    from ds_usp.integration.step.choices import MemoryBudgetError, resident_bytes

    ds_usp.hf.register_usp_attention()
    ids = torch.randint(0, 32000, (1, 4096), generator=torch.Generator().manual_seed(0))
    out = []
    for over in over_mib:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rss = torch.tensor([resident_bytes()], dtype=torch.float64)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)  # one config on every rank: the largest resident set
        cfg = dict(_ds_config(2, 4, 2, 2, "zigzag"), optimizer={"type": "AdamW", "params": {"lr": 1e-4}})
        if over is None:  # just above the floor the refusal named (the cost model's, whatever its constants)
            floor = torch.tensor([float(re.search(r"Set usp.memory_gib to at least ([0-9.]+),", out[-1][0])[1])],
                                 dtype=torch.float64)
            dist.all_reduce(floor, op=dist.ReduceOp.MAX)  # one config on every rank
            budget = float(floor) + ABOVE_THE_FLOOR_MIB / 1024
        else:
            budget = (float(rss) + over * 2 ** 20) / 2 ** 30
        cfg["usp"]["memory_gib"] = budget
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=32000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096), attn_implementation="usp", dtype=torch.float32)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark from here: the engine and its first step
        engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        shard = ds_usp.shard_batch({"input_ids": ids}, engine.usp.topo, layout=engine.usp.layout)
        try:
            engine.backward(engine(**{k: shard[k] for k in ("input_ids", "position_ids", "shift_labels")}).loss)
            engine.step()
            with open("/proc/self/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            out.append((engine.usp.memory.choices.describe(2), budget, hwm / 2 ** 30))
        except MemoryBudgetError as e:
            out.append((str(e), budget, None))
        engine.destroy()
        del engine, model
        dist.barrier()
    return out


def test_a_given_memory_gib_bounds_the_rank_peak_or_is_refused():
    """``usp.memory_gib`` holds the rank's whole resident peak (interpreter, model, optimizer and the first step), at
    two budgets where ``"auto"`` chooses differently; a budget no plan fits is refused by name on every rank (they
    agree on the budget first, so none waits for another), with the least ``usp.memory_gib`` that fits. In ranks of
    their own: a budget on CPU fixes glibc's mmap threshold for the process's life (``bound_host_heap``), which the
    shared world's later cases should not inherit, and a fresh heap measures cleanly."""
    from dist_harness import World

    world = World(4)
    try:
        results = world.run(steps_within_budget, [400.0, 1.0, None])
    finally:
        world.close()
    for rank, ((roomy, roomy_gib, roomy_peak), (none, none_gib, _), (tight, tight_gib, tight_peak)) in enumerate(
            results):
        assert roomy_peak <= roomy_gib and tight_peak <= tight_gib, (rank, roomy_peak, roomy_gib, tight_peak, tight_gib)
        assert roomy != tight, (roomy, tight)  # the tight budget takes features the roomy one does not need
        want = re.search(r"usp.memory_gib \([0-9.]+\) is too small .* Set usp.memory_gib to at least ([0-9.]+),", none)
        assert want and none_gib < float(want[1]) <= tight_gib, none
