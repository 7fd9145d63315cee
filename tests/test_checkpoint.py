"""Save at step 2 and resume: the remaining steps reproduce the uninterrupted run, on the same or another layout.

One uninterrupted run per ZeRO stage (1, 2, 3) trains a tiny HF Llama for 5 optimizer steps at
(U, R, dp) = (2, 2, 1) and saves with ``engine.save_checkpoint`` after step 2. Fresh engines
(``ds_usp.initialize`` + load) then run steps 3..5:

* same layout: every loss and every parameter after step 5 are bitwise equal (``==``,
  ``torch.equal``) to the uninterrupted run's, for ZeRO-1, 2 and 3;
* the test is sensitive: resuming without the optimizer state, without the lr scheduler state, or
  with the data restarted from the first sample changes the losses (ZeRO-1, checked every run);
* another layout of the same 4 ranks, (1, 4, 1) and (2, 1, 2), loads the plain checkpoint as it
  is (ZeRO partitions over all sequence x data-parallel ranks in every layout); losses and
  parameters agree within rtol 1e-5 / atol 1e-6: the attention is split differently, so fp32 sums are rounded
  differently (measured: at most 1 ulp of the loss, ~5e-7 at a loss of 4.85), while a missing
  optimizer or scheduler state moves them by far more (see the sensitivity test);
* DeepSpeed's universal checkpoint (``python -m ds_usp.checkpoint to-universal``) resumes too,
  also on 2 ranks instead of 4 (ZeRO-1 and ZeRO-3); a plain checkpoint on 2 ranks, or a ZeRO-1 checkpoint
  under ZeRO-3, is refused with a message that says what to do.

The global batch is 2 sequences per optimizer step in every layout (gradient accumulation 2 with
one replica, 1 with two), and optimizer step ``s`` always sees samples ``2s`` and ``2s + 1``; the
resumed run takes ``s`` from the restored ``engine.global_steps``. Adam (torch) with a linear
warmup schedule and gradient clipping at 1.0; fp32.
"""
from __future__ import annotations

import os

import pytest
import torch

from test_training import VOCAB, _llama, _params

SEQ, GLOBAL_BATCH, SAVE_AT, STEPS = 64, 2, 2, 5
SAVED = (2, 2, 1)  # (U, R, dp) of the uninterrupted runs
TOL = dict(rtol=1e-5, atol=1e-6)
MUTATIONS = ("optimizer", "lr_scheduler", "data_order")


def _batch(index: int) -> dict:
    g = torch.Generator().manual_seed(3000 + index)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[:, : 10 + 3 * (index % 4)] = -100  # targets fall unevenly over the ranks
    return {"input_ids": ids, "labels": labels}


def _ds_config(stage: int, u: int, r: int, dp: int, universal: bool = False, node_local: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GLOBAL_BATCH // dp,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 5, "warmup_type": "linear"}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "sequence_parallel": "usp", "sequence_parallel_size": u * r,
           "usp": {"ulysses_degree": u, "ring_degree": r, "layout": "zigzag", "native_op": False}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if node_local:  # each node's first rank writes the model file too (ZeRO-1/2 save it from rank 0 only)
        cfg["checkpoint"] = {"use_node_local_storage": True}
    return cfg


def _engine(stage: int, u: int, r: int, dp: int, universal: bool = False, node_local: bool = False):
    import ds_usp

    ds_usp.hf.register_usp_attention()
    model = _llama("usp")
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(),
                                   config=_ds_config(stage, u, r, dp, universal, node_local))
    topo = engine.usp.topo
    assert (topo.ulysses_degree, topo.ring_degree, topo.dp_size) == (u, r, dp)
    return engine


