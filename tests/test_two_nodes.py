"""Two nodes, each saving to a directory of its own (issue 63 item 10): asynchronous checkpoints commit by a collective.

Emulated on a 4-rank gloo world: ranks 0-1 are node A and save to ``A/``, ranks 2-3 are node B and save to ``B/`` (the
checkpoint path given per rank, as node-local disks give it; each node's launcher numbers its ranks 0-1). ZeRO-3
(every rank writes its own model and optimizer states, so each directory holds what its ranks resume from) and ZeRO-1
(DeepSpeed's ``use_node_local_storage``: each node's first rank writes the model file, every rank its optimizer part)
at (U, R, dp) = (2, 2, 1), ``usp.async_save`` on, each file's write held back 1.5 s while steps 3-5 run
(tests/test_checkpoint.py's ``train``):

* each directory gets a complete checkpoint: ``latest`` names step 2, its manifest lists exactly its own ranks' files
  and verifies, no claim or marker is left;
* no rank opens, lists or creates anything in the other directory, saving or resuming (``open``, ``io.open``,
  ``os.open`` and ``os.scandir`` spied on every rank, the background threads included);
* each node resumes from its own directory to the uninterrupted run's losses and parameters, bitwise.

And the shared file system seen from two hosts: the same 4 ranks reporting two host names and saving to one folder
(two ranks qualify as their host's first): exactly one commits, the checkpoint is complete. A save killed between two
directories' commits (dir A's ``latest`` moved, dir B's not) is refused at the load on every rank, naming both tags.
"""
from __future__ import annotations

import builtins
import contextlib
import io
import os
from typing import Iterator

import pytest
import torch

from test_checkpoint import SAVE_AT, SAVED, STEPS, _engine, _tail, train

STAGE = 3


def _node_dir(root: str, rank: int) -> str:
    return os.path.join(root, "A" if rank < 2 else "B")


@contextlib.contextmanager
def _spied(seen: list[str]) -> Iterator[None]:
    """Every path this process opens, creates or lists while the block runs (its threads too) goes into ``seen``."""
    real = {"open": builtins.open, "io_open": io.open, "os_open": os.open, "scandir": os.scandir}

    def note(path: object) -> None:
        if isinstance(path, (str, bytes, os.PathLike)):
            seen.append(os.path.realpath(os.fsdecode(path)))

    def spy(name: str):
        def wrapper(path=".", *args, **kwargs):
            note(path)
            return real[name](path, *args, **kwargs)
        return wrapper

    builtins.open, io.open, os.open, os.scandir = spy("open"), spy("io_open"), spy("os_open"), spy("scandir")
    try:
        yield
    finally:
        builtins.open, io.open, os.open, os.scandir = (real["open"], real["io_open"], real["os_open"],
                                                       real["scandir"])


