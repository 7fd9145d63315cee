"""A gloo world of N CPU processes that lives for a whole test session (or module) and runs many cases.

Starting a world costs seconds (its ranks are forked from a server that imported torch, DeepSpeed and transformers
once: :func:`_context`; then they join a gloo group); a case costs milliseconds to seconds. So the session starts one
:class:`World` per size (see the ``world2``/``world4``/``world8`` fixtures in
``conftest.py``) and a module calls
``world.run(fn, *args)`` per case: ``fn(*args)`` runs on every rank and the per-rank return values
come back as a list. A rank that raises fails the case with that rank's traceback; a case that
does not finish within ``timeout`` seconds is reported as a hang and the world is restarted.
``fn`` must be a module-level function (it is pickled by name).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Optional

FAILED_GRACE_S = 60.0  # how long the other ranks may still take once one rank of a case has failed


# what the fork server that starts every rank (worlds and jobs) imports once for the session
PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers.modeling_utils", "ds_usp"]


def _context():
    """multiprocessing's ``forkserver``: ranks forked from a server that imported :data:`PRELOAD` once and joined no
    process group. Spawned, each rank imported them itself: about 5 s of CPU a rank, paid again by every rank of every
    world restart and every job."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _become_rank(rank: int, world_size: int, port: int, **extra: str) -> None:
    """The environment a launcher gives rank ``rank`` of ``world_size`` on this host (and ``extra``), and one torch
    thread: N ranks share the machine's few cores."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), **extra)
    import torch

    torch.set_num_threads(1)


def _worker(rank: int, world_size: int, port: int, tasks: "mp.Queue", results: "mp.Queue") -> None:
    _become_rank(rank, world_size, port)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((-1, rank, True, None))
    except Exception:
        results.put((-1, rank, False, traceback.format_exc()))
        return
    parent = os.getppid()
    while True:
        try:
            item = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # pytest is gone (killed): an orphaned rank would poll its gloo groups forever
            continue
        if item is None:  # the process exits now, its sockets closed by the OS: Python's own exit waited on the gloo
            os._exit(0)  # groups' threads and took seconds a rank (every answer was already taken by the parent)
        case_id, fn, args, kwargs = item
        before = set(_process_groups())
        try:
            answer = (case_id, rank, True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - any failure is reported to the test
            answer = (case_id, rank, False, traceback.format_exc())
        if answer[2]:
            try:
                _release_groups(before)
            except Exception:  # noqa: BLE001 - the case's answer stands; a crowded world is restarted by the fixture
                traceback.print_exc()
        results.put(answer)


def _process_groups() -> list:
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def _release_groups(before: set) -> None:
    """Destroy the process groups a case built (its engines', its own topologies'), keeping :func:`get_topo`'s, and
    empty DeepSpeed's module-level group globals (``deepspeed.utils.groups``: the mpu it was last given, the groups it
    made), so that the next case finds DeepSpeed as it is after its import.

    Each gloo group keeps three threads, one of them an event loop that wakes every 10 ms while idle: undestroyed, a
    4-rank world ran 800 threads a rank after 30 cases of tests/test_checkpoint.py and its idle ranks took most of two
    cores in system time. Every rank has finished the case when the barrier returns, so no message is in flight on a
    group being destroyed."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name, value in list(vars(groups).items()):
            if name in ("mpu", "mesh_device") or (name.startswith("_") and name.isupper() and
                                                  ("GROUP" in name or name.startswith("_MPU_"))):
                setattr(groups, name, {} if isinstance(value, dict) else None)
    # two places of DeepSpeed's keep every ZeRO-3 model for good, and so, through the model's hooks, its engine and
    # the engine's groups (18 threads a case): the stack each engine pushes its model on, and a class-level cache of
    # the parameter coordinator keyed by the coordinator and a module
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        offload.FWD_MODULE_STACK.clear()
    # HF's weak reference to the DeepSpeed config of the last Trainer / accelerate plugin: kept alive past the case (an
    # accelerate state, a frozen cycle), a later case's from_config would build its model inside ZeRO-3's zero.Init
    hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if hf_deepspeed is not None:
        hf_deepspeed.unset_hf_deepspeed_config()
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    method = getattr(getattr(coordinator, "PartitionedParameterCoordinator", None),
                     "_PartitionedParameterCoordinator__params_to_release", None)
    for cell in getattr(method, "__closure__", None) or ():  # an lru_cache inside DeepSpeed's nvtx wrapper
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
    if not _destroy_case_groups(before):
        return
    import gc

    # nothing of this function's may still point into the case's objects here: what this collection leaves is frozen
    # for good below (a loop variable left on the last object of gc.get_objects() kept each ZeRO-3 engine, 18 threads)
    gc.collect()
    # what survives a case (imports, caches) is moved out of the collector's sight: a full collection of a rank that
    # has imported torch, DeepSpeed and transformers walks 430k objects (0.2 s), and Python runs one on its own every
    # so often during a case; later collections walk only what later cases make
    gc.freeze()


