"""Random-number states: what a checkpoint restores before recomputing, and the model-parallel RNG tracker.

Recomputation must draw the same random numbers as the first forward (dropout masks), so a checkpoint
snapshots the host generator, the accelerator's generator (CUDA only) and every state of the tracker, and
replays them around the recompute. The tracker (``get_cuda_rng_tracker``, Megatron's design) keeps named
generator states: ``fork(name)`` runs a block under that state and advances it, leaving the default state
untouched. "The device generator" is CUDA's on a CUDA rank and the host's on a CPU rank, so the same model
code runs on both (DeepSpeed's tracker works on CUDA only).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from dsrun.accelerator import get_accelerator

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's _MODEL_PARALLEL_RNG_TRACKER_NAME
# Megatron's offset between the data-parallel seed and the model-parallel seeds (kept for identical streams)
MODEL_PARALLEL_SEED_OFFSET = 2718


def _on_cuda() -> bool:
    return get_accelerator().name == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized()


def get_device_rng_state() -> torch.Tensor:
    """The state of the generator model code draws from on this rank (CUDA's current device, or the host)."""
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if _on_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def device_manual_seed(seed: int) -> None:
    """Seed the device generator only (on a CPU rank that is the host generator)."""
    if get_accelerator().name == "cuda" and torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states (DeepSpeed's name; on a CPU rank the states are the host generator's).

    ``add(name, seed)`` creates a state; ``fork(name)`` runs the ``with`` block under it, keeps what the block
    drew, and restores the state that was current before. ``get_states``/``set_states`` copy them all (what a
    checkpoint saves and replays).
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        current = get_device_rng_state()
        device_manual_seed(seed)
        self.states_[name] = get_device_rng_state()
        set_device_rng_state(current)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not in the tracker (add it first, e.g. with "
                             "model_parallel_cuda_manual_seed)")
        current = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(current)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's RNG tracker."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the two streams of a model-parallel run (call after model-parallel initialisation, and do not
    call ``torch.manual_seed`` afterwards): the default device generator gets ``seed`` (the same on every
    rank of a model-parallel group, for dropout outside model-parallel regions) and the tracker's
    ``model-parallel-rng`` state ``seed + 2718 + model-parallel rank`` (different within the group, the same
    across data-parallel replicas, for dropout inside model-parallel regions)."""
    from dsrun.activation_checkpointing.settings import STATE

    model_parallel_seed = seed + MODEL_PARALLEL_SEED_OFFSET + STATE.model_parallel.rank
    _TRACKER.reset()
    device_manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, model_parallel_seed)


@dataclass(frozen=True)
class RNGSnapshot:
    """Every generator state a recompute must replay."""

    host: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls) -> "RNGSnapshot":
        return cls(host=torch.get_rng_state(), device=torch.cuda.get_rng_state() if _on_cuda() else None,
                   tracker=_TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.device is not None:
            torch.cuda.set_rng_state(self.device)
        _TRACKER.set_states(self.tracker)


@contextlib.contextmanager
def replayed(snapshot: RNGSnapshot) -> Iterator[None]:
    """Run the block with the generators as they were at ``snapshot``; afterwards they are as before."""
    now = RNGSnapshot.capture()
    snapshot.restore()
    try:
        yield
    finally:
        now.restore()


def autocast_state(device_type: str) -> dict[str, Any]:
    """The autocast settings in force for ``device_type``, to re-enter them for the recompute."""
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type)}
