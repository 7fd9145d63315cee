"""HuggingFace ``Trainer`` and TRL ``SFTTrainer`` with USP: the DeepSpeed JSON's key alone, or a class name.

The DeepSpeed JSON gets ``"sequence_parallel": "usp"`` (and optionally the ``"usp"`` block). With ds-usp installed,
a stock ``Trainer`` or ``SFTTrainer`` (``trl sft`` included), or a subclass of one, becomes ds-usp's while it is
created: the gate of ``_ds_usp_auto`` on ``Trainer.create_accelerator_and_postprocess`` calls :func:`adopt`, which
swaps its class for ``USP<class>`` (:class:`USPTrainerMixin` first) and its model's attention for ``"usp"``;
``DS_USP_AUTO=0`` turns that off (a plain Trainer with the key is then refused). Or by name:

    from ds_usp import USPTrainer                     # instead of: from transformers import Trainer
    trainer = USPTrainer(model=model, args=TrainingArguments(..., deepspeed="ds.json"), train_dataset=...)

    from ds_usp import USPSFTTrainer                  # instead of: from trl import SFTTrainer

(``import ds_usp`` registers ``attn_implementation="usp"``; a model built otherwise is switched to it.) Without
``"sequence_parallel"`` they are the plain trainers. Launch is unchanged (``deepspeed``, ``accelerate launch``,
``torchrun``); accelerate's ``parallelism_config`` (``sp_backend: deepspeed``) is taken by ds-usp when the JSON has
the key (its ``sp_size`` must be the JSON's ``sequence_parallel_size``; DeepSpeed's own Ulysses is then not set up).

What happens inside (tested with transformers 5.23 / accelerate 1.15 / TRL 1.16; any version that has every
Trainer, accelerate and DeepSpeed-config hook used here is accepted, and one that lacks one is refused at import
naming it, see :func:`check_hooks`):

* the engine: accelerate creates it with ``deepspeed.initialize`` and offers no way to pass an
  ``mpu``; the gate on ``deepspeed.initialize`` makes a call with a ``"sequence_parallel"`` config
  :func:`ds_usp.initialize` (:func:`ds_usp.upstream.deepspeed.route_initialize`), which builds the
  groups and hands DeepSpeed the ``mpu``, so ZeRO-1/2/3 shard and reduce over the sequence x data ranks; while the
  trainer's ``accelerator.prepare`` runs it marks the call as a USP trainer's (any other accelerate call is refused);
* data: the loaders split batches over replicas only (every rank of an SP group gets the same
  batch), which the model's forward shards with :func:`ds_usp.shard_batch` (layout of ``usp.layout``,
  labels shifted before sharding, packed documents found as HF's collators describe them);
* the step: the Trainer's own ``compute_loss`` and ``prediction_step`` run, a subclass's overrides included
  (LLaMA-Factory's, axolotl's): every rank of a group holds the same whole batch, and the model's forward shards it
  (:class:`ds_usp.integration.step.forward.WholeBatches`) and returns the SP loss over the group, over the Trainer's
  ``num_items_in_batch``. The Trainer counts each group's targets once per rank and multiplies the loss by its
  processes: the two factors of the sequence-parallel size cancel, so accumulation, ``average_tokens_across_devices``
  and ``max_grad_norm`` behave as without SP at every transformers version. A loss ds-usp cannot keep exact (one
  computed from logits, ``compute_loss_func``, label smoothing) is refused, naming the method;
* logging shows the true loss (the mean over the ranks that HF logs), tokens/s counts each real token
  once (a group's first rank counts its batch), evaluation gives the loss and ``predict`` the logits of
  the whole sequences, gathered inside each SP group and over replicas only; ``save_model`` and checkpoint resume are
  DeepSpeed's own.

DeepSpeed's ``train_batch_size``: HF fills an ``"auto"`` one with ``world x micro x accumulation``
while DeepSpeed counts replicas only (``world / sequence_parallel_size``); the gate on HF's config processing corrects
that one value when the config sets the key (:func:`process_trainer_config`).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from _ds_usp_auto import SWITCH, auto_enabled, sets_key, trainer_ds_config
from ds_usp.comm import all_reduce_sum_, barrier
from ds_usp.config import USPConfig, USPConfigError, load_usp_config
from ds_usp.integration.data.batch import VISUAL_KEYS
from ds_usp.integration.engine.checkpoints import complete_or_newest, write_manifest
from ds_usp.integration.engine.preflight import installed_version
from ds_usp.integration.models.attention import ATTN_NAME, refuse_non_interface_family, register_usp_attention
from ds_usp.integration.step.dynamic import accelerator_backward, run_micro_batches
from ds_usp.integration.step.forward import WholeBatches, feed_whole_batches
from ds_usp.upstream.accelerate import (check_accelerate_reads_deepspeed_initialize, gather_for_metrics,
                                       parallelism_config_for_usp, replicas_view, route_prepare, set_sync_gradients,
                                       shard_over_replicas)
from ds_usp.upstream.transformers import attention_implementation, process_with_replicas_batch
from ds_usp.upstream.transformers_trainer import become, rotation_held_back
from ds_usp.log import log_rank0

# The Trainer / accelerate / HF-DeepSpeed pieces this module overrides or calls: (module, class, method, parameters
# the override takes). A release that renames one is refused at import, naming it, instead of silently training
# without it; versions themselves are not gated (setup.py's dev extra pins the ones CI tests).
HOOKS = (
    ("transformers", "Trainer", "create_accelerator_and_postprocess", ()),
    ("transformers", "Trainer", "_build_accelerator_args", ()),
    ("transformers", "PreTrainedModel", "set_attn_implementation", ("attn_implementation",)),
    ("transformers", "Trainer", "get_train_dataloader", ()),
    ("transformers", "Trainer", "get_eval_dataloader", ("eval_dataset",)),
    ("transformers", "Trainer", "get_test_dataloader", ("test_dataset",)),
    ("transformers", "Trainer", "get_batch_samples", ("epoch_iterator", "num_batches", "device")),
    ("transformers", "Trainer", "get_total_train_batch_size", ("args",)),
    ("transformers", "Trainer", "compute_loss", ("model", "inputs", "return_outputs", "num_items_in_batch")),
    ("transformers", "Trainer", "prediction_step", ("model", "inputs", "prediction_loss_only", "ignore_keys")),
    ("transformers", "Trainer", "_prepare_inputs", ("inputs",)),
    ("transformers", "Trainer", "training_step", ("model", "inputs", "num_items_in_batch")),
    ("transformers", "Trainer", "_save_checkpoint", ("model", "trial")),
    ("transformers", "Trainer", "_get_output_dir", ("trial",)),
    ("transformers", "Trainer", "train", ("resume_from_checkpoint",)),
    ("transformers.trainer_utils", "", "rotate_checkpoints",
     ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime")),
    ("transformers.integrations.deepspeed", "HfTrainerDeepSpeedConfig", "trainer_config_process",
     ("args", "auto_find_batch_size")),
    ("accelerate", "Accelerator", "prepare", ()),
    ("accelerate.state", "GradientState", "_set_sync_gradients", ("sync_gradients",)),
    ("accelerate.data_loader", "BatchSamplerShard", "__init__", ("num_processes", "process_index")),
)
# Trainer attributes this module sets for the Trainer to read: each must still be read by transformers.trainer.
READ_BY_TRAINER = ("gather_function", "compute_loss_func", "label_smoother", "model_wrapped", "save_total_limit")


def check_hooks(hooks: tuple = HOOKS, read_by_trainer: tuple = READ_BY_TRAINER) -> None:
    """Refuse a transformers / accelerate that lacks a hook this integration uses (instead of a version range).

    Args:
        hooks: ``(module, class, method, parameters)`` that must exist with those parameters (class ``""``: a
            function of the module).
        read_by_trainer: attribute names that ``transformers.trainer`` must still read.

    Raises:
        ImportError: naming each missing hook, the installed versions, and the tested ones.
    """
    import importlib
    import inspect

    missing = []
    for module, cls, method, params in hooks:
        found = importlib.import_module(module)
        owner = getattr(found, cls, None) if cls else found  # cls "": a function of the module
        fn = getattr(owner, method, None)
        name = ".".join(x for x in (module, cls, method) if x)
        if fn is None:
            missing.append(name)
            continue
        lacking = [p for p in params if p not in inspect.signature(fn).parameters]
        if lacking:
            missing.append(f"{name} parameter(s) {', '.join(lacking)}")
    source = inspect.getsource(importlib.import_module("transformers.trainer"))
    missing += [f"transformers.trainer reading Trainer.{name}" for name in read_by_trainer if name not in source]
    if missing:
        found = ", ".join(f"{p} {installed_version(p) or 'not installed'}" for p in ("transformers", "accelerate"))
        raise ImportError(f"ds-usp's HF Trainer integration hooks pieces that this {found} does not have: "
                          f"{'; '.join(missing)}. It was tested with transformers 5.23, accelerate 1.15 and TRL 1.16 "
                          f"(pip install -e '.[trainer]' installs them)")


def complete_checkpoint_folder(output_dir: str, wanted: Any) -> Any:
    """The ``checkpoint-N`` folder to resume from: ``wanted`` verified, or (``True``) the newest complete one.

    Args:
        output_dir: the Trainer's output directory.
        wanted: ``True`` or a folder's path.

    Returns:
        The folder's path; ``wanted`` itself where no folder of ``output_dir`` has a manifest (saved without ds-usp).

    Raises:
        CheckpointDamaged: the folder given is damaged, or no complete one is left (every problem named).
    """
    import re

    root = Path(output_dir)
    folders = sorted((p for p in root.glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)),
                     key=lambda p: int(p.name.split("-")[1]), reverse=True) if root.is_dir() else []
    found = complete_or_newest(root, [p.name for p in folders], None if wanted is True else Path(wanted))
    return wanted if found is None or wanted is not True else str(found)


def _replicas_batch(config: Any, args: Any) -> Optional[int]:
    """An ``"auto"`` ``train_batch_size`` over replicas (``world / sp``) when ``"sequence_parallel"`` is set.

    ``HfTrainerDeepSpeedConfig.trainer_config_process`` runs when ``TrainingArguments`` is created and computes
    ``world x micro x accumulation``; DeepSpeed's own config divides the world by ``sequence_parallel_size``
    (``deepspeed/runtime/config.py``) and refuses the mismatch, already in ``zero.Init`` when ZeRO-3 builds the model
    (:func:`process_trainer_config` applies this)."""
    world = job_world_size(args)
    try:
        sp = load_usp_config(config, world).sequence_parallel_size
    except USPConfigError:
        return None  # ds_usp.initialize refuses it, naming the key
    if sp <= 1:
        return None
    return world // sp * args.per_device_train_batch_size * args.gradient_accumulation_steps


def job_world_size(args: Any) -> int:
    """The ranks of the job: torch.distributed's once it is up, else the launcher's ``WORLD_SIZE``, else the
    ``TrainingArguments``' (which count one process under ``accelerate launch`` with DeepSpeed on a CPU host without
    ``use_cpu``, where torch.distributed runs every rank).

    Args:
        args: the ``TrainingArguments``.

    Returns:
        The number of ranks.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    launcher = os.environ.get("WORLD_SIZE", "")
    return int(launcher) if launcher.isdigit() else args.world_size


