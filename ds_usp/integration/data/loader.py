"""The data loader that yields a rank's shards: :class:`USPDataLoader` over a loader of full-sequence batches."""
from __future__ import annotations

from typing import Any, Iterator, Optional

from torch import Tensor

from ds_usp.comm import all_gather_objects
from ds_usp.integration.data.batch import shard_batch
from ds_usp.sharding import check_layout
from ds_usp.topology import USPTopology


class USPDataLoader:
    """Wrap a DataLoader of full-sequence batches so that it yields this rank's shards.

    Two ways of feeding it, told apart by the loader's sampler (or ``per_rank``):

    * every rank of an SP group gets the same batch (DeepSpeed's loader, or a ``DistributedSampler`` with
      ``num_replicas=dp_size, rank=dp_rank``): each batch is sharded as it comes;
    * an ordinary ``DistributedSampler`` over **all** ranks (``num_replicas`` = world size), so each rank gets its
      own samples, as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` accepts: the SP group's batches are gathered and
      the group trains them one after the other, SP rank 0's first, so every loader step yields ``sp_size``
      shards. Per optimizer step, set ``gradient_accumulation_steps`` to ``sp_size`` times what each rank's own
      batches would need: the step then averages the same samples as one process would (tested equal).

    Args:
        loader: any iterable of batches (dicts with ``input_ids`` and optional ``labels``...).
        topo: the topology.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.
        pad_token_id: token used to pad the sequence end.
        per_rank: whether each rank's batches are its own (None: a ``DistributedSampler`` over the whole world
            says so).

    Raises:
        ValueError: a bad layout.
    """

    def __init__(self, loader: Any, topo: USPTopology, layout: str = "zigzag", pad_token_id: int = 0,
                 per_rank: Optional[bool] = None) -> None:
        check_layout(layout)
        self.loader, self.topo, self.layout, self.pad_token_id = loader, topo, layout, pad_token_id
        self.per_rank = (_samples_every_rank(loader, topo) if per_rank is None else per_rank) and topo.sp_size > 1

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        for batch in self.loader:
            if not self.per_rank:
                yield shard_batch(batch, self.topo, self.layout, self.pad_token_id)
                continue
            mine = {k: v.cpu() if isinstance(v, Tensor) else v for k, v in batch.items()}
            device = batch["input_ids"].device if isinstance(batch.get("input_ids"), Tensor) else None
            for theirs in all_gather_objects(mine, self.topo.sp_group, "per-rank batches"):
                theirs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in theirs.items()}
                yield shard_batch(theirs, self.topo, self.layout, self.pad_token_id)

    def __len__(self) -> int:
        return len(self.loader) * (self.topo.sp_size if self.per_rank else 1)


def _samples_every_rank(loader: Any, topo: USPTopology) -> bool:
    """Whether ``loader`` draws through a ``DistributedSampler`` over the whole world (each rank its own samples)."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return isinstance(sampler, DistributedSampler) and sampler.num_replicas == topo.sp_size * topo.dp_size
