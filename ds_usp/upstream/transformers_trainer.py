"""ds-usp's changes to transformers' Trainer objects: a checkpoint folder's rotation held back until its manifest is
written, and a Trainer whose DeepSpeed config sets ``"sequence_parallel"`` made ds-usp's while it is created (the
model-side changes and HF's DeepSpeed batch size are :mod:`.transformers`'s)."""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator

from ds_usp.upstream.registry import Patch, refuse, register

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


register("trainer_adoption", Patch(
    "transformers.Trainer.create_accelerator_and_postprocess (wrapped once, by the gate _ds_usp_auto installs when "
    "transformers.trainer is imported) and the __class__ of a Trainer whose DeepSpeed config sets "
    "\"sequence_parallel\" (USP<its class>: ds-usp's trainer mixin first, the class itself after it)",
    "Trainer.__init__ setting self.args and self.model, then calling self.create_accelerator_and_postprocess() before "
    "it builds any data loader, optimizer or callback",
    "a stock Trainer or TRL SFTTrainer given a DeepSpeed config with \"sequence_parallel\" feeds every rank whole "
    "sequences and computes a per-rank loss: it fails in DeepSpeed's batch-size assertion or trains plain data "
    "parallelism",
    "transformers' Trainer taking its sequence-parallel pieces (loaders, loss, prediction step) from a backend, as "
    "accelerate's parallelism_config does for DeepSpeed's own Ulysses"))


@functools.cache
def _accelerator_made_before_anything_else() -> bool:
    from transformers import Trainer

    source = inspect.getsource(Trainer.__init__)
    made = source.find("self.create_accelerator_and_postprocess()")
    before = min(source.find("self.args = args"), source.find("self.model = model"))
    after = [source.find(later) for later in ("get_train_dataloader", "create_optimizer", "CallbackHandler(")]
    return -1 < before < made and all(at == -1 or at > made for at in after)


def become(trainer: Any, cls: type) -> None:
    """Make ``trainer`` (being created: inside its ``create_accelerator_and_postprocess``) an instance of ``cls``, a
    subclass of its class.

    Args:
        trainer: the Trainer.
        cls: ``USP<its class>``.

    Raises:
        UpstreamChanged: ``Trainer.__init__`` no longer creates the accelerator after the arguments and the model and
            before the loaders, optimizer and callbacks.
        TypeError: ``cls`` is not a subclass of the trainer's class.
    """
    if not _accelerator_made_before_anything_else():
        refuse("trainer_adoption", "Trainer.__init__ does not call create_accelerator_and_postprocess after setting "
                                   "self.args and self.model and before its loaders, optimizer and callbacks")
    if not issubclass(cls, type(trainer)):
        raise TypeError(f"{cls.__name__} is not a subclass of {type(trainer).__name__}")
    trainer.__class__ = cls
