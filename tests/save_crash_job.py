"""A 4-rank job that resumes from a complete checkpoint, trains one step and has a rank die during its next save
(run by tests/test_checkpoint.py as a ``dist_harness.Job``, which ends the other ranks when one dies, as
``torch.distributed.run`` does).

Usage by hand: ``python -m torch.distributed.run --nproc_per_node 4 save_crash_job.py CKPT_DIR STAGE POINT``.
POINT, where the victim dies (``os._exit``, no cleanup, like a SIGKILL):

* ``before_files``: rank 2, at its first file of the save (nothing of it written);
* ``during_files``: rank 2, half-way through writing its first file;
* ``after_files``: rank 0, after every rank wrote its files, before the manifest;
* ``manifest``: rank 0, half-way through writing the manifest's temporary file;
* ``latest``: rank 0, after the manifest, with ``latest``'s temporary file written but not renamed.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

POINTS = ("before_files", "during_files", "after_files", "manifest", "latest")
DIED = 17  # the victim's exit code


def _die() -> None:
    sys.stdout.flush()
    os._exit(DIED)


def arm(point: str, rank: int) -> None:
    """Make this rank die at ``point`` if it is that point's victim."""
    from ds_usp.integration.engine import checkpoints as saves

    if point in ("before_files", "during_files") and rank == 2:
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if point == "before_files" or not isinstance(f, (str, os.PathLike)):
                _die()
            real_save(obj, f, *args, **kwargs)
            os.truncate(f, os.path.getsize(f) // 2)
            _die()

        torch.save = save
    elif point == "after_files" and rank == 0:
        saves.write_manifest = lambda *args, **kwargs: _die()
    elif point in ("manifest", "latest") and rank == 0:
        real_write = saves._write_atomically
        calls = []

        def write(path, text):
            calls.append(path)
            if point == "manifest":  # the first call: the manifest
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(text[: len(text) // 2])
                _die()
            if len(calls) == 2:  # the second: latest, its temporary file complete, not yet renamed over latest
                path.with_name(f".{path.name}.tmp").write_text(text)
                _die()
            real_write(path, text)

        saves._write_atomically = write


def main(ckpt: str, stage: int, point: str) -> None:
    import ds_usp
    import test_checkpoint as tc

    engine = tc._engine(stage, *tc.SAVED)
    engine.load_checkpoint(ckpt)
    assert engine.global_steps == tc.SAVE_AT
    topo = engine.usp.topo
    for micro in range(engine.gradient_accumulation_steps()):  # one more step, as tc.train takes it
        shard = ds_usp.shard_batch(tc._batch(tc.SAVE_AT * tc.GLOBAL_BATCH + micro), topo, layout=engine.usp.layout)
        logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        engine.backward(ds_usp.sp_cross_entropy(logits, shard["shift_labels"], topo))
        engine.step()
    arm(point, topo.rank)
    engine.save_checkpoint(ckpt)
    print(f"rank {topo.rank}: the save of global_step{engine.global_steps} completed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
