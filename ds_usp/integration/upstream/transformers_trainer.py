"""ds-usp's changes to transformers' Trainer objects: a checkpoint folder's rotation held back until its manifest is
written (the model-side changes and HF's DeepSpeed batch size are :mod:`.transformers`'s)."""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator

from ds_usp.integration.upstream.registry import Patch, refuse, register

register("checkpoint_rotation", Patch(
    "transformers' TrainingArguments.save_total_limit (a ds-usp trainer's args: None while the Trainer's "
    "_save_checkpoint runs)",
    "Trainer._save_checkpoint deleting older checkpoint-N folders last, through "
    "rotate_checkpoints(save_total_limit=self.args.save_total_limit)",
    "HF deletes the older folders inside its save, before ds-usp has written the new folder's manifest: a crash "
    "then could leave no complete checkpoint to resume from",
    "the Trainer rotating its folders after a callback (on_save) has returned, or keeping a completion marker itself"))


@functools.cache
def _rotates_inside_save() -> bool:
    from transformers import Trainer

    return "save_total_limit=self.args.save_total_limit" in inspect.getsource(Trainer._save_checkpoint)


@contextlib.contextmanager
def rotation_held_back(args: Any) -> Iterator[Any]:
    """While the block runs (the Trainer's ``_save_checkpoint``), ``args.save_total_limit`` is None: HF rotates no
    folder; the caller rotates afterwards with the limit yielded.

    Args:
        args: the Trainer's ``TrainingArguments``.

    Yields:
        The limit as it was.

    Raises:
        UpstreamChanged: the Trainer's save no longer rotates with ``args.save_total_limit``.
    """
    if not _rotates_inside_save():
        refuse("checkpoint_rotation", "Trainer._save_checkpoint does not rotate with self.args.save_total_limit")
    limit = args.save_total_limit
    args.save_total_limit = None
    try:
        yield limit
    finally:
        args.save_total_limit = limit
