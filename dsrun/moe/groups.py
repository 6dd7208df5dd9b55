"""``deepspeed.utils.groups``: the expert-parallel and expert-data-parallel groups MoE layers use, by name.

DeepSpeed names the groups of expert-parallel size E ``"ep_size_E"``; an expert parameter carries that name
(``param.group_name``) and ``param.allreduce = False``. Here the groups themselves live in one
:class:`dsrun.comm.ProcessGroups` (laid out as DeepSpeed does: E consecutive data-parallel ranks hold one
layer's experts, the ranks at the same position in each of those groups are an expert's replicas). The engine
registers its own at initialize (:func:`_set_process_groups`); before that, or without an engine, the first
call builds one over the whole world (data parallelism only). Creating groups is collective: every rank must
ask for the same sizes in the same order.
"""
from __future__ import annotations

from typing import Any

from dsrun import comm
from dsrun.comm import ProcessGroups

_process_groups: ProcessGroups | None = None
_expert_sizes: dict[str, int] = {}  # group name -> expert-parallel size, in creation order


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the groups of expert-parallel size ``ep_size``."""
    return f"ep_size_{int(ep_size)}"


def _set_process_groups(groups: ProcessGroups | None) -> None:
    """Make ``groups`` the one the helpers below answer from (the engine's, at initialize)."""
    global _process_groups
    _process_groups = groups
    if groups is not None:
        for size in list(_expert_sizes.values()):
            groups.expert(size)  # same order on every rank: collective creation stays aligned


def _groups() -> ProcessGroups:
    global _process_groups
    if _process_groups is None:
        if not comm.is_initialized():
            raise RuntimeError("expert-parallel groups need torch.distributed: call dsrun.init_distributed() "
                               "first (or dsrun.initialize, which does)")
        _process_groups = ProcessGroups()
    return _process_groups


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False) -> None:
    """Create (once) the expert-parallel and expert-data-parallel groups of size ``expert_parallel_size_``."""
    size = int(expert_parallel_size_)
    _groups().set_expert_layout(use_data_before_expert_parallel_)
    _groups().expert(size)
    _expert_sizes.setdefault(expert_group_name(size), size)


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Deprecated in DeepSpeed (the MoE layer creates its groups); kept for scripts that still call it."""
    if mpu is not None:
        _set_process_groups(comm.groups.from_data_group(mpu.get_data_parallel_group()))
    _create_expert_and_data_parallel(ep_size)


def _size_of(group_name: str) -> int:
    if group_name not in _expert_sizes:
        raise KeyError(f"no expert groups named {group_name!r}; created: {sorted(_expert_sizes) or 'none'}")
    return _expert_sizes[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return _groups().expert(_size_of(group_name))


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _groups().expert_data(_size_of(group_name))


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: _get_expert_parallel_group(name) for name in _expert_sizes}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: _get_expert_data_parallel_group(name) for name in _expert_sizes}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return len(_groups().expert_members(_size_of(group_name))[0])


def _get_expert_parallel_rank(group_name: str) -> int:
    members = _groups().expert_members(_size_of(group_name))[0]
    return members.index(_groups().rank)


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return len(_groups().expert_members(_size_of(group_name))[1])


def _get_expert_data_parallel_rank(group_name: str) -> int:
    members = _groups().expert_members(_size_of(group_name))[1]
    return members.index(_groups().rank)


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank an expert's replicas start from (the first of its expert-data-parallel group)."""
    return _groups().expert_members(_size_of(group_name))[1][0]


def _get_expert_parallel_src_rank(group_name: str) -> int:
    return _groups().expert_members(_size_of(group_name))[0][0]


def _get_max_expert_size() -> int | None:
    return max(_expert_sizes.values()) if _expert_sizes else None


def _get_max_expert_size_name() -> str | None:
    size = _get_max_expert_size()
    return None if size is None else expert_group_name(size)


def _get_data_parallel_group() -> Any:
    return _groups().data


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size(_groups().data)


def _get_data_parallel_rank() -> int:
    return comm.get_rank(_groups().data)


def _get_model_parallel_world_size() -> int:
    return _groups().size("model")


def _get_model_parallel_rank() -> int:
    return _groups().coord("model")


def _reset() -> None:
    """Forget the registered groups and names (tests; ``engine.destroy()``)."""
    global _process_groups
    _process_groups = None
    _expert_sizes.clear()
