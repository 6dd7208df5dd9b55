"""The sequence-parallel groups by DeepSpeed's names (``deepspeed.utils.groups._get_sequence_parallel_*``).

They answer from the run's one :class:`dsrun.comm.ProcessGroups` (:func:`dsrun.comm.groups.current_groups`,
which the engine sets at initialize); layers built before that (the built-in GPT's attention) ask here on every
forward, so they find the run's group once the engine exists. Without the run's groups there is no sequence
parallelism: the group is this rank alone, size 1, rank 0.
"""
from __future__ import annotations

from typing import Any

from dsrun import comm
from dsrun.comm.groups import current_groups


def _get_sequence_parallel_world_size() -> int:
    """Ranks that share one sample, each holding a slice of its sequence (``sequence_parallel_size``)."""
    groups = current_groups()
    return 1 if groups is None else int(groups.sequence_parallel_size)


def _get_sequence_parallel_rank() -> int:
    """This rank's position in its sequence-parallel group: which slice of the sequence it holds."""
    if _get_sequence_parallel_world_size() == 1:
        return 0
    groups = current_groups()
    return groups.sequence_members().index(groups.rank)


def _get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group (None only when it is the whole world)."""
    groups = current_groups()
    if groups is None:
        raise KeyError("No sequence parallel group found: no engine with sequence_parallel_size has been built")
    return groups.sequence


def _get_sequence_data_parallel_group() -> Any:
    """The group ZeRO partitions and reduces over: data x sequence ranks (the engine's data-parallel group)."""
    groups = current_groups()
    return None if groups is None else groups.data


def _get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(_get_sequence_data_parallel_group())


def _get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(_get_sequence_data_parallel_group())
