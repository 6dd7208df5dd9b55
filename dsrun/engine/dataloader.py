"""The distributed data loader ``engine.deepspeed_io`` (and ``initialize(training_data=...)``) returns.

Each data-parallel rank reads its own shard through a ``DistributedSampler`` (shuffled, seed 0, reshuffled
each epoch), in micro-batches of ``train_micro_batch_size_per_gpu``; ``dataloader_drop_last`` drops a
ragged final batch.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


class DeepSpeedDataLoader:
    """An iterable of micro-batches for this rank; ``len()`` is the number of micro-batches per epoch."""

    def __init__(self, dataset: Dataset, batch_size: int, pin_memory: bool = False, local_rank: int = 0,
                 collate_fn: Callable | None = None, num_local_io_workers: int | None = None,
                 data_sampler: Sampler | None = None, data_parallel_world_size: int = 1, data_parallel_rank: int = 0,
                 dataloader_drop_last: bool = False):
        self.dataset = dataset
        self.batch_size = batch_size
        if data_sampler is None:
            data_sampler = DistributedSampler(dataset, num_replicas=data_parallel_world_size,
                                              rank=data_parallel_rank, shuffle=True, seed=0)
        self.data_sampler = data_sampler
        self.epoch = 0
        self.dataloader = DataLoader(dataset, batch_size=batch_size, sampler=data_sampler, collate_fn=collate_fn,
                                     num_workers=num_local_io_workers or 0, pin_memory=pin_memory,
                                     drop_last=dataloader_drop_last)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> Iterator[Any]:
        if hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.dataloader)
