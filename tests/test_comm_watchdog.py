"""A collective that does not complete within its group's timeout is named on every backend (issue 63 item 4).

On gloo ``Work.wait()`` blocks and raises at the timeout; on NCCL it returns at once (it orders CUDA streams), so an
error raised around ``wait()`` never fires there and NCCL's watchdog ends the job naming only a group number. The
watchdog (:mod:`ds_usp.watchdog`) watches ds-usp's collectives from the host; these tests check, each within seconds:

* a work whose ``wait()`` returns at once and which never completes (NCCL's, faked) is named by the monitor and raised
  by the next ds-usp collective, with the collective, its group's kinds and ranks, the layer and the step; the old
  code's only check, around ``wait()``, says nothing;
* records kept past ``wait()`` are dropped once their collectives have run;
* a main thread stuck where no collective comes (a device sync) is interrupted, then the process aborted;
* a call that hangs while issuing a collective (NCCL setting up the group's communicator in its first collective) or
  creating a group (``dist.new_group``, where NCCL sets it up when the default group is bound to a GPU) is named in the
  log while it hangs, "while being issued" / "while being created", and raised when it returns; the code before
  watched a collective only once its issuing call had returned, and group creation not at all;
* on 4 gloo ranks with rank 3 never joining an SP-group all-reduce: the three ranks that wait raise the named error
  within the timeout, both where ``wait()`` blocks (gloo as it is) and where it returns at once (gloo's works wrapped
  to behave as NCCL's; the code before the watchdog raised nothing there);
* the topology's groups carry ``group_desc`` names; every all-to-all and ring exchange of a HF model's training step
  (2x2, HF checkpointing) knows its layer, forward and backward; a training engine gives the step.
"""
from __future__ import annotations

import time
import weakref

import pytest
import torch

from ds_usp import comm, watchdog
from ds_usp.comm import USPCommError

TIMEOUT_S = 1.5  # the groups' timeout in the 4-rank cases
STOPPED = 3  # the rank that stops
WORLD_TIMEOUT = 60.0


class NcclLikeWork:
    """A work as NCCL's behaves when a peer never comes: ``wait()`` returns at once, it never completes."""

    def __init__(self, inner=None) -> None:
        self.inner, self.waits = inner, 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        return True

    def is_completed(self) -> bool:
        return self.inner is not None and self.inner.is_completed()


class FakeGroup:
    """Stands for a process group (the watchdog knows groups by identity)."""


def _raised_by_next_collective(deadline_s: float, collective) -> tuple[float, str]:
    """Call ``collective`` (a ds-usp collective) until it raises ``USPCommError``: (seconds it took, message)."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        try:
            collective()
        except USPCommError as e:
            return time.monotonic() - start, str(e)
        time.sleep(0.02)
    raise AssertionError(f"no USPCommError within {deadline_s} s; outstanding: {watchdog.outstanding()}")


@pytest.fixture
def context():
    """Layer 5's forward in training step 2; the watchdog left clean."""
    watchdog.set_layer(5)
    watchdog.set_step_source(lambda: 2)
    yield
    watchdog.set_layer(None)
    watchdog.set_step_source(None)


def _next_collective() -> None:
    with comm._named("SP loss all-reduce", None):  # what every ds-usp collective does first
        pass


