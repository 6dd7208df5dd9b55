"""``deepspeed.utils.groups``: the expert-parallel and expert-data-parallel groups MoE layers use, by name.

DeepSpeed names the groups of expert-parallel size E ``"ep_size_E"``; an expert parameter carries that name
(``param.group_name``) and ``param.allreduce = False``. The groups themselves are the run's one
:class:`dsrun.comm.ProcessGroups` (:func:`dsrun.comm.groups.current_groups`; laid out as DeepSpeed does: E
consecutive data-parallel ranks hold one layer's experts, the ranks at the same position in each of those
groups are an expert's replicas), and a name exists once its groups do. The engine makes its own groups the
current ones at initialize; before that, or without an engine, the first call that creates a group builds
groups over the whole world (data parallelism only). Creating groups is collective: every rank must ask for
the same sizes in the same order.
"""
from __future__ import annotations

from typing import Any, Protocol

from dsrun import comm
from dsrun.comm import ProcessGroups
from dsrun.comm.comm import ProcessGroup
from dsrun.comm.groups import current_groups, set_current_groups


class DataParallelMpu(Protocol):
    """Megatron's model-parallel unit, as far as the expert groups read it."""

    def get_data_parallel_group(self) -> ProcessGroup: ...


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the groups of expert-parallel size ``ep_size``."""
    return f"ep_size_{int(ep_size)}"


def _groups() -> ProcessGroups:
    """The run's groups; without any yet, groups over the whole world become the run's."""
    if current_groups() is None:
        if not comm.is_initialized():
            raise RuntimeError("expert-parallel groups need torch.distributed: call dsrun.init_distributed() "
                               "first (or dsrun.initialize, which does)")
        set_current_groups(ProcessGroups())
    return current_groups()


def _expert_sizes() -> dict[str, int]:
    """Group name -> expert-parallel size of the expert groups that exist, in creation order."""
    groups = current_groups()
    return {} if groups is None else {expert_group_name(size): size for size in groups.expert_sizes()}


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel rank lists, expert-data-parallel rank lists) of a world laid out pipe, data, model
    (rank = (pipe * D + data) * M + model), without creating any group: DeepSpeed's pure helper.

    Each data-parallel group (one per pipeline stage and model-parallel rank, stages first) is cut into
    expert-parallel groups of E consecutive members, and the members at the same position in each are an
    expert-data-parallel group. World 16, M 2, E 4: experts ``[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], ...``,
    replicas ``[0, 8], [2, 10], ...``. ``use_data_before_expert_parallel_`` orders each data group data-first
    (an expert's replicas are neighbours, a layer's experts strided) before cutting it.
    """
    model, pipe, experts = int(tensor_parallel_size_), int(pipeline_parallel_size_), int(expert_parallel_size_)
    if world_size % (model * pipe):
        raise ValueError(f"world size {world_size} is not divisible by model x pipeline parallel {model * pipe}")
    data = world_size // (model * pipe)
    if data % experts:
        raise ValueError(f"data-parallel size {data} is not divisible by expert-parallel size {experts}")
    stride = data // experts  # expert-data-parallel size
    expert_groups: list[list[int]] = []
    replica_groups: list[list[int]] = []
    for stage_start in range(0, world_size, world_size // pipe):
        for model_rank in range(model):
            ranks = [stage_start + model_rank + k * model for k in range(data)]
            if use_data_before_expert_parallel_:
                ranks = [ranks[first + k * stride] for first in range(stride) for k in range(experts)]
            blocks = [ranks[i:i + experts] for i in range(0, data, experts)]
            expert_groups += blocks
            replica_groups += [list(members) for members in zip(*blocks)]
    return expert_groups, replica_groups


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False) -> None:
    """Create (once) the expert-parallel and expert-data-parallel groups of size ``expert_parallel_size_``."""
    size = int(expert_parallel_size_)
    _groups().set_expert_layout(use_data_before_expert_parallel_)
    _groups().expert(size)


def initialize(ep_size: int = 1, mpu: DataParallelMpu | None = None) -> None:
    """Deprecated in DeepSpeed (the MoE layer creates its groups); kept for scripts that still call it."""
    if mpu is not None:
        set_current_groups(comm.groups.from_data_group(mpu.get_data_parallel_group()))
    _create_expert_and_data_parallel(ep_size)


def _size_of(group_name: str) -> int:
    sizes = _expert_sizes()
    if group_name not in sizes:
        raise KeyError(f"no expert groups named {group_name!r}; created: {sorted(sizes) or 'none'}")
    return sizes[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return _groups().expert(_size_of(group_name))


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _groups().expert_data(_size_of(group_name))


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: _get_expert_parallel_group(name) for name in _expert_sizes()}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: _get_expert_data_parallel_group(name) for name in _expert_sizes()}


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
    sizes = _expert_sizes()
    return max(sizes.values()) if sizes else None


def _get_max_expert_size_name() -> str | None:
    size = _get_max_expert_size()
    return None if size is None else expert_group_name(size)


def _get_max_expert_parallel_group() -> Any:
    """The expert-parallel group of the largest expert-parallel size created (where an overflow in any
    expert shows up)."""
    name = _get_max_expert_size_name()
    if name is None:
        raise RuntimeError("expert parallel group is not initialized: create one first "
                           "(groups._create_expert_and_data_parallel(ep_size), or build an MoE layer)")
    return _get_expert_parallel_group(name)


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
    """Forget the run's groups, and with them the expert groups' names (tests; ``engine.destroy()``)."""
    set_current_groups(None)