def train(ckpt_dir: str, stage: int, u: int, r: int, dp: int, *, save: bool = False, resume: str = "",
          universal: bool = False, mutate: str = "", async_save: bool = False,
          node_local: bool = False) -> tuple[dict, dict]:
    """On every rank: train to step STEPS, from scratch or resumed from ``ckpt_dir``.

    Args:
        resume: "" (from scratch), "engine" (``engine.load_checkpoint``) or "helper"
            (``ds_usp.checkpoint.load_checkpoint``, which checks the checkpoint first).
        mutate: one of MUTATIONS: drop that part of the state on resume (to show the test notices).
        async_save: save with ``async_save=True``, each file's write held back 1.5 s so that later steps run (and
            change the parameters and optimizer state) while the save is still being written; the save must
            return before its manifest exists.
        node_local: DeepSpeed's ``checkpoint.use_node_local_storage`` (each node's first rank writes the model file).

    Returns:
        ``({step: loss}, params after the last step)``; the loss is the global batch's mean.
    """
    import torch.distributed as dist

    import ds_usp
    from ds_usp.checkpoint import load_checkpoint

    engine = _engine(stage, u, r, dp, universal, node_local)
    topo = engine.usp.topo
    first = 0
    if resume:
        kwargs = {"load_optimizer_states": mutate != "optimizer", "load_lr_scheduler_states": mutate != "lr_scheduler"}
        if resume == "helper":
            path, _ = load_checkpoint(engine, ckpt_dir, **kwargs)
        else:
            path, _ = engine.load_checkpoint(ckpt_dir, **kwargs)
        assert path is not None and engine.global_steps == SAVE_AT
        first = engine.global_steps if mutate != "data_order" else 0
    gas = engine.gradient_accumulation_steps()
    assert gas * dp == GLOBAL_BATCH
    losses = {}
    while engine.global_steps < STEPS:
        step = engine.global_steps
        total = 0.0
        for micro in range(gas):
            sample = (step - SAVE_AT + first if resume else step) * GLOBAL_BATCH + micro * dp + topo.dp_rank
            shard = ds_usp.shard_batch(_batch(sample), topo, layout=engine.usp.layout)
            logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss = ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo)
            engine.backward(loss)
            engine.step()
            total += float(loss)
        value = torch.tensor(total)
        if dp > 1:
            dist.all_reduce(value, group=topo.dp_group)
        losses[step + 1] = float(value) / GLOBAL_BATCH
        if save and engine.global_steps == SAVE_AT:
            if async_save:
                import time

                write = engine.checkpoint_engine.save

                def slow_write(state_dict, path, _write=write):
                    time.sleep(1.5)
                    _write(state_dict, path)

                engine.checkpoint_engine.save = slow_write
                engine.save_checkpoint(ckpt_dir, async_save=True)
                assert not os.path.exists(os.path.join(ckpt_dir, f"global_step{SAVE_AT}", "ds_usp_manifest.json"))
            else:
                engine.save_checkpoint(ckpt_dir)
    if async_save:
        engine.wait_for_checkpoint()
        dist.barrier()  # every rank's wait returned: rank 0's committed too
    return losses, _params(engine, stage)


def resume_error(ckpt_dir: str, stage: int, u: int, r: int, dp: int, universal: bool = False) -> str:
    """On every rank: load through ``ds_usp.checkpoint.load_checkpoint`` and return its refusal ('' if it loaded)."""
    from ds_usp.checkpoint import CheckpointMismatchError, load_checkpoint

    engine = _engine(stage, u, r, dp, universal)
    try:
        load_checkpoint(engine, ckpt_dir)
    except CheckpointMismatchError as e:
        return str(e)
    return ""


