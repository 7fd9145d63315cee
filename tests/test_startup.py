"""Start-up on a node of several GPUs (issue 63 items 5, 6 and 9).

* Device selection (:func:`ds_usp.integration.engine.preflight.choose_device`): a device the user chose is kept, the
  launcher's local rank (``LOCAL_RANK``, ``SLURM_LOCALID``) chooses otherwise, and a rank that cannot tell its GPU is
  refused by name before any collective. CUDA is faked (``torch.cuda``'s functions and the environment monkeypatched).
* The GPU DeepSpeed's engine sets is the one ds-usp chose: what ``ds_usp.initialize`` passes ``deepspeed.initialize``
  (``args.device_rank``, ``LOCAL_RANK`` filled from ``SLURM_LOCALID``) run through DeepSpeed's own engine methods on a
  stub, and ZeRO-3's reads of ``LOCAL_RANK`` as a GPU pointed at it.
* Ranks per node from SLURM (``SLURM_NTASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE``), and the warning when a Ulysses
  group would cross nodes.
* ``USPTopology.build``: groups over the same ranks are one process group, the kinds over every rank the default group
  (never among what a teardown destroys, and named by its kinds), and each group is warmed up as it is built (one
  all-reduce per distinct group of more than one rank; one batched ring exchange with every peer the ring's forward
  and backward use, through the staged route where it stages), counted on 4 ranks.
* A default group bound to a GPU that is not the launcher's local rank is kept and said, once, before any group.
* ``examples/smoke_topology.py`` on 4 CPU ranks with torch's default device set to ``meta``: every tensor it hands to
  a collective must be on the backend's device (the CPU for gloo), as NCCL requires its GPU.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ds_usp import log
from ds_usp.config import LOCAL_SIZE_VARIABLES, ranks_per_node_and_source
from ds_usp.integration.engine import preflight
from ds_usp.integration.engine.preflight import LOCAL_RANK_VARIABLES, check_same_everywhere, choose_device
from ds_usp.topology import group_ranks, ulysses_across_nodes

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "examples" / "smoke_topology.py"


# ---------------------------------------------------------------- device selection (CUDA faked)


class FakeCuda:
    """``torch.cuda`` as a process on a node of ``count`` GPUs sees it; ``current`` is set by ``set_device``."""

    def __init__(self, monkeypatch, count: int, initialized: bool = False, current: int = 0) -> None:
        self.count, self.initialized, self.current, self.set = count, initialized, current, []
        for name, fn in (("is_available", lambda: True), ("device_count", lambda: self.count),
                         ("is_initialized", lambda: self.initialized), ("current_device", lambda: self.current),
                         ("set_device", self.set_device)):
            monkeypatch.setattr(torch.cuda, name, fn)

    def set_device(self, device) -> None:
        self.current = device.index if isinstance(device, torch.device) else int(device)
        self.initialized = True
        self.set.append(self.current)


@pytest.fixture
def launcher(monkeypatch):
    """No launcher variable set; the test sets the ones it means. Warnings are collected."""
    for var in LOCAL_RANK_VARIABLES + LOCAL_SIZE_VARIABLES + ("WORLD_SIZE", "SLURM_NODEID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    warnings: list[str] = []
    monkeypatch.setattr(preflight, "log_warning", warnings.append)
    monkeypatch.setattr(log, "_SAID", set())  # each test starts with nothing said
    return warnings


def test_cpu_without_cuda(monkeypatch, launcher):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert choose_device() == torch.device("cpu")


def test_the_launchers_local_rank_chooses(monkeypatch, launcher):
    cuda = FakeCuda(monkeypatch, 8)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("SLURM_LOCALID", "5")  # srun without LOCAL_RANK: not GPU 0 on every rank
    assert choose_device() == torch.device("cuda", 5)
    monkeypatch.setenv("LOCAL_RANK", "3")  # a launcher srun started once per node (torchrun) sets its own
    assert choose_device() == torch.device("cuda", 3)
    assert cuda.set == [] and launcher == []  # chosen, not set


def test_a_device_the_user_chose_is_kept(monkeypatch, launcher):
    FakeCuda(monkeypatch, 8, initialized=True, current=2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert choose_device() == torch.device("cuda", 2) and launcher == []
    monkeypatch.setenv("LOCAL_RANK", "5")  # disagrees with the launcher: kept, and said
    assert choose_device() == torch.device("cuda", 2)
    assert len(launcher) == 1 and "cuda:2" in launcher[0] and "LOCAL_RANK" in launcher[0]
    assert "torch.cuda.set_device(5)" in launcher[0]


def test_one_visible_gpu_is_this_ranks(monkeypatch, launcher):
    """One GPU per task (CUDA_VISIBLE_DEVICES of one device): local rank 3 is not 'invalid device ordinal'."""
    FakeCuda(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert choose_device() == torch.device("cuda", 0) and launcher == []


def test_a_local_rank_beyond_the_visible_gpus_is_refused(monkeypatch, launcher):
    FakeCuda(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "6")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=6 but this process sees 4 GPUs "
                                           r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):
        choose_device()


def test_a_missing_local_rank_is_refused_when_ranks_share_the_node(monkeypatch, launcher):
    FakeCuda(monkeypatch, 8)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(RuntimeError, match="none of LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, "
                                           "SLURM_LOCALID is set") as e:
        choose_device()
    assert "torch.cuda.set_device" in str(e.value) and "8 ranks run on its node (no launcher variable)" in str(e.value)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")  # one rank per node: GPU 0 is its own
    assert choose_device() == torch.device("cuda", 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    assert choose_device() == torch.device("cuda", 0)


def test_the_bound_device_wins(monkeypatch, launcher):
    """init_process_group(device_id=...) (DeepSpeed's init_distributed binds one) decides: NCCL uses it."""
    FakeCuda(monkeypatch, 8, initialized=True, current=0)
    monkeypatch.setattr(preflight, "_bound_device", lambda: torch.device("cuda", 6))
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert choose_device() == torch.device("cuda", 6) and launcher == []


def test_a_bound_device_that_is_not_the_local_rank_is_kept_and_said(monkeypatch, launcher):
    """init_process_group(device_id=cuda:6) under LOCAL_RANK=2: NCCL uses cuda:6, so ds-usp keeps it, and says so once
    (ds_usp.initialize asks several times), naming both and what to call."""
    FakeCuda(monkeypatch, 8, initialized=True, current=6)
    monkeypatch.setattr(preflight, "_bound_device", lambda: torch.device("cuda", 6))
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert choose_device() == torch.device("cuda", 6) == choose_device()
    assert len(launcher) == 1, launcher
    for part in ("bound to cuda:6", "local rank 2 (LOCAL_RANK)", "keeps cuda:6",
                 "device_id=torch.device('cuda', 2)"):
        assert part in launcher[0], launcher[0]


def _fake_nccl_world(monkeypatch) -> list:
    """check_same_everywhere's view of a 2-rank NCCL world; returns the list its collective's calls go to."""
    calls: list = []
    monkeypatch.setattr(preflight.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(preflight.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(preflight, "_bound_device", lambda: None)
    monkeypatch.setattr(preflight, "_world_size", lambda: 2)
    monkeypatch.setattr(preflight, "disagreements", lambda facts, group, what: calls.append(what) or {})
    return calls


def test_the_agreement_check_sets_the_chosen_device(monkeypatch, launcher):
    cuda = FakeCuda(monkeypatch, 8)
    calls = _fake_nccl_world(monkeypatch)
    monkeypatch.setenv("SLURM_LOCALID", "1")  # srun, no LOCAL_RANK: GPU 1, not 0
    check_same_everywhere({"x": 1})
    assert cuda.set == [1] and len(calls) == 1


def test_a_rank_that_cannot_tell_its_gpu_fails_before_the_collective(monkeypatch, launcher):
    cuda = FakeCuda(monkeypatch, 8)
    calls = _fake_nccl_world(monkeypatch)
    with pytest.raises(RuntimeError, match="no launcher variable says which rank of the node it is"):
        check_same_everywhere({"x": 1})
    assert cuda.set == [] and calls == []  # no device set, no collective entered


# ---------------------------------------------------------------- the GPU DeepSpeed's engine sets (CUDA faked)


@pytest.fixture
def zero3_untouched(monkeypatch):
    """The ZeRO-3 functions ds_usp.initialize may wrap (:func:`ds_usp.upstream.deepspeed.zero3_on_device`) are put
    back after the test; yields them as they were."""
    from deepspeed.runtime.zero import partition_parameters, utils

    places = ((partition_parameters.Init, "__init__"), (utils, "get_lst_from_rank0"),
              (utils, "assert_lst_len_same_as_other_ranks"))
    originals = {name: getattr(owner, name) for owner, name in places}
    for owner, name in places:
        monkeypatch.setattr(owner, name, originals[name])  # recorded: the test's wrapping is undone
    return originals


def initialize_up_to_deepspeed(monkeypatch, args=None) -> dict:
    """``ds_usp.initialize`` on a data-parallel config (2 ranks), its settings given, with ``deepspeed.initialize``
    replaced by a function that records its arguments; returns them. ``LOCAL_RANK`` is put back afterwards."""
    import os

    from ds_usp.config import load_usp_config
    from ds_usp.integration.engine import initialize as initialize_module
    from ds_usp.integration.engine.settings import Settings

    if "LOCAL_RANK" not in os.environ:  # so that a LOCAL_RANK ds_usp.initialize sets is removed after the test
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.delenv("LOCAL_RANK")
    raw = {"train_micro_batch_size_per_gpu": 1}
    settings = Settings(raw, load_usp_config(raw, 2), 2)
    monkeypatch.setattr(initialize_module, "resolve_settings", lambda source, model: settings)
    monkeypatch.setattr(initialize_module, "wrap_engine", lambda *a: None)
    passed: dict = {}
    monkeypatch.setattr(initialize_module, "deepspeed_initialize",
                        lambda: lambda **kwargs: passed.update(kwargs) or (None, None, None, None))
    initialize_module.initialize(args=args, model=None, config=raw)
    return passed


def deepspeeds_engine_device(monkeypatch, args) -> tuple[list, "object"]:
    """What DeepSpeed's engine does with ``args``: its own ``_do_args_sanity_check``, ``_configure_with_arguments``
    and ``_set_distributed_vars``, run on a stub engine with the accelerator faked as CUDA's. Returns the indices
    it passed to ``set_device`` and the stub (``device``, ``local_rank``)."""
    from types import SimpleNamespace

    from deepspeed.runtime import engine as ds_engine

    set_to: list = []
    accelerator = SimpleNamespace(set_device=set_to.append, device_name=lambda index=None: f"cuda:{index}")
    monkeypatch.setattr(ds_engine, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(ds_engine.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(ds_engine.dist, "get_rank", lambda group=None: 1)
    stub = SimpleNamespace()
    ds_engine.DeepSpeedEngine._do_args_sanity_check(stub, args)
    ds_engine.DeepSpeedEngine._configure_with_arguments(stub, args, None)
    ds_engine.DeepSpeedEngine._set_distributed_vars(stub, args)
    return set_to, stub


def test_the_engine_sets_the_gpu_of_slurms_local_rank(monkeypatch, launcher, zero3_untouched):
    """srun without LOCAL_RANK: DeepSpeed would refuse (it reads LOCAL_RANK only); it is told GPU 1 and local rank 1,
    and the user's own arguments reach it (a --local_rank the launcher never passed is the parser's default)."""
    import argparse
    import os

    from deepspeed.runtime.zero import partition_parameters

    cuda = FakeCuda(monkeypatch, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    mine = argparse.Namespace(local_rank=0, lr=0.5)
    args = initialize_up_to_deepspeed(monkeypatch, mine)["args"]
    assert cuda.set == [1] and os.environ["LOCAL_RANK"] == "1"  # DeepSpeed's variable, from SLURM's
    assert args.lr == 0.5 and args.device_rank == 1
    set_to, engine = deepspeeds_engine_device(monkeypatch, args)
    assert set_to == [1] and engine.device == torch.device("cuda", 1) and engine.local_rank == 1
    assert mine.local_rank == 1 and not hasattr(mine, "device_rank")  # DeepSpeed's write reaches the user's args
    assert partition_parameters.Init.__init__ is zero3_untouched["__init__"]  # LOCAL_RANK is the GPU: no wrapping


def test_the_engine_keeps_the_gpu_the_user_set(monkeypatch, launcher, zero3_untouched):
    """torch.cuda.set_device(1) under LOCAL_RANK=0: ds-usp keeps GPU 1 (with its warning), and so does the engine."""
    FakeCuda(monkeypatch, 2, initialized=True, current=1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = initialize_up_to_deepspeed(monkeypatch)["args"]
    set_to, engine = deepspeeds_engine_device(monkeypatch, args)
    assert set_to == [1] and engine.device == torch.device("cuda", 1) and engine.local_rank == 0
    assert len(launcher) == 1 and "keeps cuda:1" in launcher[0]


def test_the_engine_keeps_a_bound_gpu_and_says_so_before_any_group(monkeypatch, launcher, zero3_untouched):
    """The default group bound to cuda:1 under LOCAL_RANK=0: said (once) where ds_usp.initialize sets the device
    (before it builds any group); the engine uses cuda:1."""
    FakeCuda(monkeypatch, 2, initialized=True, current=1)
    monkeypatch.setattr(preflight, "_bound_device", lambda: torch.device("cuda", 1))
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = initialize_up_to_deepspeed(monkeypatch)["args"]
    set_to, engine = deepspeeds_engine_device(monkeypatch, args)
    assert set_to == [1] and engine.device == torch.device("cuda", 1)
    assert len(launcher) == 1 and "bound to cuda:1" in launcher[0], launcher


def test_the_engine_takes_the_only_visible_gpu(monkeypatch, launcher, zero3_untouched):
    """One GPU per task, LOCAL_RANK=3: the engine sets cuda:0 (not 'invalid device ordinal'), and ZeRO-3's checks
    that read LOCAL_RANK as the GPU (DeepSpeed's own get_lst_from_rank0) build their tensor there too."""
    import os

    from deepspeed.runtime.zero import utils

    FakeCuda(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    args = initialize_up_to_deepspeed(monkeypatch)["args"]
    set_to, engine = deepspeeds_engine_device(monkeypatch, args)
    assert set_to == [0] and engine.device == torch.device("cuda", 0) and engine.local_rank == 3
    named: list = []
    monkeypatch.setattr(utils, "get_accelerator", lambda: type("A", (), {"device_name": lambda self, i: named.append(i)
                                                                        or "cpu"})())
    monkeypatch.setattr(utils.dist, "broadcast", lambda *a, **k: None)
    monkeypatch.setattr(utils.dist, "get_rank", lambda group=None: 0)
    assert utils.get_lst_from_rank0([4, 5]) == [4, 5]
    assert named == ["0"] and os.environ["LOCAL_RANK"] == "3"  # the GPU; LOCAL_RANK itself unchanged


def test_a_device_rank_of_the_users_own_that_disagrees_is_refused(monkeypatch, launcher, zero3_untouched):
    import argparse

    FakeCuda(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"args.device_rank=1 .* cuda:0"):
        initialize_up_to_deepspeed(monkeypatch, argparse.Namespace(device_rank=1))
    assert initialize_up_to_deepspeed(monkeypatch, argparse.Namespace(device_rank=0))["args"].device_rank == 0


# ---------------------------------------------------------------- ranks per node and Ulysses across nodes


@pytest.mark.parametrize("count,local,user,want", [(1, "3", None, 0), (2, "0", 1, 1), (2, "1", None, 1)],
                         ids=["one-visible-gpu-local-rank-3", "user-set-cuda1", "launcher-local-rank"])
def test_the_default_group_is_bound_to_the_chosen_gpu(monkeypatch, launcher, count, local, user, want):
    """Where ds-usp starts distributed itself, the default group is bound to the GPU it chose, not DeepSpeed's
    ``cuda:LOCAL_RANK`` (invalid with one visible GPU and LOCAL_RANK 3; another GPU than the one the user set)."""
    import deepspeed
    import torch.distributed as dist

    from ds_usp.integration.engine import settings

    cuda = FakeCuda(monkeypatch, count, initialized=user is not None, current=user or 0)
    for var, value in (("LOCAL_RANK", local), ("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29999")):
        monkeypatch.setenv(var, value)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(("deepspeed", kw)))
    settings._start_distributed({})
    (backend, kw), (ds, _) = calls
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", want) and ds == "deepspeed", calls
    assert cuda.current == want


def test_ranks_per_node_from_slurm(monkeypatch, launcher):
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2),4")
    assert ranks_per_node_and_source(20) == (8, "SLURM_TASKS_PER_NODE")
    monkeypatch.setenv("SLURM_NODEID", "2")  # this node's entry
    assert ranks_per_node_and_source(20) == (4, "SLURM_TASKS_PER_NODE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    assert ranks_per_node_and_source(20) == (8, "SLURM_NTASKS_PER_NODE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun started by srun on each node: its own count wins
    assert ranks_per_node_and_source(20) == (4, "LOCAL_WORLD_SIZE")
    for var in LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "garbage")
    assert ranks_per_node_and_source(20) == (20, "no launcher variable")


def test_ulysses_across_nodes_is_named(monkeypatch, launcher):
    monkeypatch.setenv("LOCAL_SIZE", "8")
    assert ulysses_across_nodes(group_ranks(8, 2, 16)) is None
    assert ulysses_across_nodes(group_ranks(4, 4, 16)) is None
    message = ulysses_across_nodes(group_ranks(16, 1, 16))
    assert "usp.ulysses_degree=16" in message and "8 ranks per node from LOCAL_SIZE" in message
    assert "usp.ring_degree" in message and "ranks [0, 1, 2, 3, 4, 5, 6, 7, 8" in message
    monkeypatch.setenv("LOCAL_SIZE", "6")  # 4 does not divide 6: ranks 4..7 straddle two nodes
    assert "ranks [4, 5, 6, 7]" in ulysses_across_nodes(group_ranks(4, 1, 12))
    monkeypatch.delenv("LOCAL_SIZE")
    assert ulysses_across_nodes(group_ranks(16, 1, 16)) is None  # one node as far as anyone said


# ---------------------------------------------------------------- groups shared and warmed up (4 gloo ranks)

LAYOUTS = [(2, 2), (2, 1), (1, 2), (1, 4), (4, 1), (1, 1)]
KINDS = ("ulysses", "ring", "sp", "dp", "sp_dp")


def build_and_count(u: int, r: int, local_size: str) -> dict:
    """Build a ``u x r`` topology counting the collectives and group creations it makes; report which kinds share a
    group object and what rank 0 warned."""
    import os

    import torch.distributed as dist

    import ds_usp.topology as topology

    counts = {"new_group": 0, "all_reduce": [], "batch_isend_irecv": 0}
    peers: set = set()
    originals = {name: getattr(dist, name) for name in counts}
    warned: list[str] = []

    def new_group(*args, **kwargs):
        counts["new_group"] += not kwargs.get("use_local_synchronization", False)
        return originals["new_group"](*args, **kwargs)

    def all_reduce(t, *args, **kwargs):
        counts["all_reduce"].append(dist.get_world_size(kwargs.get("group")))
        return originals["all_reduce"](t, *args, **kwargs)

    def batch_isend_irecv(ops):
        counts["batch_isend_irecv"] += 1
        peers.update(_peers(ops))
        return originals["batch_isend_irecv"](ops)

    saved_env, saved_warn = os.environ.get("LOCAL_SIZE"), topology.log_warning
    os.environ["LOCAL_SIZE"] = local_size
    topology.log_warning = warned.append
    for name, fn in (("new_group", new_group), ("all_reduce", all_reduce), ("batch_isend_irecv", batch_isend_irecv)):
        setattr(dist, name, fn)
    try:
        topo = topology.USPTopology.build(u, r)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        topology.log_warning = saved_warn
        os.environ.pop("LOCAL_SIZE") if saved_env is None else os.environ.update(LOCAL_SIZE=saved_env)
    groups = {kind: getattr(topo, f"{kind}_group") for kind in KINDS}
    return {"same": {(a, b) for a in KINDS for b in KINDS if groups[a] is groups[b]},
            "world": {kind for kind, g in groups.items() if g is dist.group.WORLD}, "peers": peers,
            "own": len(topo.own_groups()), "sizes": {kind: dist.get_world_size(g) for kind, g in groups.items()},
            "warned": warned, **counts}


def _peers(ops) -> set:
    """``{("isend" | "irecv", global peer)}`` of a ``batch_isend_irecv``'s ops."""
    return {(op.op.__name__, op.peer) for op in ops}


def _ring_peers(plan, rank: int) -> set:
    """Every ring rank but this one, as a peer of both a send and a receive (what the ring's forward and backward
    exchange with when each of its R steps computes)."""
    ring = plan.member_of("ring", rank)
    return {(op, peer) for peer in ring if peer != rank for op in ("isend", "irecv")}


def _expected(u: int, r: int, world: int, rank: int):
    plan = group_ranks(u, r, world)
    mine = {kind: tuple(sorted(plan.member_of(kind, rank))) for kind in KINDS}
    same = {(a, b) for a in KINDS for b in KINDS if mine[a] == mine[b]}
    everyone = tuple(range(world))
    every = {tuple(sorted(g)) for kind in KINDS for g in getattr(plan, kind)}
    warmed = sorted(len(ranks) for ranks in set(mine.values()) if len(ranks) > 1)
    world_kinds = {kind for kind in KINDS if mine[kind] == everyone}
    own = len(set(mine.values()) - {everyone})
    return same, len(every - {everyone}), world_kinds, own, warmed, int(r > 1), _ring_peers(plan, rank)


def test_groups_over_the_same_ranks_are_one_and_each_is_warmed(world4):
    results = {}
    for u, r in LAYOUTS:
        results[u, r] = per_rank = world4.run(build_and_count, u, r, "4")
        for rank, got in enumerate(per_rank):
            same, groups, world_kinds, own, warmed, exchanges, peers = _expected(u, r, 4, rank)
            assert got["same"] == same, (u, r, rank)
            # one process group per distinct rank set; the kinds over every rank are the default group, not a new one
            assert got["new_group"] == groups and got["world"] == world_kinds, (u, r, rank, got)
            assert got["own"] == own, (u, r, rank, got)  # what a teardown may destroy: never the default group
            # one warm-up all-reduce per distinct group of this rank's of more than one rank, one ring exchange with
            # every peer of the ring (the backward sends dK/dV R - t hops ahead)
            assert sorted(got["all_reduce"]) == warmed and got["batch_isend_irecv"] == exchanges, (u, r, rank, got)
            assert got["peers"] == peers, (u, r, rank, got["peers"])
            assert got["warned"] == []
    # dp = 1: the sp and sp_dp groups are one communicator (with R = 1 the Ulysses group too, with U = 1 the ring)
    assert {("sp", "sp_dp"), ("ulysses", "sp")} <= results[4, 1][0]["same"]
    assert {("sp", "sp_dp"), ("ring", "sp")} <= results[1, 4][0]["same"]
    assert ("sp", "sp_dp") in results[2, 2][0]["same"] and ("sp", "sp_dp") not in results[2, 1][0]["same"]
    assert results[2, 2][0]["all_reduce"] == [2, 2, 4]  # ulysses, ring, sp = sp_dp; the one-rank dp group is not
    two_nodes = world4.run(build_and_count, 4, 1, "2")  # 2 ranks per node: a Ulysses group of 4 crosses nodes
    assert "usp.ulysses_degree=4" in two_nodes[0]["warned"][0] and "2 ranks per node from LOCAL_SIZE" in \
        two_nodes[0]["warned"][0]
    assert all(got["warned"] == [] for got in two_nodes[1:])  # rank 0 says it


def ring_of_four_at_build_and_in_a_step() -> dict:
    """A 1x4 topology (its ring, SP and sequence x data-parallel groups are every rank: the default group) built with
    its ring exchanges forced through host buffers (the route CUDA tensors take on gloo), then one causal zigzag
    attention forward and backward: the peers of each, the staged exchanges of the build, what the watchdog says of
    the default group (before and after the dynamic-SP degrees are cut), and a build under another timeout."""
    import datetime

    import torch.distributed as dist

    import ds_usp
    from ds_usp import comm, watchdog
    from ds_usp.topology import USPTopology

    seen: list = []
    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: seen.append(_peers(ops)) or batch(ops)
    world = dist.group.WORLD
    comm.stage_point_to_point(world)
    staged = comm.staging_stats()["exchanges"]
    try:
        topo = USPTopology.build(1, 4)
        staged = comm.staging_stats()["exchanges"] - staged
        comm.stage_point_to_point(world, on=False)
        at_build, seen[:] = set().union(*seen), []
        g = torch.Generator().manual_seed(3)
        q, k, v = (ds_usp.shard_sequence(torch.randn(1, 32, 2, 8, generator=g), topo, 1, "zigzag").requires_grad_()
                   for _ in range(3))
        ds_usp.usp_attention(q, k, v, topo, causal=True, layout="zigzag", seq_len=32).sum().backward()
        in_a_step = set().union(*seen)
    finally:
        dist.batch_isend_irecv = batch
        comm.stage_point_to_point(world, on=False)
    named = watchdog.describe_group(world)
    cut = topo.with_degrees({2: (1, 2)})
    own = topo.own_groups() + cut.own_groups()
    other = USPTopology.build(1, 4, timeout=datetime.timedelta(seconds=61))  # not the default group's timeout
    return {"at_build": at_build, "in_a_step": in_a_step, "staged": staged, "named": named,
            "named_after_cut": watchdog.describe_group(world), "world_in_own": any(g is world for g in own),
            "cut_shares": cut.degrees[2].sp_dp_group is world and cut.degrees[2].dp_group is topo.dp_group,
            "other_is_world": other.ring_group is world or other.sp_dp_group is world,
            "other_named": watchdog.describe_group(other.sp_dp_group)}


def test_the_ring_warm_up_reaches_every_peer_of_a_step_and_the_default_group_is_shared(world4):
    for rank, got in enumerate(world4.run(ring_of_four_at_build_and_in_a_step)):
        others = {(op, peer) for peer in range(4) if peer != rank for op in ("isend", "irecv")}
        assert got["in_a_step"] == others, (rank, got)  # the backward's dK/dV go R - t hops: every ring rank
        assert got["at_build"] == got["in_a_step"], (rank, got)  # ... each connected at build
        assert got["staged"] == 1, (rank, got)  # through ds_usp.comm's ring route (staged where it stages)
        assert got["named"] == got["named_after_cut"] == \
            "ranks [0, 1, 2, 3] (the ring / sp / sp_dp group ds_usp_ring_0+sp_0+sp_dp_0)", (rank, got)
        assert got["cut_shares"] and not got["world_in_own"], (rank, got)  # never destroyed with a topology
        assert not got["other_is_world"], (rank, got)  # a group's timeout is fixed: usp.timeout_seconds holds
        assert got["other_named"] == "ranks [0, 1, 2, 3] (the ring / sp / sp_dp group ds_usp_ring_0+sp_0+sp_dp_0)"


def test_the_ring_warm_up_goes_where_the_rings_blocks_go(monkeypatch, launcher):
    """On gloo in a process that uses CUDA (ranks sharing a GPU) the ring's blocks are CUDA tensors, staged through host
    buffers: its warm-up exchanges one there too; a CPU job on a machine with GPUs makes no CUDA context for it."""
    from ds_usp import comm

    FakeCuda(monkeypatch, 4, initialized=True, current=2)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "gloo")
    assert comm.ring_device(object()) == torch.device("cuda", 2)
    FakeCuda(monkeypatch, 4)
    assert comm.ring_device(object()) == torch.device("cpu")
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    assert comm.ring_device(object()) == torch.device("cuda", 0)


# ---------------------------------------------------------------- the smoke program on NCCL's rules


def run_smoke_on_meta_default(config: str) -> dict:
    """examples/smoke_topology.py's main() with torch's default device ``meta``: a tensor not placed on the backend's
    device lands there. Records the device of every tensor handed to a collective."""
    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("smoke_topology", SMOKE)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    devices: set[str] = set()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "batch_isend_irecv")}

    def all_reduce(t, *args, **kwargs):
        devices.add(t.device.type)
        return originals["all_reduce"](t, *args, **kwargs)

    def all_gather(parts, t, *args, **kwargs):
        devices.update(x.device.type for x in [*parts, t])
        return originals["all_gather"](parts, t, *args, **kwargs)

    def batch_isend_irecv(ops):
        devices.update(op.tensor.device.type for op in ops)
        return originals["batch_isend_irecv"](ops)

    for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather), ("batch_isend_irecv", batch_isend_irecv)):
        setattr(dist, name, fn)
    try:
        with torch.device("meta"):
            lines = smoke.main(["--deepspeed_config", config])
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"devices": devices, "lines": lines}


def test_smoke_topology_follows_nccls_rules(world4, tmp_path):
    dp2 = tmp_path / "dp2.json"
    dp2.write_text('{"train_micro_batch_size_per_gpu": 1, "sequence_parallel": "usp", "sequence_parallel_size": 2,'
                   ' "usp": {"ulysses_degree": 1, "ring_degree": 2}}')
    for config, ring in ((ROOT / "ds_configs" / "cpu_demo.json", "ring [0, 2]"), (dp2, "ring [0, 1]")):
        per_rank = world4.run(run_smoke_on_meta_default, str(config))
        for got in per_rank:
            assert got["devices"] == {"cpu"}, (config, got["devices"])  # never the default device
            assert len(got["lines"]) == 4 and got["lines"] == per_rank[0]["lines"]
        assert ring in per_rank[0]["lines"][0], per_rank[0]["lines"]