def test_a_work_whose_wait_returns_at_once_is_named_by_the_monitor(context):
    group, work = FakeGroup(), NcclLikeWork()
    watchdog.name_group(group, ("ring", "dp"), (1, 3), "ds_usp_ring_1+dp_1", 0.5, wait_blocks=False)
    with comm._named("ring send/recv", group):  # the old code's whole check: the wait returns, nothing is raised
        token = watchdog.watch((work,), "ring send/recv", group)
        comm._waited((work,), token, None)
    try:
        assert work.waits == 1 and len(watchdog.outstanding()) == 1
        took, message = _raised_by_next_collective(3.0, _next_collective)
        assert 0.4 <= took <= 1.5, took  # named within one poll interval (0.05 s) of the timeout
        for part in ("the ring send/recv over ranks [1, 3] (the ring / dp group ds_usp_ring_1+dp_1)",
                     "has not completed on rank 0 in layer 5 (forward) of training step 2", "timeout_seconds, is 0.5 s"):
            assert part in message, message
        with pytest.raises(USPCommError, match="ring send/recv"):  # every later collective, while it is outstanding
            _next_collective()
    finally:
        watchdog.forget(token)
    _next_collective()  # gone once forgotten
    assert watchdog.outstanding() == []


def test_a_work_that_runs_after_its_wait_is_dropped(context):
    """Records kept past ``wait()`` go, oldest first, once their collectives have run; so does one whose wait was never
    called (a ring exchange abandoned by an exception)."""
    group = FakeGroup()
    watchdog.name_group(group, ("ulysses",), (0, 1), "ds_usp_ulysses_0", 60.0, wait_blocks=False)
    works = [NcclLikeWork(), NcclLikeWork(), NcclLikeWork()]
    tokens = [watchdog.watch((w,), "Ulysses all-to-all", group) for w in works]
    for work, token in zip(works[:2], tokens):
        comm._waited((work,), token, None)
    assert len(watchdog.outstanding()) == 3
    for work in works:
        work.inner = type("Done", (), {"is_completed": lambda self: True})()
    token = watchdog.watch((NcclLikeWork(),), "Ulysses all-to-all", group)
    watchdog.waited(token)  # drops the three that ran; keeps the new one
    assert len(watchdog.outstanding()) == 1
    watchdog.forget(token)
    assert watchdog.outstanding() == []


def test_a_main_thread_stuck_in_a_device_sync_is_interrupted_then_aborted(context, monkeypatch):
    """SIGINT's handler (``KeyboardInterrupt`` by default) and the abort are recorded instead."""
    import signal

    interrupted: list[float] = []
    aborted: list[float] = []
    monkeypatch.setattr(watchdog, "_abort", lambda: aborted.append(time.monotonic()))
    previous = signal.signal(signal.SIGINT, lambda *args: interrupted.append(time.monotonic()))
    group = FakeGroup()
    watchdog.name_group(group, ("sp", "sp_dp"), (0, 1, 2, 3), "ds_usp_sp_0+sp_dp_0", 0.5, wait_blocks=False)
    start = time.monotonic()
    token = watchdog.watch(None, "SP loss all-reduce", group)  # a call in progress: it never returns
    try:
        while not aborted and time.monotonic() - start < 8:
            time.sleep(0.01)  # stuck: no ds-usp collective comes
    finally:
        watchdog.forget(token)
        signal.signal(signal.SIGINT, previous)
    assert len(interrupted) == 1 and 1.2 <= interrupted[0] - start <= 3.0, interrupted  # named at ~0.5 s, 1 s grace
    assert len(aborted) == 1 and 2.2 <= aborted[0] - start <= 5.0, aborted  # one more grace period


class _Done:
    def is_completed(self) -> bool:
        return True


@pytest.fixture
def hang_log(context, monkeypatch):
    """The watchdog's logged errors as ``(seconds since the fixture, message)``; SIGINT and the abort recorded (none
    may come: the hanging calls below return before the first grace period ends)."""
    import signal

    logged: list[tuple[float, str]] = []
    escalated: list[str] = []
    start = time.monotonic()
    monkeypatch.setattr(watchdog, "log_error", lambda message: logged.append((time.monotonic() - start, message)))
    monkeypatch.setattr(watchdog, "_abort", lambda: escalated.append("abort"))
    previous = signal.signal(signal.SIGINT, lambda *args: escalated.append("interrupt"))
    yield logged
    signal.signal(signal.SIGINT, previous)
    assert escalated == []
    _next_collective()  # drops the named records that have run
    assert watchdog.outstanding() == []