def deepspeed_error(ckpt_dir: str, stage: int, u: int, r: int, dp: int) -> str:
    """On every rank: what plain ``engine.load_checkpoint`` raises ('' if it loaded)."""
    engine = _engine(stage, u, r, dp)
    try:
        engine.load_checkpoint(ckpt_dir)
    except Exception as e:  # noqa: BLE001 - whatever DeepSpeed raises is the finding
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.fixture(scope="module")
def saved(world4, tmp_path_factory):
    """``saved(stage)``: (checkpoint dir, {step: loss}, params) of the uninterrupted run, run once per stage."""
    runs = {}

    def get(stage: int):
        if stage not in runs:
            ckpt = str(tmp_path_factory.mktemp(f"zero{stage}") / "checkpoints")
            losses, params = world4.run(train, ckpt, stage, *SAVED, save=True)[0]
            assert sorted(losses) == list(range(1, STEPS + 1))
            runs[stage] = (ckpt, losses, params)
        return runs[stage]

    return get


def _tail(losses: dict) -> list[float]:
    return [losses[s] for s in range(SAVE_AT + 1, STEPS + 1)]


@pytest.mark.parametrize("stage", [1, 2, 3], ids=lambda s: f"zero{s}")
def test_same_layout_resume_is_exact(world4, saved, stage):
    ckpt, losses, params = saved(stage)
    assert sorted(os.listdir(os.path.join(ckpt, f"global_step{SAVE_AT}"))) == sorted(
        [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
        + ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(4)] if stage == 3
           else ["mp_rank_00_model_states.pt"]) + ["ds_usp_manifest.json"])  # one ZeRO partition per rank (sp x dp)
    results = world4.run(train, ckpt, stage, *SAVED, resume="engine")
    for got_losses, got_params in results:
        assert sorted(got_losses) == list(range(SAVE_AT + 1, STEPS + 1))
        assert _tail(got_losses) == _tail(losses), f"ZeRO-{stage}: {got_losses} vs {losses}"
        assert got_params.keys() == params.keys()
        for name in params:
            assert torch.equal(got_params[name], params[name]), f"ZeRO-{stage} {name}"


@pytest.mark.parametrize("stage", [2, 3], ids=lambda s: f"zero{s}")
def test_an_async_save_taken_while_training_goes_on_resumes_exactly(world4, saved, tmp_path, stage):
    """``save_checkpoint(..., async_save=True)`` at step 2 returns before its files are written; steps 3-5 run while
    they are (each write held back); the checkpoint it leaves resumes to the blocking run's losses and parameters
    bitwise: the files hold step 2's state, not a later one."""
    ckpt_dir, losses, params = saved(stage)
    ckpt = str(tmp_path / "checkpoints")
    trained = world4.run(train, ckpt, stage, *SAVED, save=True, async_save=True)
    assert trained[0][0] == losses  # saving asynchronously did not change training
    assert open(os.path.join(ckpt, "latest")).read().strip() == f"global_step{SAVE_AT}"
    assert sorted(os.listdir(os.path.join(ckpt, f"global_step{SAVE_AT}"))) == sorted(
        os.listdir(os.path.join(ckpt_dir, f"global_step{SAVE_AT}")))  # no marker left behind
    for name in os.listdir(os.path.join(ckpt_dir, f"global_step{SAVE_AT}")):  # DeepSpeed's own files, state for state
        if name.endswith(".pt"):
            _same_state(*(torch.load(os.path.join(d, f"global_step{SAVE_AT}", name), weights_only=False)
                          for d in (ckpt, ckpt_dir)), f"ZeRO-{stage} {name}")
    for got_losses, got_params in world4.run(train, ckpt, stage, *SAVED, resume="engine"):
        assert _tail(got_losses) == _tail(losses), f"ZeRO-{stage}: {got_losses} vs {losses}"
        for name in params:
            assert torch.equal(got_params[name], params[name]), f"ZeRO-{stage} {name}"


def async_tag_refusal(ckpt_dir: str) -> str:
    """On every rank: an asynchronous save under a tag of the rank's own (DeepSpeed's own tag check only warns by
    default; an asynchronous save's commit would wait for markers that never come)."""
    import torch.distributed as dist

    engine = _engine(2, *SAVED)
    try:
        engine.save_checkpoint(ckpt_dir, tag=f"step-of-rank{dist.get_rank()}", async_save=True)
    except ValueError as e:
        return str(e)
    return "saved"


