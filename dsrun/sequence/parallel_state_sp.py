"""DeepSpeed's sequence-parallel ``mpu`` (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, a slimmed-down
Megatron ``parallel_state``): pass the module itself as ``initialize(mpu=...)``.

``initialize_sequence_parallel(S)`` cuts the world into sequence-parallel groups of S consecutive ranks (they share
samples, each holding 1/S of the sequence) and one sequence-data-parallel group over the whole world (what ZeRO
partitions and reduces over), as one :class:`dsrun.comm.ProcessGroups` with a sequence axis: the module's
``groups``, which the engine takes as the run's groups (``engine.seq_parallel_group`` is this module's group). As
in DeepSpeed, the model-parallel getters are the sequence-parallel ones (the only axis besides data), while the
engine counts no model parallelism for such an mpu (``engine.mp_world_size`` is 1, checkpoints are ``mp_rank_00``)
and takes the batch over ``world / S`` replicas.
"""
from __future__ import annotations

from typing import Any

from dsrun import comm
from dsrun.comm.groups import ProcessGroups

_GROUPS: ProcessGroups | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel groups of ``sequence_parallel_size`` consecutive ranks (collective: every
    rank calls it once)."""
    global _GROUPS
    if not comm.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() first")
    world = comm.get_world_size()
    if world < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is less than sequence_parallel_size {sequence_parallel_size}")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is not divisible by sequence_parallel_size {sequence_parallel_size}")
    if _GROUPS is not None:
        raise RuntimeError("sequence parallel group is already initialized")
    _GROUPS = ProcessGroups(sequence=sequence_parallel_size)


def __getattr__(name: str) -> Any:
    if name == "groups":  # the engine's view of this mpu: the whole topology (dsrun/engine/engine.py)
        return _GROUPS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _groups() -> ProcessGroups:
    if _GROUPS is None:
        raise RuntimeError("sequence parallel group is not initialized: call initialize_sequence_parallel(size)")
    return _GROUPS


def get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group."""
    return _groups().sequence


def get_sequence_data_parallel_group() -> Any:
    """The group over data x sequence ranks (None: the whole world)."""
    return _groups().data


def get_sequence_parallel_world_size() -> int:
    return comm.get_world_size(get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return comm.get_rank(get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(get_sequence_data_parallel_group())


# the only axis besides data is the sequence: DeepSpeed aliases model parallelism to it
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group


def is_sequence_parallel_mpu(mpu: object) -> bool:
    """Whether ``mpu`` is a sequence-parallel mpu like this module (DeepSpeed's test: it has
    ``initialize_sequence_parallel``), whose model-parallel getters are the sequence's."""
    return mpu is not None and hasattr(mpu, "initialize_sequence_parallel")