def process_trainer_config(original: Callable[..., Any], hf_config: Any, args: tuple,
                           kwargs: Mapping[str, Any]) -> None:
    """HF's ``HfTrainerDeepSpeedConfig.trainer_config_process`` for a config that sets ``"sequence_parallel"`` (the
    gate of ``_ds_usp_auto`` calls it): HF's, with an ``"auto"`` ``train_batch_size`` counted over replicas."""
    process_with_replicas_batch(original, hf_config, args, kwargs, _replicas_batch)


class USPTrainerBase:
    """What every USP trainer shares (SFT and RL alike): the engine through ``ds_usp.initialize``, one batch per SP
    group (loaders split over replicas only), and the step's sequence count."""

    _ds_usp_trainer = True  # the gate on Trainer.create_accelerator_and_postprocess lets ds-usp's trainers through
    _usp_config: Optional[USPConfig] = None  # the DeepSpeed config's sequence-parallel keys, read once

    # ---- the engine ---------------------------------------------------------------------------------------
    def _read_usp_config(self, ds_config: Mapping[str, Any], world_size: int) -> USPConfig:
        """The sequence-parallel keys of ``ds_config`` (:func:`ds_usp.config.load_usp_config`), read on the first call
        and kept."""
        if self._usp_config is None:
            self._usp_config = load_usp_config(ds_config, world_size)
        return self._usp_config

    @property
    def _usp_sp(self) -> int:
        """The sequence-parallel size (1 before the config is read, or without ``"sequence_parallel"``)."""
        return self._usp_config.sequence_parallel_size if self._usp_config is not None else 1

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, whose ``prepare`` creates the DeepSpeed engine through ``ds_usp.initialize``."""
        super().create_accelerator_and_postprocess()
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        config = self._read_usp_config(plugin.deepspeed_config if plugin is not None else {}, job_world_size(self.args))
        if not config.enabled:
            return  # a plain Trainer
        if getattr(self.args, "train_sampling_strategy", None) == "batch_rebalance":
            raise ValueError('USPTrainer: train_sampling_strategy="batch_rebalance" is not supported with '
                             '"sequence_parallel" (it reshuffles batches across the ranks of a sequence group)')
        route_prepare(self.accelerator)  # deepspeed.initialize, called by its prepare, becomes ds_usp.initialize

    def _build_accelerator_args(self, **kwargs: Any) -> dict:
        """The Trainer's Accelerator arguments; with ``"sequence_parallel"`` in the DeepSpeed config, accelerate's
        ``parallelism_config`` leaves sequence parallelism to ds-usp (its ``sp_size`` checked against ds-usp's)."""
        args = super()._build_accelerator_args(**kwargs)
        config = trainer_ds_config(self)
        if not sets_key(config):
            return args
        sp = self._read_usp_config(config, job_world_size(self.args)).sequence_parallel_size
        given = args.get("parallelism_config")
        pc = parallelism_config_for_usp(given, sp)
        if pc is not None and pc is not given:
            log_rank0(f"accelerate's parallelism_config sp_size={sp} is ds-usp's: DeepSpeed's own Ulysses (ALST) is "
                      f"not set up")
        if pc is not None:
            args["parallelism_config"] = pc
        return args

    @property
    def _usp(self) -> Any:
        return getattr(self.model_wrapped, "usp", None)

    # ---- accelerate's processes are the replicas: to the Trainer's own code, an SP group is one process ----------
    _trl_modules: tuple = ()  # TRL modules whose imported gather / gather_object the replicas view replaces

    @contextlib.contextmanager
    def _replicas(self) -> Iterator[None]:
        """While it lasts, accelerate's processes are the data-parallel replicas (one rank of each SP group counts:
        :func:`ds_usp.upstream.accelerate.replicas_view`): the Trainer's and its subclasses' counts, gathers and
        loss scaling see a data-parallel job of replicas, each holding the whole batch it would hold alone."""
        usp = self._usp
        if usp is None or self._usp_sp == 1 or getattr(self, "_usp_in_view", False):
            yield
            return
        topo = usp.topo
        self._usp_in_view = True
        try:
            with replicas_view(self.accelerator, self._trl_modules, topo.dp_group, topo.dp_size, topo.dp_rank):
                yield
        finally:
            self._usp_in_view = False

    # ---- data: one batch per SP group, sharded --------------------------------------------------------------
    def _replicas_only(self, loader: Any) -> Any:
        if self._usp_sp == 1:
            return loader
        if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
            raise ValueError("USPTrainer: iterable datasets are not supported with \"sequence_parallel\" (accelerate "
                             "shards them over every rank before ds-usp can give the ranks of a sequence group the "
                             "same batches); use a map-style dataset")
        # SP groups are contiguous ranks: replica r holds ranks r * sp ... (r + 1) * sp - 1
        return shard_over_replicas(loader, dist.get_world_size() // self._usp_sp, dist.get_rank() // self._usp_sp)

    def get_train_dataloader(self) -> Any:
        """The Trainer's loader, split over replicas only."""
        return self._replicas_only(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The Trainer's loader, split over replicas only."""
        return self._replicas_only(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The Trainer's loader, split over replicas only."""
        return self._replicas_only(super().get_test_dataloader(test_dataset))

    def get_total_train_batch_size(self, args: Any) -> int:
        """Sequences per optimizer step: the ranks of an SP group share one."""
        return super().get_total_train_batch_size(args) // self._usp_sp

    # ---- checkpoint-N folders: complete or absent -----------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF's save of a ``checkpoint-N`` folder, then (once every rank's files are written) its manifest
        (:func:`ds_usp.integration.engine.checkpoints.write_manifest`), and only then the rotation of older folders
        (``save_total_limit``), so a crash at any point leaves the previous folder complete and a folder without a
        manifest is never resumed from (:meth:`train`)."""
        if self._usp is None:
            return super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        with rotation_held_back(self.args) as limit:  # HF rotates inside its save: here, after the manifest
            super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        wait = getattr(self.model_wrapped, "wait_for_checkpoint", None)
        if wait is not None:
            wait()  # under "usp.async_save" the engine's files are still being written: the folder's manifest waits
        barrier(None, "checkpoint files written")  # every rank's files (DeepSpeed's, the RNG states) are written
        if self.args.should_save:
            write_manifest(folder, self.state.global_step)
            rotate_checkpoints(output_dir=str(folder.parent), save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        barrier(None, "checkpoint committed")

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """HF's ``train``; ``resume_from_checkpoint=True`` takes the newest *complete* ``checkpoint-N`` (a damaged or
        half-written one is skipped with a warning naming what is wrong), and a folder given by path is verified first
        (:class:`~ds_usp.integration.engine.checkpoints.CheckpointDamaged` naming its files otherwise). Folders saved
        without manifests (by a plain Trainer) are taken as HF takes them."""
        if self._usp_sp > 1 and resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = complete_checkpoint_folder(self.args.output_dir, resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)


class USPTrainerMixin(USPTrainerBase):
    """What turns a Trainer (or a subclass such as TRL's ``SFTTrainer``) into a USP one; see the module docstring."""

    _usp_feed: Optional[WholeBatches] = None  # the model's forward shards the trainer's whole batches (set once)

    def create_accelerator_and_postprocess(self) -> None:
        """:class:`USPTrainerBase`'s, and the refusals of what the whole-batch path cannot keep exact."""
        super().create_accelerator_and_postprocess()
        if self._usp_config.enabled:
            if getattr(self.args, "predict_with_generate", False):
                raise ValueError(f"{type(self).__name__}: predict_with_generate is not supported with "
                                 f"\"sequence_parallel\" (generation runs on whole sequences, one token at a time, "
                                 f"with a cache the sharded attention does not keep); set it to false, or generate "
                                 f"after training without the key")
            if self._is_trl_sft():
                from ds_usp.upstream.trl import require_fused_head

                require_fused_head(type(self).__name__)
            if self._usp_config.dynamic_sp and self.args.gradient_accumulation_steps != 1:
                raise ValueError(f"USPTrainer with \"usp\": {{\"dynamic_sp\": true}} plans each optimizer step's "
                                 f"micro batches itself: set gradient_accumulation_steps=1 (not "
                                 f"{self.args.gradient_accumulation_steps}) and per_device_train_batch_size to the "
                                 f"sequences of one step")

    def _whole_feed(self) -> Optional[WholeBatches]:
        """The model's forward told to shard the whole sequences every rank of a group holds (once the engine exists);
        None without sequence parallelism."""
        if self._usp_sp == 1 or self._usp is None:
            return None
        if self._usp_feed is None:
            pad = getattr(getattr(self, "processing_class", None), "pad_token_id", None) or 0
            feed = WholeBatches(pad_token_id=pad)
            feed_whole_batches(self.model_wrapped.module, feed)
            self._usp_feed = feed
            if self._is_trl_sft():
                self._sft_under_sp()
        return self._usp_feed

    def _is_trl_sft(self) -> bool:
        return any(c.__name__ == "SFTTrainer" and _project(c) == "trl" for c in type(self).__mro__)

    def _sft_under_sp(self) -> None:
        """TRL's SFTTrainer computes its loss and metrics through its fused LM head (``model(...,
        fused_lm_head=True)``), which it installs with the defaults of ``add_fused_lm_head``: ds-usp's forward answers
        that call on the shards with the same settings."""
        from ds_usp.integration.step.logprobs import FUSED_HEAD_ATTR, FusedHead
        from ds_usp.upstream.trl import record_fused_head

        model = self.model_wrapped.module
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        if getattr(base, FUSED_HEAD_ATTR, None) is None:
            record_fused_head(base, FUSED_HEAD_ATTR, FusedHead())

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """The Trainer's (whole batches, the same on every rank of a group), its count of the step's targets taken
        over the replicas; under dynamic SP the step's micro batches planned by degree."""
        if self._whole_feed() is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        self._refuse_other_losses()
        if len(self._usp.topo.degrees) > 1:
            if self._running("get_batch_samples") != "Trainer.get_batch_samples":
                raise ValueError(f"{self._running('get_batch_samples')} would not run: under \"dynamic_sp\" ds-usp "
                                 f"plans each step's micro batches from the documents itself; remove the override or "
                                 f"set usp.dynamic_sp to false")
            batches = list(itertools.islice(epoch_iterator, num_batches))
            if not batches:
                return batches, None
            self._refuse_lost_documents(batches[0])
            return self._dynamic_step([self._prepare_inputs(b) for b in batches], device)
        with self._replicas():
            batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batches:
            self._refuse_lost_documents(batches[0])
        return batches, count

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """HF's count of the tokens seen, over the replicas (each batch once)."""
        with self._replicas():
            return super()._track_num_input_tokens(inputs)

    def _refuse_lost_documents(self, batch: Mapping[str, Any]) -> None:
        """Padding-free rows (several documents each, TRL's ``padding_free`` / ``packing``) whose collator gave no
        ``position_ids`` (nor ``seq_lens`` / ``cu_seq_lens_q``): the documents' boundaries are lost."""
        padding_free = getattr(self, "padding_free", None) or getattr(self.args, "padding_free", False)
        if padding_free and not any(batch.get(k) is not None for k in ("position_ids", "seq_lens", "cu_seq_lens_q")):
            raise ValueError(f"USPTrainer: the rows are padding-free (several documents each), but the data collator "
                             f"({type(self.data_collator).__name__}) gives the batch no position_ids (nor seq_lens or "
                             f"cu_seq_lens_q), so the documents' boundaries are lost and each would attend to the ones "
                             f"before it. Use TRL's collator, or make yours keep position_ids")

    # ---- dynamic SP: each optimizer step's documents on the degrees their lengths need -------------------------
    def _dynamic_step(self, batches: list, device: Any) -> tuple[list, Tensor]:
        """The step's sequences as documents (padding dropped, packed rows cut), planned by
        :func:`ds_usp.plan_step` with ``tokens_per_rank`` = the longest document over the SP size (it runs on the
        whole group, each shorter one on the smallest degree that holds it): one :class:`DynamicStep` holding every
        micro batch's shard, and the step's targets over the replicas."""
        from ds_usp.integration.data.dynamic import documents_of_batch, micro_batch_shards, step_targets

        visual = sorted(k for b in batches for k in VISUAL_KEYS if b.get(k) is not None)
        if visual:
            raise ValueError(f"USPTrainer: \"dynamic_sp\" takes text documents; this batch has {visual}")
        topo = self._usp.topo
        documents = [d for b in batches for d in documents_of_batch(b)]
        longest = max(int(d["input_ids"].numel()) for d in documents)
        shards = micro_batch_shards(topo, self._usp.layout, documents, -(-longest // topo.sp_size))
        count = torch.tensor(step_targets(documents), device=device)
        if topo.dp_size > 1:
            all_reduce_sum_(count, topo.dp_group, "targets of the step")  # the ranks of a group hold the same documents
        tokens = sum(int(d["input_ids"].numel()) for d in documents) if topo.sp_rank == 0 else 0
        return [DynamicStep(shards, tokens)], count

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Optional[Tensor] = None) -> Tensor:
        """A :class:`DynamicStep`: every micro batch's forward and backward through dynamic SP's one loop
        (:func:`~ds_usp.integration.step.dynamic.run_micro_batches`), accelerate's ``sync_gradients`` (DeepSpeed's
        accumulation boundary, and so its optimizer step) on the last; otherwise the Trainer's."""
        if not isinstance(inputs, DynamicStep):
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        try:
            with self._whole_feed().shards_given():  # the micro batches are shards already
                losses = run_micro_batches(
                    inputs.shards, lambda shard: self.compute_loss(model, shard, num_items_in_batch=num_items_in_batch),
                    accelerator_backward(self.accelerator))
        finally:
            set_sync_gradients(self.accelerator, True)
        return sum((loss.cpu() for loss in losses), torch.zeros(()))

    # ---- the loss ------------------------------------------------------------------------------------------
    def _refuse_other_losses(self) -> None:
        """Loss options that need the whole logits of a rank, which the SP loss never builds (no silent change)."""
        loss_type = getattr(self.args, "loss_type", None)
        for wanted, what in ((self.compute_loss_func is not None, "compute_loss_func"),
                             (self.label_smoother is not None, "label_smoothing_factor"),
                             (loss_type not in (None, "nll"), f"loss_type={loss_type!r}")):
            if wanted:
                raise ValueError(f"USPTrainer: {what} is not supported with \"sequence_parallel\": the loss is the "
                                 f"token-weighted cross entropy computed chunk by chunk over the sequence shards")

    def _running(self, method: str) -> str:
        """``Class.method`` of the class whose ``method`` runs under ds-usp's (a subclass's override, or HF's)."""
        owner = next(c for c in type(self).__mro__[1:] if method in vars(c) and not issubclass(c, USPTrainerBase))
        return f"{owner.__name__}.{method}"

    def compute_loss(self, model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
        """The class's own ``compute_loss`` (a subclass's override included), called as it was called: the model's
        forward shards the whole batch and its loss is the SP loss over the group, the Trainer's scaling seeing the
        replicas as its processes; a loss ds-usp cannot keep exact is refused, the method named."""
        feed = self._whole_feed()
        if feed is None:
            return super().compute_loss(model, inputs, *args, **kwargs)
        self._refuse_other_losses()
        own = super().compute_loss
        if self._is_trl_sft() and any(inputs.get(k) is not None for k in VISUAL_KEYS):
            # TRL's SFT loss goes through its fused LM head, which ds-usp's forward answers for text only: a VLM's
            # batch takes HF's loss (the same cross entropy; TRL's token metrics are not logged for it)
            from transformers import Trainer as HFTrainer

            own = functools.partial(HFTrainer.compute_loss, self)
        with feed.calling(self._running("compute_loss")), self._replicas():
            return own(model, inputs, *args, **kwargs)

    # ---- evaluation and prediction ----------------------------------------------------------------------------
    def prediction_step(self, model: Any, inputs: dict, prediction_loss_only: bool, *args: Any,
                        **kwargs: Any) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """The class's own ``prediction_step`` (a subclass's override included), called as it was called: the
        model's logits are the whole sequences' (gathered inside the group), and the Trainer gathers the results
        over the replicas only."""
        feed = self._whole_feed()
        if feed is None:
            return super().prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)
        self._refuse_other_losses()
        # the Trainer gathers right after this call: over the replicas only (also where accelerate's own count of
        # processes is not torch.distributed's: accelerate launch with DeepSpeed on a host without accelerators)
        self.gather_function = self._gather_over_replicas
        with feed.predicting(whole_logits=not prediction_loss_only), self._replicas():
            return super().prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)

    def _gather_over_replicas(self, tensor: Any) -> Any:
        """``gather_for_metrics`` over the replicas only: the ranks of an SP group hold the same results."""
        topo = self._usp.topo
        return gather_for_metrics(self.accelerator, tensor, topo.dp_group, topo.dp_size)


class DynamicStep(dict):
    """One dynamic-SP optimizer step, the one batch the Trainer's loop gets per step: ``shards``, this rank's shard of
    every micro batch; as a dict it holds only what the Trainer counts tokens seen from (``input_ids`` and
    ``attention_mask`` as long as the step's real tokens on the SP group's first rank, empty on the others, so that
    the sum over ranks counts each token once)."""

    def __init__(self, shards: list, tokens: int) -> None:
        super().__init__(input_ids=torch.zeros(tokens, dtype=torch.long),
                         attention_mask=torch.ones(tokens, dtype=torch.long))
        self.shards = shards


check_hooks()
check_accelerate_reads_deepspeed_initialize()
register_usp_attention()

from transformers import Seq2SeqTrainer, Trainer  # noqa: E402 - after the hook check


class USPTrainer(USPTrainerMixin, Trainer):
    """``transformers.Trainer`` with USP when the DeepSpeed JSON sets ``"sequence_parallel"``."""


class USPSeq2SeqTrainer(USPTrainerMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with USP (LLaMA-Factory's SFT trainer is one): its ``predict_with_generate``
    is refused under sequence parallelism, its loss-and-logits prediction is the Trainer's."""


# ds-usp's class of each HF trainer class it has one for
USP_CLASSES: dict[type, type] = {Trainer: USPTrainer, Seq2SeqTrainer: USPSeq2SeqTrainer}


if installed_version("trl") is not None:
    from trl import SFTTrainer  # noqa: E402

    class USPSFTTrainer(USPTrainerMixin, SFTTrainer):
        """``trl.SFTTrainer`` with USP (packed rows are exact; TRL's token accuracy and entropy metrics are not
        logged under sequence parallelism: they need the whole logits of each rank, which the chunked loss
        never builds)."""

    USP_CLASSES[SFTTrainer] = USPSFTTrainer


# ---- the DeepSpeed config's key alone: a Trainer made ds-usp's while it is created -----------------------------------

# TRL trainers that have a ds-usp class of their own (made by name: they set things up before the Trainer's __init__).
BY_NAME = {"GRPOTrainer": "USPGRPOTrainer", "RLOOTrainer": "USPRLOOTrainer", "DPOTrainer": "USPDPOTrainer"}


def _project(cls: type) -> str:
    return cls.__module__.split(".")[0]


@functools.cache
def usp_trainer_class(cls: type) -> type:
    """ds-usp's trainer class for an HF trainer class: ``USPTrainer`` / ``USPSFTTrainer`` for transformers' ``Trainer``
    / TRL's ``SFTTrainer``, ``USP<name>`` (:class:`USPTrainerMixin` first) for a subclass of either.

    Args:
        cls: the trainer's class.

    Returns:
        The class.

    Raises:
        ValueError: naming a class of the lineage ds-usp cannot take by the config alone (another transformers or TRL
            trainer: the one to use instead where ds-usp has one). A subclass's overrides (``compute_loss``,
            ``prediction_step``, its collator) run as they are: ds-usp's methods call them.
    """
    from transformers import Trainer as HFTrainer

    adoptable = {c for hf_class in USP_CLASSES for c in hf_class.__mro__}  # TRL's base trainer included
    for c in cls.__mro__[:cls.__mro__.index(HFTrainer) + 1]:
        if _project(c) in ("transformers", "trl"):
            if c not in adoptable:
                instead = BY_NAME.get(c.__name__)
                raise ValueError(f'{c.__module__}.{c.__name__} was given a DeepSpeed config with "sequence_parallel": '
                                 f"ds-usp makes transformers' Trainer and TRL's SFTTrainer (and subclasses of them) "
                                 f"sequence-parallel from the config alone, not {c.__name__}; "
                                 + (f"use ds_usp.{instead} instead of {c.__name__}" if instead else
                                    f'ds-usp has no sequence-parallel {c.__name__}: remove "sequence_parallel" from '
                                    f"the DeepSpeed config"))
            continue
    if cls in USP_CLASSES:
        return USP_CLASSES[cls]
    return type(f"USP{cls.__name__}", (USPTrainerMixin, cls),
                {"__module__": __name__, "__doc__": f"{cls.__name__} with USP (made from the DeepSpeed config's "
                                                     f"\"sequence_parallel\" by ds-usp)"})


def switch_attention(model: Any) -> Optional[str]:
    """Make a transformers model's attention ``"usp"`` (``set_attn_implementation``, after refusing a family whose
    attention does not go through transformers' attention interface).

    Args:
        model: the model given to the Trainer (a PEFT model's base model is switched); None (``model_init``: the model
            comes later, and ``ds_usp.initialize`` refuses it by name unless it was built with ``"usp"``).

    Returns:
        The implementation the model had (None: no model).

    Raises:
        ValueError: not a transformers model, or a family ds-usp cannot shard (named).
    """
    if model is None:
        return None
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    was = attention_implementation(getattr(inner, "config", None))
    if was is None or not callable(getattr(inner, "set_attn_implementation", None)):
        raise ValueError(f'{type(model).__name__} is not a transformers model, so ds-usp cannot make its attention '
                         f'sequence-parallel from the DeepSpeed config\'s "sequence_parallel": with a model of your '
                         f"own, use ds_usp.initialize, ds_usp.USPAttention and ds_usp.shard_batch in a loop of your "
                         f"own")
    if was != ATTN_NAME:
        register_usp_attention()
        refuse_non_interface_family(type(inner))
        inner.set_attn_implementation(ATTN_NAME)
    return was


def adopt(trainer: Any, *args: Any, **kwargs: Any) -> Any:
    """A Trainer (or TRL ``SFTTrainer``, or a subclass of either) whose DeepSpeed config sets ``"sequence_parallel"``,
    inside its ``create_accelerator_and_postprocess`` (the gate of ``_ds_usp_auto`` calls this): its class becomes
    ds-usp's (:func:`usp_trainer_class`), its model's attention ``"usp"`` (:func:`switch_attention`), and ds-usp's
    ``create_accelerator_and_postprocess`` runs (accelerate's engine then comes from ``ds_usp.initialize``). Logged on
    rank 0.

    Args:
        trainer: the Trainer being created.
        *args: the call's arguments.
        **kwargs: the call's keyword arguments.

    Returns:
        What ``create_accelerator_and_postprocess`` returns.

    Raises:
        ValueError: ``DS_USP_AUTO=0`` (a plain Trainer would give every rank whole sequences), or what
            :func:`usp_trainer_class` and :func:`switch_attention` refuse.
    """
    cls = type(trainer)
    if not auto_enabled():
        raise ValueError(f'{cls.__name__} was given a DeepSpeed config with "sequence_parallel", but ds-usp\'s '
                         f"automatic switch is off ({SWITCH}=0): this Trainer would give every rank whole sequences. "
                         f"Use ds_usp.USPTrainer (ds_usp.USPSFTTrainer for TRL's SFTTrainer), or unset {SWITCH}")
    usp_cls = usp_trainer_class(cls)
    was = switch_attention(trainer.model)
    become(trainer, usp_cls)
    log_rank0(f"{cls.__name__} -> {usp_cls.__name__}, attention {was!r} -> {ATTN_NAME!r}: the DeepSpeed config sets "
              f'"sequence_parallel" ({SWITCH}=0 turns this off)')
    return trainer.create_accelerator_and_postprocess(*args, **kwargs)