HANG_S = 1.0  # how long the calls below hang, past their 0.5 s timeout


def test_a_collective_whose_issuing_call_hangs_is_named_while_being_issued(hang_log):
    group = FakeGroup()
    watchdog.name_group(group, ("ulysses",), (0, 1), "ds_usp_ulysses_0", 0.5, wait_blocks=False)

    def issue():  # the first collective on an NCCL group sets up its communicator before it returns
        time.sleep(HANG_S)
        return NcclLikeWork(_Done())

    with pytest.raises(USPCommError) as raised:  # the old code: no record until it returned, nothing named or raised
        comm._run("Ulysses all-to-all", group, issue, torch.device("cpu"))
    assert len(hang_log) == 1 and 0.4 <= hang_log[0][0] < HANG_S, hang_log  # logged while the call hangs
    for message in (hang_log[0][1], str(raised.value)):
        for part in (("the Ulysses all-to-all over ranks [0, 1] (the ulysses group ds_usp_ulysses_0) has not completed "
                      "on rank 0 in layer 5 (forward) of training step 2"), "it hung while being issued",
                     "sets up a group's communicator"):
            assert part in message, message
    assert "raised on rank 0 when its call returned" in str(raised.value)


def test_a_group_creation_that_hangs_is_named_while_being_created(hang_log, monkeypatch):
    import datetime

    import torch.distributed as dist

    from ds_usp import topology

    made = object()
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: time.sleep(HANG_S) or made)
    with pytest.raises(USPCommError) as raised:
        topology._new_group((1, 3), ("ring", "dp"), "ds_usp_ring_1+dp_1", 1, timeout=datetime.timedelta(seconds=0.5))
    assert len(hang_log) == 1 and 0.4 <= hang_log[0][0] < HANG_S, hang_log
    for message in (hang_log[0][1], str(raised.value)):
        for part in (("the creation of the process group over ranks [1, 3] (the ring / dp group ds_usp_ring_1+dp_1) "
                      "has not completed"), "it hung while being created (dist.new_group)"):
            assert part in message, message
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: made)  # in time: the group, nothing named
    assert topology._new_group((1, 3), ("ring",), "ds_usp_ring_1", 1, timeout=datetime.timedelta(seconds=0.5)) is made
    assert len(hang_log) == 1


