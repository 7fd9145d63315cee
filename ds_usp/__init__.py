"""ds-usp: Unified Sequence Parallelism (DeepSpeed-Ulysses x Ring-Attention) for DeepSpeed.

Importing the package does no work: no process groups, no compilation, no environment changes.
"""
from ds_usp import data, hf
from ds_usp.config import USPConfig, USPConfigError, load_usp_config
from ds_usp.data import USPDataLoader, shard_batch, sp_cross_entropy, sp_loss_value
from ds_usp.engine import USPState, initialize
from ds_usp.topology import GroupPlan, USPMpu, USPTopology, plan_groups
from ds_usp.usp import (USPAttention, gather_sequence, ring_attention, shard_sequence, ulysses_attention,
                        usp_attention)

__version__ = "0.1.0"

__all__ = ["USPConfig", "USPConfigError", "load_usp_config", "GroupPlan", "USPMpu", "USPTopology", "plan_groups",
           "USPAttention", "gather_sequence", "ring_attention", "shard_sequence", "ulysses_attention",
           "usp_attention", "data", "hf", "USPDataLoader", "shard_batch", "sp_cross_entropy", "sp_loss_value",
           "USPState", "initialize", "__version__"]
