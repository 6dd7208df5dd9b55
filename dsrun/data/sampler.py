"""Deterministic, resumable batches per rank.

The order is global: epoch ``e`` visits every training window once, in a permutation seeded by
``(seed, e)``; the stream of all epochs is read front to back. At each step the ``world_size`` ranks together
take the next ``world_size * batch_size`` samples of that stream, rank ``r`` the ``r``-th slice of
``batch_size``. So a batch depends only on (seed, rank, world size, batch size, position), ranks never
share a sample within a step, and the position is one number, ``consumed_samples``, which is the whole
resumable state. Because the state counts samples and not steps, a run resumed with another world size or
micro-batch size (same global order) continues exactly where it stopped.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from dsrun.data.dataset import TokenWindows
from dsrun.utils.errors import Problem, UserError


def _check_rank(rank: int, world_size: int, batch_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if batch_size < 1:
        raise UserError(Problem("train_micro_batch_size_per_gpu", f"must be at least 1, got {batch_size}"))


class ResumableSampler:
    """Per-rank index batches of a global, seeded sample order; see the module docstring."""

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True):
        _check_rank(rank, world_size, batch_size)
        if num_samples < 1:
            raise UserError(Problem("data", "has no complete training window",
                                    "use more text or a smaller data.seq_len"))
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = 0
        self._orders: dict[int, np.ndarray] = {}

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def step(self) -> int:
        """Batches this sampler has handed out (when it started from zero with this world size)."""
        return self.consumed_samples // self.global_batch

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # batches only ever straddle two neighbouring epochs
                self._orders.pop(min(self._orders))
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._orders[epoch] = rng.permutation(self.num_samples)
            else:
                self._orders[epoch] = np.arange(self.num_samples)
        return self._orders[epoch]

    def indices_from(self, consumed_samples: int) -> list[int]:
        """This rank's indices for the step that begins after ``consumed_samples`` global samples."""
        first = consumed_samples + self.rank * self.batch_size
        positions = range(first, first + self.batch_size)
        return [int(self._order(p // self.num_samples)[p % self.num_samples]) for p in positions]

    def indices_at(self, step: int) -> list[int]:
        """This rank's indices at ``step`` (counting from the start of training)."""
        return self.indices_from(step * self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_indices()

    def next_indices(self) -> list[int]:
        indices = self.indices_from(self.consumed_samples)
        self.consumed_samples += self.global_batch
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "num_samples": self.num_samples,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(Problem(f"data sampler state.{key}", f"the checkpoint has {state[key]!r} but "
                                        f"this run has {getattr(self, key)!r}",
                                        "resume with the same seed and data, or start a fresh run"))
        self.consumed_samples = int(state["consumed_samples"])


class TrainLoader:
    """An endless iterator of ``(inputs, targets)`` batches ``[batch_size, seq_len]`` for one rank.

    ``next(loader)`` gives the next micro-batch; ``state_dict()`` / ``load_state_dict()`` save and restore
    the exact position (store it in the checkpoint's client state).
    """

    def __init__(self, dataset: TokenWindows, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        self.dataset = dataset
        self.sampler = ResumableSampler(len(dataset), batch_size, rank, world_size, seed, shuffle)

    def __iter__(self) -> "TrainLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.batch(self.sampler.next_indices())

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step`` without moving the position (for checks and replays)."""
        return self.dataset.batch(self.sampler.indices_at(step))

    @property
    def step(self) -> int:
        return self.sampler.step

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class EvalLoader:
    """The same evaluation batches on every pass: windows in order, split across ranks per step.

    Only complete global batches are used, so every rank sees the same number of batches (an all-reduce
    of the eval loss then never waits on a rank that ran out). ``max_batches`` caps the pass.
    """

    def __init__(self, dataset: TokenWindows, batch_size: int, rank: int = 0, world_size: int = 1,
                 max_batches: int | None = None):
        _check_rank(rank, world_size, batch_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        available = len(dataset) // (batch_size * world_size)
        if available < 1:
            raise UserError(Problem("data.eval_fraction", f"the eval split has {len(dataset)} windows, fewer "
                                    f"than one global batch ({batch_size} x {world_size} ranks)",
                                    "raise data.eval_fraction, or lower the batch size or data.seq_len"))
        self.num_batches = available if max_batches is None else max(1, min(available, max_batches))

    def __len__(self) -> int:
        return self.num_batches

    def indices_at(self, step: int) -> list[int]:
        first = (step * self.world_size + self.rank) * self.batch_size
        return list(range(first, first + self.batch_size))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(self.num_batches):
            yield self.dataset.batch(self.indices_at(step))
