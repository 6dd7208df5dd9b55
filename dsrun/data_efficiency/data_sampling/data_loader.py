"""The training loader of a curriculum: the data sampler's micro-batches, fetched, collated, post-processed.

``engine.deepspeed_io`` (and ``initialize(training_data=...)``) returns a :class:`CurriculumDataLoader` when
``data_efficiency.data_sampling.curriculum_learning`` is on, as DeepSpeed's loader switches to its
``DeepSpeedDataSampler``. ``post_process_func(batch, sampler_state)`` (``engine.set_data_post_process_func``)
sees the sampler's ``current_difficulties``; :func:`truncate_to_difficulty` is the usual one for a ``seqlen``
metric. ``data_sampling.num_workers`` fetches with that many worker processes; the state saved in a checkpoint
is always the state after the last batch handed out, however far the workers have read ahead.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from dsrun.data_efficiency.data_sampling.data_sampler import DeepSpeedDataSampler

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dsrun.config import DSConfig

B = TypeVar("B")  # a batch: a tensor, a tuple/list or dict of them, or anything else (left as it is)


class _Recording:
    """The sampler as a batch sampler that remembers its state before each batch it yields."""

    def __init__(self, sampler: DeepSpeedDataSampler, states: deque):
        self.sampler, self.states = sampler, states

    def __iter__(self) -> Iterator[list[int]]:
        while self.sampler.consumed_samples < self.sampler.total_samples:
            self.states.append(self.sampler.state_dict())
            yield self.sampler.next_indices()

    def __len__(self) -> int:
        return max(0, self.sampler.total_samples - self.sampler.consumed_samples) \
            // self.sampler.micro_batch_times_data_parallel_size


class CurriculumDataLoader:
    """Micro-batches for this rank; ``next(loader)`` endlessly (until ``num_epochs`` epochs are consumed)."""

    def __init__(self, dataset: Dataset, data_sampler: DeepSpeedDataSampler, collate_fn: Callable | None = None,
                 num_workers: int = 0, pin_memory: bool = False):
        self.dataset = dataset
        self.data_sampler = data_sampler
        self.collate_fn = collate_fn
        self.num_workers = int(num_workers)
        self.pin_memory = pin_memory
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None
        self.batch_size = data_sampler.micro_batch_size
        self._states: deque = deque()
        self._iterator: Iterator[Any] | None = None

    def __len__(self) -> int:
        return self.data_sampler.total_samples // self.data_sampler.micro_batch_times_data_parallel_size

    def __iter__(self) -> "CurriculumDataLoader":
        return self

    def _start(self) -> Iterator[Any]:
        self._states.clear()
        # its own generator: a DataLoader draws its workers' base seed when iterated, which must not move the
        # global RNG (a resumed run restarts the iteration and would otherwise drift from the uninterrupted one)
        seeds = torch.Generator().manual_seed(self.data_sampler.seed + self.data_sampler.curriculum_step)
        loader = DataLoader(self.dataset, batch_sampler=_Recording(self.data_sampler, self._states),
                            collate_fn=self.collate_fn, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            generator=seeds)
        return iter(loader)

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._start()
        batch = next(self._iterator)
        self._states.popleft()  # this batch is delivered: the next pending state (if any) is after it
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, self.state_dict())
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the last delivered batch."""
        return self._states[0] if self._states else self.data_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_sampler.load_state_dict(state)
        self._iterator = None  # restart the fetching from the restored position
        self._states.clear()


def truncate_to_difficulty(metric: str = "seqlen") -> Callable[[Any, dict[str, Any]], Any]:
    """A ``post_process_func`` cutting every ``[batch, seq]`` tensor of the batch to the first
    ``current_difficulties[metric]`` positions (a seqlen curriculum of the data efficiency library)."""

    def truncate(batch: B, state: dict[str, Any]) -> B:
        length = int(state["current_difficulties"][metric])
        if isinstance(batch, torch.Tensor):
            return batch[:, :length] if batch.dim() >= 2 else batch
        if isinstance(batch, (tuple, list)):
            return type(batch)(truncate(item, state) for item in batch)
        if isinstance(batch, dict):
            return {k: truncate(v, state) for k, v in batch.items()}
        return batch

    return truncate


def build_curriculum_loader(config: DSConfig, dataset: Dataset, batch_size: int, data_parallel_rank: int,
                            data_parallel_size: int, gradient_accumulation_steps: int, global_rank: int = 0,
                            data_parallel_group: ProcessGroup | None = None, collate_fn: Callable | None = None,
                            pin_memory: bool = False) -> CurriculumDataLoader:
    """The loader ``engine.deepspeed_io`` returns when the data sampling curriculum is on (``config`` is the
    whole DeepSpeed config)."""
    de = config.data_efficiency
    sampler = DeepSpeedDataSampler(de, len(dataset), batch_size, data_parallel_rank, data_parallel_size,
                                   data_parallel_group, gradient_accumulation_steps, global_rank)
    return CurriculumDataLoader(dataset, sampler, collate_fn=collate_fn, num_workers=de.data_sampling.num_workers,
                                pin_memory=pin_memory or de.data_sampling.pin_memory)
