"""AutoSP's mesh of ranks (DeepSpeed's ``deepspeed.compile.custom_ops.sp_dp_registry``): the world as ``dp_size``
sequence-parallel groups of ``sp_size`` consecutive ranks, rank ``r`` in group ``r // sp_size``.

One registry per process, filled once (:func:`populate_registry`); AutoSP's graph edits and its all-to-all read
``sp_size()`` and a rank's group from it at the time they run.
"""
from __future__ import annotations

from typing import Any

from dsrun import comm

GROUP_REGISTRY: dict[Any, Any] = {}  # group index -> process group; and 'SP_SIZE', 'DP_SIZE', 'is_reg'


def register_groups(groups: list[list[int]]) -> None:
    """One process group per list of ranks (``[[0, 1], [2, 3]]``), indexed by its position; every rank calls it."""
    for gid, ranks in enumerate(groups):
        if gid not in GROUP_REGISTRY:
            GROUP_REGISTRY[gid] = comm.new_group(ranks)


def get_group(gid: int | None) -> Any:
    """Sequence-parallel group ``gid``; None is the whole world."""
    return GROUP_REGISTRY[gid] if gid is not None else comm.get_world_group()


def get_registry() -> dict[Any, Any]:
    return GROUP_REGISTRY


def is_setup() -> bool:
    return bool(GROUP_REGISTRY.get("is_reg", False))


def extract_mesh_size(param_dict: dict[str, Any]) -> tuple[int, int]:
    """``(sp_size, dp_size)`` from a config's ``sequence_parallel_size`` and the world size."""
    sp = int(param_dict.get("sequence_parallel_size", 1))
    world = comm.get_world_size()
    if world % sp:
        raise ValueError(f"sequence_parallel_size {sp} does not divide the world size {world}")
    return sp, world // sp


def sp_size() -> int:
    if "SP_SIZE" not in GROUP_REGISTRY:
        raise RuntimeError("AutoSP's mesh is not set up: populate_registry(sp_size, dp_size) first")
    return GROUP_REGISTRY["SP_SIZE"]


def dp_size() -> int:
    if "DP_SIZE" not in GROUP_REGISTRY:
        raise RuntimeError("AutoSP's mesh is not set up: populate_registry(sp_size, dp_size) first")
    return GROUP_REGISTRY["DP_SIZE"]


def populate_registry(sp: int, dp: int) -> None:
    """Make the ``dp`` groups of ``sp`` consecutive ranks (once per process: later calls change nothing)."""
    if is_setup():
        return
    register_groups([list(range(g * sp, (g + 1) * sp)) for g in range(dp)])
    GROUP_REGISTRY.update(SP_SIZE=sp, DP_SIZE=dp, is_reg=True)


def my_group() -> Any:
    """This rank's sequence-parallel group."""
    return get_group(comm.get_rank() // sp_size())