def test_the_default_groups_start_on_a_gpu_is_named_while_being_created(hang_log, monkeypatch):
    """ds_usp.initialize starting distributed on GPUs binds the default group to the rank's GPU, so NCCL sets up the
    world's communicator inside init_process_group: a start that hangs is named like a group's creation."""
    import torch.distributed as dist

    from ds_usp.integration.engine import settings

    started, logged = [], []  # the start's time and arguments; the logged errors' times (not since the fixture: the
    monkeypatch.setattr(watchdog, "log_error", lambda message: logged.append((time.monotonic(), message)))  # import)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(settings, "check_launcher_environment", lambda: None)
    monkeypatch.setattr(settings, "choose_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *args, **kwargs: started.append((time.monotonic(), kwargs)) or time.sleep(HANG_S))
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(USPCommError) as raised:
        settings._start_distributed({"sequence_parallel": "usp", "usp": {"timeout_seconds": 0.5}})
    assert started and started[0][1]["device_id"] == torch.device("cuda", 1)  # it ran, bound, and returned late
    assert len(logged) == 1 and 0.4 <= logged[0][0] - started[0][0] < HANG_S, (logged, started)
    for message in (logged[0][1], str(raised.value)):
        for part in ("the start of the default process group over ranks [0, 1] (the world group default_pg) has not "
                     "completed", "it hung while being created (init_process_group)"):
            assert part in message, message


# ---- 4 gloo ranks, rank 3 stops


def _topology():
    import datetime

    from ds_usp.topology import USPTopology

    return USPTopology.build(2, 2, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def group_descs_on_ranks() -> dict:
    topo = _topology()
    return {kind: getattr(topo, f"{kind}_group").group_desc for kind in ("ulysses", "ring", "sp", "dp", "sp_dp")}


def test_the_topology_names_its_groups(world4):
    assert world4.run(group_descs_on_ranks)[1] == {
        "ulysses": "ds_usp_ulysses_0", "ring": "ds_usp_ring_1", "sp": "ds_usp_sp_0+sp_dp_0", "dp": "ds_usp_dp_1",
        "sp_dp": "ds_usp_sp_0+sp_dp_0"}


def _stop_or_wait(nccl_like: bool):
    """Rank 3 stops (sleeps past the others' errors); the others all-reduce over the SP group in layer 7 of step 4,
    then keep calling a collective of their own: (seconds until the error, message) on each waiting rank."""
    import torch.distributed as dist

    topo = _topology()
    if dist.get_rank() == STOPPED:  # it never calls the collective (it waits in the harness's barrier meanwhile)
        return None
    real = dist.all_reduce
    watchdog.set_layer(7)
    watchdog.set_step_source(lambda: 4)
    if nccl_like:  # the SP group's works behave as NCCL's: wait() returns at once
        info = watchdog.group_info(topo.sp_group)
        watchdog.name_group(topo.sp_group, info.kinds, info.ranks, info.desc, info.timeout_s, wait_blocks=False)
        dist.all_reduce = lambda t, *a, **k: NcclLikeWork(real(t, *a, **{**k, "async_op": True})) \
            if k.get("group") is topo.sp_group else real(t, *a, **k)
    start = time.monotonic()
    try:
        comm.all_reduce_sum_(torch.ones(2), topo.sp_group, "SP loss all-reduce")
        took, message = _raised_by_next_collective(
            TIMEOUT_S + 3.0, lambda: comm.all_reduce_sum_(torch.ones(1), topo.dp_group, "gradient all-reduce"))
        took = time.monotonic() - start
    except USPCommError as e:  # raised by the all-reduce itself: its wait blocked
        took, message = time.monotonic() - start, str(e)
    finally:
        dist.all_reduce = real
        watchdog.set_layer(None)
        watchdog.set_step_source(None)
    left = time.monotonic() + 3.0
    while watchdog.outstanding() and time.monotonic() < left:  # gloo fails the work at its timeout
        watchdog.overdue()
        time.sleep(0.05)
    return took, message, watchdog.outstanding()


@pytest.mark.parametrize("nccl_like", [False, True], ids=["wait_blocks", "wait_returns_at_once"])
def test_every_waiting_rank_names_the_collective_its_group_layer_and_step(world4, nccl_like):
    results = world4.run(_stop_or_wait, nccl_like)
    assert results[STOPPED] is None
    for rank in range(STOPPED):
        took, message, left = results[rank]
        assert TIMEOUT_S - 0.3 <= took <= TIMEOUT_S + 2.0, (rank, took, message)
        for part in ("SP loss all-reduce over ranks [0, 1, 2, 3] (the sp / sp_dp group ds_usp_sp_0+sp_dp_0)",
                     f"on rank {rank} in layer 7 (forward) of training step 4"):
            assert part in message, (rank, message)
        assert left == [], (rank, left)


# ---- where the layer and the step come from


class _Doubled(torch.autograd.Function):
    """``2 x``, recording where the watchdog says collectives run in its forward and backward."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        seen.append(watchdog.where())
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(watchdog.where())
        return 2 * grad, None


def test_the_attention_interface_names_the_layer_in_forward_and_backward():
    from ds_usp.integration.models.attention import _in_layer

    seen: list[str] = []
    attention = _in_layer(lambda module, query: (_Doubled.apply(query, seen), None))
    module = torch.nn.Module()
    module.layer_idx = 4
    query = torch.ones(2, requires_grad=True)
    out, _ = attention(module, query * 1)
    seen.append(watchdog.where())
    out.sum().backward()
    seen.append(watchdog.where())
    assert seen == [" in layer 4 (forward)", "", " in layer 4 (backward)", ""]


def where_hf_collectives_run(family: str = "llama") -> list[str]:
    """A tiny Llama (2 layers, HF checkpointing), or a hybrid model of ``test_linear`` (``family``: its linear layers
    wrapped), on 2x2: where the watchdog says each all-to-all and ring exchange of one training step runs."""
    import torch.distributed as dist

    import ds_usp
    from ds_usp.integration.models.attention import USPContext, attach
    from ds_usp.integration.models.hybrid import wrap_linear_layers
    from dist_harness import get_topo
    from test_training import VOCAB, _llama

    ds_usp.hf.register_usp_attention()
    topo = get_topo(2, 2)
    if family == "llama":
        model = _llama("usp")
    else:
        from test_linear import _config
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="usp", dtype=torch.float32)
    attach(model, USPContext(topo=topo, layout="zigzag"))
    if family != "llama":
        assert wrap_linear_layers(model) > 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seen: list[str] = []
    real = {name: getattr(dist, name) for name in ("all_to_all_single", "batch_isend_irecv")}

    def logged(name):
        return lambda *args, **kwargs: seen.append(f"{name}{watchdog.where()}") or real[name](*args, **kwargs)

    for name in real:
        setattr(dist, name, logged(name))
    try:
        ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
        shard = ds_usp.shard_batch({"input_ids": ids}, topo, layout="zigzag")
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
        ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo).backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return seen


def test_a_hf_models_collectives_name_their_layer(world4):
    for rank, seen in enumerate(world4.run(where_hf_collectives_run)):
        calls = [s for s in seen if s.startswith("all_to_all_single")]
        assert calls[:4] == ["all_to_all_single in layer 0 (forward)"] * 2 + ["all_to_all_single in layer 1 (forward)"] * 2
        backward = [s.split(" in ")[1] for s in seen[4:] if "backward" in s]
        assert backward and backward == sorted(backward, reverse=True), (rank, seen)  # layer 1's backward, then 0's
        assert {"layer 1 (backward)", "layer 0 (backward)"} <= set(backward), (rank, seen)
        assert all(" in layer " in s for s in seen), (rank, seen)  # every exchange knows its layer
    for rank, seen in enumerate(world4.run(where_hf_collectives_run, "qwen3_5_text")):  # linear layers too
        assert seen and all(" in layer " in s for s in seen), (rank, seen)
        assert {"layer 0 (forward)", "layer 0 (backward)"} <= {s.split(" in ")[1] for s in seen}, (rank, seen)


def test_a_layer_named_by_its_path_in_forward_and_backward():
    """A DiT block's attention is named by its module's path (its blocks have no layer index)."""
    seen: list[str] = []
    query = torch.ones(2, requires_grad=True)
    out = watchdog.run_in_layer("transformer_blocks.7.attn", lambda: _Doubled.apply(query * 1, seen), query)
    seen.append(watchdog.where())
    out.sum().backward()
    seen.append(watchdog.where())
    assert seen == [" in transformer_blocks.7.attn (forward)", "", " in transformer_blocks.7.attn (backward)", ""]


def test_the_engine_gives_the_training_step_while_it_lives():
    from ds_usp.integration.engine.initialize import name_steps

    class Engine:
        optimizer, global_steps = object(), 6

    engine = Engine()
    try:
        name_steps(engine)
        assert watchdog.where() == " in training step 7"
        name_steps(type("Inference", (), {"optimizer": None})())  # an engine that does not train changes nothing
        assert watchdog.where() == " in training step 7"
        gone = weakref.ref(engine)
        del engine
        assert gone() is None and watchdog.where() == ""
    finally:
        watchdog.set_step_source(None)