def node_local(root: str, stage: int = STAGE) -> dict:
    """On every rank: train with an asynchronous save into this node's directory, then resume from it (ZeRO-1/2 with
    DeepSpeed's ``use_node_local_storage``: each node's first rank writes the model file)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine, theirs = _node_dir(root, rank), _node_dir(root, 3 - rank)
    seen: list[str] = []
    launcher = {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")  # as each node's launcher numbers its ranks
    try:
        with _spied(seen):
            losses, params = train(mine, stage, *SAVED, save=True, async_save=True, node_local=stage < 3)
            resumed = train(mine, stage, *SAVED, resume="engine", node_local=stage < 3)
    finally:
        for key, value in launcher.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    other = os.path.realpath(theirs)
    return {"losses": losses, "params": params, "resumed": resumed,
            "foreign": sorted({p for p in seen if p == other or p.startswith(other + os.sep)}),
            "own": any(p.startswith(os.path.realpath(mine) + os.sep) for p in seen)}


@pytest.mark.parametrize("stage", [STAGE, 1])
def test_each_node_saves_to_its_own_directory_and_resumes_from_it(world4, tmp_path, stage):
    from ds_usp.integration.engine.checkpoints import LATEST, MANIFEST, problems

    root = str(tmp_path)
    results = world4.run(node_local, root, stage)
    for rank, got in enumerate(results):
        assert got["own"] and got["foreign"] == [], f"rank {rank} touched the other node's directory: {got['foreign']}"
        assert sorted(got["losses"]) == list(range(1, STEPS + 1))
        assert _tail(got["resumed"][0]) == _tail(got["losses"]), f"rank {rank}: {got['resumed'][0]} vs {got['losses']}"
        for name, value in got["params"].items():
            assert torch.equal(got["resumed"][1][name], value), f"rank {rank} {name}"
    for node, ranks in (("A", (0, 1)), ("B", (2, 3))):
        folder = tmp_path / node / f"global_step{SAVE_AT}"
        assert (tmp_path / node / LATEST).read_text().strip() == folder.name
        assert problems(folder) == []  # complete and intact
        files = sorted(os.listdir(folder))
        own = [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in ranks for kind in ("model", "optim")] \
            if stage == 3 else ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                                  for r in ranks]
        assert files == sorted([MANIFEST] + own), files  # its own ranks', nothing else


def shared_folder_two_hosts(root: str) -> tuple[int, list[str]]:
    """On every rank: ranks 0-1 report host "node-a", 2-3 "node-b", all save to one folder (a shared file system seen
    from two hosts). Returns how many commits this rank made and the problems found after the save."""
    import socket

    import torch.distributed as dist

    from ds_usp.integration.engine import checkpoints

    rank = dist.get_rank()
    engine = _engine(STAGE, *SAVED)
    real_host, real_manifest = socket.gethostname, checkpoints.write_manifest
    commits = []
    socket.gethostname = lambda: "node-a" if rank < 2 else "node-b"
    checkpoints.write_manifest = lambda *args, **kwargs: commits.append(1) or real_manifest(*args, **kwargs)
    try:
        engine.save_checkpoint(root, tag="shared", async_save=True)
        engine.wait_for_checkpoint()
        engine.save_checkpoint(root, tag="shared_blocking", async_save=False)
    finally:
        socket.gethostname, checkpoints.write_manifest = real_host, real_manifest
    dist.barrier()
    from pathlib import Path

    return len(commits), [p for tag in ("shared", "shared_blocking") for p in checkpoints.problems(Path(root) / tag)]


def test_a_shared_folder_seen_from_two_hosts_is_committed_once(world4, tmp_path):
    from ds_usp.integration.engine.checkpoints import CLAIM

    results = world4.run(shared_folder_two_hosts, str(tmp_path))
    assert sum(n for n, _ in results) == 2, results  # one commit per save, not one per host
    assert all(found == [] for _, found in results), results
    assert (tmp_path / "latest").read_text().strip() == "shared_blocking"
    assert not any(name.startswith(CLAIM) for tag in ("shared", "shared_blocking")
                   for name in os.listdir(tmp_path / tag))


def torn_between_directories(root: str) -> str:
    """On every rank: node B's ``latest`` still names an older complete tag (its commit was killed); the load refuses."""
    import torch.distributed as dist

    from ds_usp.integration.engine.checkpoints import CheckpointDamaged, LATEST

    rank = dist.get_rank()
    mine = _node_dir(root, rank)
    engine = _engine(STAGE, *SAVED)
    engine.save_checkpoint(mine, tag="older", async_save=True)
    engine.save_checkpoint(mine, tag="newer", async_save=True)
    engine.wait_for_checkpoint()
    dist.barrier()
    if rank == 2:
        with open(os.path.join(mine, LATEST), "w") as f:
            f.write("older")
    dist.barrier()
    try:
        _engine(STAGE, *SAVED).load_checkpoint(mine)
    except CheckpointDamaged as err:
        return str(err)
    return "loaded"


def test_directories_whose_latest_differ_are_refused_on_every_rank(world4, tmp_path):
    messages = world4.run(torn_between_directories, str(tmp_path))
    assert len(set(messages)) == 1, messages
    assert "rank 0: 'newer'" in messages[0] and "rank 2: 'older'" in messages[0], messages[0]
