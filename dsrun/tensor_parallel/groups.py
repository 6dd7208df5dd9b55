"""DeepSpeed's tensor-parallel group getters (``deepspeed.utils.groups.get_tensor_model_parallel_*``), read from the
run's groups (:func:`dsrun.comm.groups.current_groups`): the tensor-parallel group is the topology's ``model``
axis, which AutoTP training sizes (docs/autotp.md)."""
from __future__ import annotations

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.comm.groups import ProcessGroups, current_groups, set_current_groups
from dsrun.moe.groups import _groups


def get_tensor_model_parallel_group() -> ProcessGroup:
    """The rank's tensor-parallel group: the world's group itself when the group spans the world (dsrun's groups
    say None there, but DeepSpeed's layers read None as no tensor parallelism)."""
    groups = _groups()
    if groups.model is None and groups.size("model") > 1:
        return comm.get_world_group()
    return groups.model


def get_model_parallel_group() -> ProcessGroup:
    return get_tensor_model_parallel_group()


def get_data_parallel_group() -> ProcessGroup:
    return _groups().data


def get_tensor_model_parallel_world_size() -> int:
    return _groups().size("model")


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def get_tensor_model_parallel_rank() -> int:
    return _groups().coord("model")


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group."""
    return _groups().members("model")[0]


def get_data_parallel_world_size() -> int:
    return comm.get_world_size(_groups().data)


def get_data_parallel_rank() -> int:
    return comm.get_rank(_groups().data)


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None
                         ) -> tuple[ProcessGroup, ProcessGroup] | None:
    """DeepSpeed's builder of the tensor- and data-parallel groups without an engine (its tests split a model by
    hand after it): the run's groups get a ``model`` axis of ``tensor_model_parallel_size`` consecutive ranks
    (collective: every rank calls it). Nothing when tensor-parallel groups exist already, as in DeepSpeed; returns
    the (data, tensor) groups it built. A size that does not tile the world is a ValueError."""
    existing = current_groups()
    if existing is not None and existing.size("model") > 1:
        return None
    world, tp = comm.get_world_size(), int(tensor_model_parallel_size)
    dp = world // tp if data_parallel_size is None else int(data_parallel_size)
    if tp < 1 or tp * dp != world:
        raise ValueError(f"_init_tp_mesh_device: tensor_model_parallel_size {tp} x data_parallel_size {dp} is not "
                         f"the world size {world}")
    set_current_groups(ProcessGroups(model=tp))
    return get_data_parallel_group(), get_tensor_model_parallel_group()
