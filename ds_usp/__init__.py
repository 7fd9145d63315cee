"""ds-usp: Unified Sequence Parallelism (DeepSpeed-Ulysses x Ring-Attention) for DeepSpeed.

The layers (docs/architecture.md), data flowing down: :mod:`.config`, :mod:`.topology`, :mod:`.comm`,
:mod:`.kernels` and :mod:`.ops`, :mod:`.attention`, :mod:`.sharding`, :mod:`.integration`. Importing the
package registers its custom operators with torch and its config key with DeepSpeed (``deepspeed.initialize``
given a ``"sequence_parallel"`` config is :func:`initialize`) and starts a daemon thread that names a stale JIT build
lock instead of letting a build wait on it forever (:mod:`ds_usp.native.build_locks`), and does nothing else: no
process groups, no compilation, no environment changes. ``ds_usp.USPTrainer`` / ``ds_usp.USPSFTTrainer`` import transformers (and
TRL) on first use.
"""
from ds_usp.attention import USPAttention, ring_attention, ulysses_attention, usp_attention
from ds_usp.config import USPConfig, USPConfigError, load_usp_config
from ds_usp.integration.data import batch as data
from ds_usp.integration.data.batch import shard_batch
from ds_usp.integration.data.dynamic import dynamic_sp_step, plan_step
from ds_usp.integration.data.loader import USPDataLoader
from ds_usp.integration.engine.initialize import USPState, initialize, install_deepspeed_hook
from ds_usp.integration.models import attention as hf
from ds_usp.integration.step.loss import sp_cross_entropy
from ds_usp.sharding import gather_sequence, shard_sequence
from ds_usp.topology import GroupRanks, USPMpu, USPTopology, group_ranks

__version__ = "0.1.0"

install_deepspeed_hook()


_RL_TRAINERS = ("USPGRPOTrainer", "USPRLOOTrainer", "USPDPOTrainer")


def __getattr__(name: str):
    """The trainers, imported on first use (they import transformers and TRL)."""
    if name in ("USPTrainer", "USPSFTTrainer", "USPGRPOTrainer", "USPRLOOTrainer", "USPDPOTrainer"):
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
           "USPState", "initialize", "USPTrainer", "USPSFTTrainer", *_RL_TRAINERS, "__version__"]