def _destroy_case_groups(before: set) -> bool:
    """Destroy the process groups the case built and the DeepSpeed engines alive; False if it built no group."""
    import gc

    import torch.distributed as dist

    kept = {id(g) for topo in _TOPOS.values() for g in vars(topo).values()}
    doomed = [g for g in _process_groups() if g not in before and id(g) not in kept]
    if not doomed:
        return False
    dist.barrier()
    for g in doomed:
        dist.destroy_process_group(g)
    # a group's threads end with its last reference, and a DeepSpeed engine holds its groups in a cycle through its
    # parameters' C++ autograd hooks, which the collector cannot see: the engine's destroy() removes the hooks
    engines = sys.modules.get("deepspeed.runtime.engine")
    if engines is not None:
        for obj in gc.get_objects():
            if issubclass(type(obj), engines.DeepSpeedEngine):  # (isinstance would ask a dead weak proxy)
                try:
                    obj.destroy()
                except Exception:  # noqa: BLE001 - a half-built engine: its groups stay until the world restarts
                    pass
    return True


class World:
    """N spawned processes joined in one gloo process group.

    Args:
        world_size: number of ranks.
        timeout: seconds a case may take before it counts as a hang.
    """

    def __init__(self, world_size: int, timeout: float = 180.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._case = 0
        self._procs: list[mp.Process] = []
        self._start()

    def _start(self) -> None:
        ctx = _context()
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(-1, "world start")

    def _collect(self, case_id: int, what: str) -> list[Any]:
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(out) + len(failures) < self.world_size:
            try:  # once a rank has failed, the others get a short grace: they may wait on it in a collective
                cid, rank, ok, payload = self._results.get(timeout=min(self.timeout, FAILED_GRACE_S) if failures
                                                           else self.timeout)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(out) - set(failures))
                self.close()
                self._start()
                raise AssertionError(f"{what}: ranks {missing} did not finish within {self.timeout:.0f} s (hang); "
                                     f"the world was restarted" + "".join(f"\n--- rank {r} ---\n{tb}"
                                                                           for r, tb in failures.items()))
            if cid != case_id:
                continue  # a late answer from a case that already failed
            (out if ok else failures)[rank] = payload
        if failures:
            raise AssertionError(f"{what} failed on ranks {sorted(failures)}:" +
                                 "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank.

        Args:
            fn: a module-level function.
            *args: its positional arguments (picklable).
            **kwargs: its keyword arguments (picklable).

        Returns:
            The return value of each rank, indexed by rank.

        Raises:
            AssertionError: some rank raised (with its traceback) or the case hung.
        """
        self._case += 1
        for q in self._tasks:
            q.put((self._case, fn, args, kwargs))
        return self._collect(self._case, getattr(fn, "__name__", "case"))

    def threads(self) -> int:
        """The most threads one rank runs. Each gloo process group a case builds (a topology, an engine's groups) keeps
        three threads whose event loop polls while idle: after tests/test_checkpoint.py's first 30 cases a rank ran 800
        of them and its 4 idle ranks took 1.6 of 2 cores in system time, starving the jobs the tests launch."""
        counts = [0]
        for p in self._procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    counts += [int(line.split()[1]) for line in f if line.startswith("Threads:")]
            except OSError:  # no /proc (not Linux), or the rank is gone
                pass
        return max(counts)

    def restart(self) -> None:
        """Fresh ranks in place of these (the same object: a module's fixture keeps its world)."""
        self.close()
        self._start()

    def close(self, join_timeout: Optional[float] = 2.0) -> None:
        """Stop every rank (politely, then by force)."""
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(join_timeout)
            if p.is_alive():
                p.kill()
                p.join()


_TOPOS: dict = {}  # per rank process: (U, R) -> topology, built on first use


def get_topo(u: int, r: int):
    """This rank's :class:`ds_usp.USPTopology` of ``u x r``, built once per world (building is collective: every
    rank must ask for the same degrees in the same order)."""
    from ds_usp import USPTopology

    if (u, r) not in _TOPOS:
        _TOPOS[(u, r)] = USPTopology.build(u, r)
    return _TOPOS[(u, r)]


_ONCE: dict = {}  # per rank process: key -> what :func:`reference` computed for it


def reference(key: tuple, fn: Callable[..., Any], *args: Any) -> Any:
    """On rank 0, ``fn(*args)`` computed the first time the world asks for ``key`` and kept while the world lives;
    None on the other ranks.

    A case compares its ranks' distributed run against a single-process reference. Run on every rank, the reference
    cost each of N ranks sharing the machine's few cores a whole single-process run, per case, though the cases of a
    family (every split and layout) compare against the same one and only rank 0's report is read."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    if key not in _ONCE:
        _ONCE[key] = fn(*args)
    return _ONCE[key]


# ---- jobs: fresh ranks that live for one run (a rank that dies, a job that is killed) ------------------------------


def _job_rank(rank: int, nprocs: int, port: int, log: str, fn: Callable[..., Any], args: tuple) -> None:
    with open(log, "w") as f:  # the rank's stdout and stderr (its C++ libraries' too)
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    _become_rank(rank, nprocs, port, OMP_NUM_THREADS="1")
    fn(*args)
    sys.stdout.flush()


class Job:
    """``fn(*args)`` on ``nprocs`` new processes, with the environment a launcher gives its ranks (``RANK``,
    ``MASTER_PORT``, ...), as ``torchrun`` would run a script, each rank's output in its own log.

    The ranks are forked from the session's fork server (:func:`_context`): a launched script paid the imports on every
    rank (about 5 s of CPU each, 10 s of wall time for 4 ranks on 2 cores) before its first line.
    ``fn`` must be a module-level function of an importable module (it is pickled by name).
    """

    def __init__(self, fn: Callable[..., Any], *args: Any, nprocs: int = 4, logdir: str) -> None:
        ctx = _context()
        port = _free_port()
        self.logs = [os.path.join(logdir, f"rank{r}.log") for r in range(nprocs)]
        self.procs = [ctx.Process(target=_job_rank, args=(r, nprocs, port, self.logs[r], fn, args), daemon=True)
                      for r in range(nprocs)]
        for p in self.procs:
            p.start()

    def wait(self, timeout: float) -> list[Optional[int]]:
        """Wait for every rank, killing the others once one exits with an error, as ``torchrun`` ends a job. Returns
        the exit codes (negative: the signal that ended the rank).

        Raises:
            AssertionError: a rank still runs after ``timeout`` seconds (every rank is killed).
        """
        deadline = time.monotonic() + timeout
        while any(p.exitcode is None for p in self.procs):
            if any(p.exitcode not in (None, 0) for p in self.procs):
                self.kill()
                break
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"job ranks still running after {timeout:.0f} s (hang):\n" + self.output())
            time.sleep(0.05)
        return [p.exitcode for p in self.procs]

    def kill(self) -> None:
        """Kill every rank still running."""
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()

    def output(self, rank: Optional[int] = None) -> str:
        """One rank's output, or every rank's."""
        if rank is not None:
            with open(self.logs[rank]) as f:
                return f.read()
        return "".join(f"--- rank {r} ---\n{self.output(r)}" for r in range(len(self.logs)))