def test_an_async_save_under_tags_that_differ_across_ranks_is_refused_on_every_rank(world4, tmp_path):
    for rank, message in enumerate(world4.run(async_tag_refusal, str(tmp_path / "checkpoints"))):
        assert f"the checkpoint tag differs across ranks (this rank: 'step-of-rank{rank}')" in message
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was written


def _same_state(got, want, where: str) -> None:
    """``got`` equals ``want`` (nested state dicts): the same keys and types, tensors of one shape, dtype and values."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want), \
            f"{where}: {got} vs {want}"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} vs {list(want)}"
        for key in want:
            _same_state(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} vs {len(want)} items"
        for i, (a, b) in enumerate(zip(got, want)):
            _same_state(a, b, f"{where}[{i}]")
    elif hasattr(want, "__dict__") and type(want).__eq__ is object.__eq__:  # DeepSpeed's config and loss scaler
        _same_state(vars(got), vars(want), f"{where}.")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


@pytest.mark.parametrize("mutate", MUTATIONS)
def test_the_exact_test_notices_missing_state(world4, saved, mutate):
    ckpt, losses, params = saved(1)
    got_losses, got_params = world4.run(train, ckpt, 1, *SAVED, resume="engine", mutate=mutate)[0]
    # step 3's loss only depends on the restored parameters; the optimizer's and the scheduler's state
    # show from step 4 on (with a restored scheduler the first resumed step still uses the saved lr).
    diffs = [abs(a - b) for a, b in zip(_tail(got_losses), _tail(losses))]
    allowed = [TOL["atol"] + TOL["rtol"] * abs(b) for b in _tail(losses)]  # what another layout may differ by
    assert max(d / a for d, a in zip(diffs, allowed)) > 20, f"{mutate}: {diffs}"
    assert any(not torch.equal(got_params[n], params[n]) for n in params)


CROSS = [(stage, layout) for stage in (1, 2, 3) for layout in ((1, 4, 1), (2, 1, 2))]


def _close(got: tuple[dict, dict], want: tuple[dict, dict], what: str) -> None:
    torch.testing.assert_close(torch.tensor(_tail(got[0])), torch.tensor(_tail(want[0])), **TOL,
                               msg=lambda m: f"{what}: losses {got[0]} vs {want[0]}: {m}")
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **TOL, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("stage,layout", CROSS, ids=[f"zero{s}-{u}x{r}x{dp}" for s, (u, r, dp) in CROSS])
def test_resume_on_another_layout(world4, saved, stage, layout):
    ckpt, losses, params = saved(stage)
    got = world4.run(train, ckpt, stage, *layout, resume="helper")[0]
    _close(got, (losses, params), f"ZeRO-{stage} {SAVED} -> {layout}")


def _universal(ckpt: str) -> str:
    from ds_usp.checkpoint import convert_to_universal, read_checkpoint

    folder = os.path.join(ckpt, f"global_step{SAVE_AT}_universal")
    if not os.path.isdir(folder):
        assert convert_to_universal(ckpt) == folder
    info = read_checkpoint(ckpt, universal=True)
    assert info.universal and info.directory == folder and info.global_steps == SAVE_AT
    return folder


# ZeRO-1 stands for 1/2 (one format); ZeRO-1/2's universal load needs USPMpu's tensor-parallel methods.
UNIVERSAL_STAGES = [1, 3]


@pytest.mark.parametrize("stage", [1, 3], ids=lambda s: f"zero{s}")
def test_plain_checkpoint_is_refused_on_fewer_ranks(world2, saved, stage):
    ckpt, _, _ = saved(stage)
    plain = world2.run(resume_error, ckpt, stage, 2, 1, 1)
    assert "cannot resume on 2 ranks as it is" in plain[0] and "to-universal" in plain[0], plain[0]
    refused = world2.run(deepspeed_error, ckpt, stage, 2, 1, 1)[0]  # DeepSpeed alone refuses too, less helpfully
    assert refused.startswith("ZeRORuntimeException") and "DP world size of 4" in refused, refused


@pytest.mark.parametrize("stage", UNIVERSAL_STAGES, ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("world_name,layout", [("world4", (1, 4, 1)), ("world2", (2, 1, 1))],
                         ids=["another_layout", "fewer_ranks"])
def test_universal_checkpoint_resumes(request, saved, stage, world_name, layout):
    world = request.getfixturevalue(world_name)
    ckpt, losses, params = saved(stage)
    _universal(ckpt)
    got = world.run(train, ckpt, stage, *layout, resume="helper", universal=True)[0]
    _close(got, (losses, params), f"ZeRO-{stage} universal {SAVED} on 4 ranks -> {layout} on {world.world_size} ranks")


def test_incompatible_checkpoint_is_refused(world4, saved):
    ckpt, _, _ = saved(1)
    messages = world4.run(resume_error, ckpt, 3, *SAVED)
    assert len(set(messages)) == 1  # the same message on every rank, before any collective
    assert "ZeRO-1 on 4 ranks (U=2 R=2 dp=1)" in messages[0] and "cannot resume under ZeRO-3" in messages[0]
    assert world4.run(resume_error, ckpt, 2, 1, 2, 2)[0] == ""  # ZeRO-1 and ZeRO-2 share one format


def test_read_and_check_without_a_world(saved, tmp_path):
    from ds_usp.checkpoint import CheckpointMismatchError, check_resume, read_checkpoint

    ckpt, _, _ = saved(1)
    info = read_checkpoint(ckpt)
    assert (info.zero_stage, info.world_size, info.ulysses_degree, info.ring_degree, info.data_parallel_size,
            info.global_batch_size, info.global_steps, info.tag) == (1, 4, 2, 2, 1, GLOBAL_BATCH, SAVE_AT,
                                                                     f"global_step{SAVE_AT}")
    assert check_resume(info, zero_stage=2, world_size=4, global_batch_size=GLOBAL_BATCH) == []
    with pytest.raises(CheckpointMismatchError, match=r"cannot resume on 8 ranks as it is.*to-universal"):
        check_resume(info, zero_stage=1, world_size=8, global_batch_size=GLOBAL_BATCH)
    (note,) = check_resume(info, zero_stage=1, world_size=4, global_batch_size=4)
    assert "global batch of 4 sequences per step instead of 2" in note
    with pytest.raises(FileNotFoundError, match="'latest' is missing"):
        read_checkpoint(str(tmp_path))


# ---- damaged checkpoints (issue 39): named on every rank, the newest complete one loaded instead ------------------

DAMAGES = ("corrupt", "truncated", "missing", "torn_latest")


def damaged_load(ckpt_dir: str, stage: int, damage: str) -> tuple[str, str, int]:
    """On every rank: save a second checkpoint ("later", now ``latest``), damage it, then load with the fallback
    (returns the path loaded) and without (returns the error); and the step the engine resumed at."""
    import torch.distributed as dist

    from ds_usp.checkpoint import load_checkpoint
    from ds_usp.integration.engine.checkpoints import MANIFEST, CheckpointDamaged

    engine = _engine(stage, *SAVED)
    engine.load_checkpoint(ckpt_dir)
    engine.save_checkpoint(ckpt_dir, tag="later")
    later = os.path.join(ckpt_dir, "later")
    kind = "model_states.pt" if stage == 3 else "optim_states.pt"  # ZeRO-3: a rank's shard of the parameters
    victim = os.path.join(later, sorted(f for f in os.listdir(later) if f.endswith(kind))[-1])
    if dist.get_rank() == 0:
        if damage == "corrupt":  # 4 KiB overwritten inside, the size unchanged
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) // 2)
                f.write(os.urandom(4096))
        elif damage == "truncated":
            os.truncate(victim, os.path.getsize(victim) // 2)
        elif damage == "missing":
            os.remove(victim)
        else:  # killed after latest was moved but before the manifest: DeepSpeed's own order
            os.remove(os.path.join(later, MANIFEST))
    dist.barrier()
    fresh = _engine(stage, *SAVED)
    path, _ = load_checkpoint(fresh, ckpt_dir)
    try:
        _engine(stage, *SAVED).load_checkpoint(ckpt_dir, fallback=False)
        refusal = "loaded"
    except CheckpointDamaged as err:
        refusal = str(err)
    return path, refusal, fresh.global_steps


DAMAGE_CASES = [(d, 2) for d in DAMAGES] + [("corrupt", 1), ("truncated", 3)]


@pytest.mark.parametrize("damage,stage", DAMAGE_CASES, ids=[f"{d}-zero{s}" for d, s in DAMAGE_CASES])
def test_a_damaged_latest_is_named_and_the_previous_checkpoint_loads(world4, saved, tmp_path, damage, stage):
    import shutil

    ckpt = str(tmp_path / "checkpoints")
    shutil.copytree(saved(stage)[0], ckpt)
    results = world4.run(damaged_load, ckpt, stage, damage)
    words = {"corrupt": "SHA-256", "truncated": "expected", "missing": "missing", "torn_latest": "did not complete"}
    for path, refusal, step in results:
        assert f"/global_step{SAVE_AT}/" in path and step == SAVE_AT, path
        assert words[damage] in refusal and os.path.join(ckpt, "later") in refusal, refusal
    assert len({r[1] for r in results}) == 1  # the same message on every rank


# ---- a rank killed at each point of a save ---------------------------------------------------------------------------

CRASHES = [("before_files", 1), ("during_files", 2), ("after_files", 3), ("manifest", 2), ("latest", 1)]


@pytest.mark.parametrize("point,stage", CRASHES, ids=[f"{p}-zero{s}" for p, s in CRASHES])
def test_a_save_killed_at_any_point_resumes_from_the_last_complete_checkpoint(world4, saved, tmp_path, point, stage):
    """A 4-rank job resumes from step 2, trains step 3 and has a rank die at ``point`` of saving it
    (tests/save_crash_job.py: before / during / after its files, inside the manifest, before ``latest`` moves); the
    others are then ended, as a launcher ends them (dist_harness.Job). ``latest`` still names step 2, the torn tag has
    no manifest (or, killed before ``latest`` moved, a complete one ``latest`` does not name), and a fresh job resumes
    from step 2 and continues exactly as the uninterrupted run."""
    import shutil

    import save_crash_job
    from dist_harness import Job

    from ds_usp.integration.engine.checkpoints import MANIFEST

    ckpt_dir, losses, params = saved(stage)
    ckpt = str(tmp_path / "checkpoints")
    shutil.copytree(ckpt_dir, ckpt)
    job = Job(save_crash_job.main, ckpt, stage, point, logdir=str(tmp_path))
    codes = job.wait(timeout=600)
    assert save_crash_job.DIED in codes and "completed" not in job.output(), (codes, job.output()[-6000:])
    torn = os.path.join(ckpt, f"global_step{SAVE_AT + 1}")
    assert os.path.isdir(torn), os.listdir(ckpt)  # the save had begun
    assert open(os.path.join(ckpt, "latest")).read().strip() == f"global_step{SAVE_AT}"
    assert os.path.isfile(os.path.join(torn, MANIFEST)) == (point == "latest")
    got = world4.run(train, ckpt, stage, *SAVED, resume="engine")[0]
    torch.testing.assert_close(torch.tensor(_tail(got[0])), torch.tensor(_tail(losses)), **TOL)
    for name, value in params.items():
        torch.testing.assert_close(got[1][name], value, **TOL, msg=lambda m: f"{name}: {m}")
