"""ds-usp: Unified Sequence Parallelism (DeepSpeed-Ulysses x Ring-Attention) for DeepSpeed.

The layers (docs/architecture.md), data flowing down: :mod:`.config` and :mod:`.splits`, :mod:`.topology`,
:mod:`.comm`, :mod:`.cost` and :mod:`.upstream`, :mod:`.kernels`, :mod:`.native` and :mod:`.sharding`,
:mod:`.attention` and :mod:`.linear`, :mod:`.integration`. Importing the package registers things and does nothing
else (no process groups, no compilation, no environment changes, neither DeepSpeed nor transformers imported): its
custom operators with torch; its config key with DeepSpeed and HF's Trainer (it fills the handler table of the
top-level bootstrap ``_ds_usp_auto`` and installs its gates, which an installed ds-usp's ``.pth`` also installs at
interpreter start: ``deepspeed.initialize`` given a ``"sequence_parallel"`` config is :func:`initialize`, now or when
DeepSpeed is imported); ``attn_implementation="usp"`` with transformers (now if its modeling code is imported, else
right after it is). ``ds_usp.USPTrainer`` / ``ds_usp.USPSFTTrainer`` import transformers (and TRL) on
first use.
"""
import _ds_usp_auto
from ds_usp.attention import USPAttention, ring_attention, ulysses_attention, usp_attention
from ds_usp.config import USPConfig, USPConfigError, load_usp_config
from ds_usp.integration.data import batch as data
from ds_usp.integration.data.batch import shard_batch
from ds_usp.integration.data.dynamic import plan_step
from ds_usp.integration.data.loader import USPDataLoader
from ds_usp.integration.engine.initialize import USPState, initialize
from ds_usp.integration.engine.preflight import choose_device
from ds_usp.integration.models import attention as hf
from ds_usp.integration.step.dynamic import dynamic_sp_step
from ds_usp.integration.step.loss import sp_cross_entropy
from ds_usp.sharding import gather_sequence, shard_sequence
from ds_usp.topology import GroupRanks, USPMpu, USPTopology, group_ranks
from ds_usp.upstream.deepspeed import count_batch_over_replicas, route_initialize

__version__ = "0.1.0"


def _register_attention(modeling_utils: object) -> None:
    """``attn_implementation="usp"`` with transformers, once its modeling code (the attention registry) is imported."""
    hf.register_usp_attention()


def _initialize_gate(original: object, call: dict) -> object:
    """The ``deepspeed.initialize`` gate's handler: :func:`initialize` for a call whose config sets the key."""
    return route_initialize(original, call, initialize)


def _trainer_config_gate(original: object, hf_config: object, args: tuple, kwargs: dict) -> object:
    """The ``TrainingArguments`` gate's handler: HF's ``"auto"`` values with the batch counted over replicas."""
    from ds_usp.integration.trainers.trainer import process_trainer_config

    return process_trainer_config(original, hf_config, args, kwargs)


def _trainer_gate(trainer: object, *args: object, **kwargs: object) -> object:
    """The Trainer gate's handler: a Trainer whose DeepSpeed config sets the key becomes ds-usp's."""
    from ds_usp.integration.trainers.trainer import adopt

    return adopt(trainer, *args, **kwargs)


# the gates: deepspeed.initialize, DeepSpeed's config, HF's "auto" batch size, the Trainer (handlers, then the finder)
_ds_usp_auto.serve({"deepspeed.initialize": _initialize_gate, "deepspeed_config": count_batch_over_replicas,
                    "trainer_config": _trainer_config_gate, "trainer": _trainer_gate})
_ds_usp_auto.install()
_ds_usp_auto.when_imported("transformers.modeling_utils", _register_attention)


_RL_TRAINERS = ("USPGRPOTrainer", "USPRLOOTrainer", "USPDPOTrainer")


def __getattr__(name: str):
    """The trainers, imported on first use (they import transformers and TRL)."""
    if name in ("USPTrainer", "USPSeq2SeqTrainer", "USPSFTTrainer", "USPGRPOTrainer", "USPRLOOTrainer",
                "USPDPOTrainer"):
        import importlib

        module = importlib.import_module("ds_usp.integration.trainers." + ("rl" if name in _RL_TRAINERS else "trainer"))
        if not hasattr(module, name):  # a TRL trainer without TRL
            raise AttributeError(f"ds_usp.{name} needs TRL: pip install trl")
        return getattr(module, name)
    raise AttributeError(f"module 'ds_usp' has no attribute {name!r}")

__all__ = ["USPConfig", "USPConfigError", "load_usp_config", "GroupRanks", "USPMpu", "USPTopology", "group_ranks",
           "USPAttention", "gather_sequence", "ring_attention", "shard_sequence", "ulysses_attention",
           "usp_attention", "data", "hf", "USPDataLoader", "shard_batch", "sp_cross_entropy",
           "dynamic_sp_step", "plan_step",
           "USPState", "initialize", "choose_device", "USPTrainer", "USPSeq2SeqTrainer", "USPSFTTrainer", *_RL_TRAINERS, "__version__"]
