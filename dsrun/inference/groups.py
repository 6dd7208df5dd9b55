"""The model-parallel (tensor-parallel) process group inference splits a model over.

One function, :func:`model_parallel_group`, so the source of the group is one place: a group the user
passed (``tensor_parallel.tp_group``), a Megatron-style ``mpu``, or groups of ``tp_size`` consecutive ranks
made through :mod:`dsrun.comm` (so the comms logger sees every collective of the model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dsrun import comm
from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Mpu(Protocol):
    """What inference reads of a Megatron-style ``mpu``."""

    def get_model_parallel_group(self) -> ProcessGroup | None: ...

    def get_model_parallel_rank(self) -> int: ...

    def get_model_parallel_world_size(self) -> int: ...

# (world size, tp size) -> this rank's group, made once per process
_GROUPS: dict[tuple[int, int], ProcessGroup | None] = {}


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group (``group=None``: the whole world, or no distribution)."""

    group: ProcessGroup | None
    rank: int
    size: int


def model_parallel_group(tp_size: int, tp_group: ProcessGroup | None = None, mpu: Mpu | None = None) -> TPGroup:
    """The group a model is split over. ``tp_size=1`` needs no process group at all."""
    if tp_group is not None:
        return _checked(TPGroup(tp_group, comm.get_rank(tp_group), comm.get_world_size(tp_group)), tp_size,
                        "tensor_parallel.tp_group")
    if mpu is not None:
        group = mpu.get_model_parallel_group()
        return _checked(TPGroup(group, mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
                        tp_size, "mpu")
    if tp_size == 1:
        return TPGroup(None, 0, 1)
    comm.init_distributed(verbose=False)
    world, rank = comm.get_world_size(), comm.get_rank()
    if world < tp_size:
        raise ConfigError(Problem("init_inference.tensor_parallel.tp_size", f"{tp_size} needs {tp_size} ranks; "
                                  f"this world has {world}", f"launch with dsrun launch --num_procs {tp_size} ..."))
    if world % tp_size:
        raise ConfigError(Problem("init_inference.tensor_parallel.tp_size", f"{tp_size} does not divide the "
                                  f"world size {world}", f"launch a multiple of {tp_size} ranks"))
    if tp_size == world:
        return TPGroup(None, rank, world)
    key = (world, tp_size)
    if key not in _GROUPS:
        # every rank creates every group, in the same order (torch.distributed requires it)
        for start in range(0, world, tp_size):
            group = comm.new_group(range(start, start + tp_size))
            if start <= rank < start + tp_size:
                _GROUPS[key] = group
    return TPGroup(_GROUPS[key], rank % tp_size, tp_size)


def _checked(found: TPGroup, tp_size: int, source: str) -> TPGroup:
    if tp_size not in (1, found.size):
        raise ConfigError(Problem("init_inference.tensor_parallel.tp_size", f"{tp_size} disagrees with the "
                                  f"{found.size} ranks of the group from {source}", "leave tp_size unset or equal"))
    return found
