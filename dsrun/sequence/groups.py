"""The sequence-parallel groups by DeepSpeed's names (``deepspeed.utils.groups._get_sequence_parallel_*``).

The engine registers its :class:`dsrun.comm.ProcessGroups` at initialize (:func:`_set_sequence_groups`);
layers built before that (the built-in GPT's attention) ask here on every forward, so they find the run's
group once the engine exists. Without a registered engine there is no sequence parallelism: the group is
this rank alone, size 1, rank 0.
"""
from __future__ import annotations

from typing import Any

from dsrun import comm

_process_groups: Any = None  # dsrun.comm.ProcessGroups of the running engine


def _set_sequence_groups(groups: Any) -> None:
    """Make ``groups`` (a ProcessGroups, or None to forget) the one the helpers below answer from."""
    global _process_groups
    _process_groups = groups


def _get_sequence_parallel_world_size() -> int:
    """Ranks that share one sample, each holding a slice of its sequence (``sequence_parallel_size``)."""
    return 1 if _process_groups is None else int(_process_groups.sequence_parallel_size)


def _get_sequence_parallel_rank() -> int:
    """This rank's position in its sequence-parallel group: which slice of the sequence it holds."""
    if _get_sequence_parallel_world_size() == 1:
        return 0
    return _process_groups.sequence_members().index(_process_groups.rank)


def _get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group (None only when it is the whole world)."""
    if _process_groups is None:
        raise KeyError("No sequence parallel group found: no engine with sequence_parallel_size has been built")
    return _process_groups.sequence


def _get_sequence_data_parallel_group() -> Any:
    """The group ZeRO partitions and reduces over: data x sequence ranks (the engine's data-parallel group)."""
    if _process_groups is None:
        return None
    return _process_groups.data


def _get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(_get_sequence_data_parallel_group())


def _get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(_get_sequence_data_parallel_group())
