"""``deepspeed.utils.groups``: the named expert-parallel and expert-data-parallel groups (their home is
:mod:`dsrun.moe.groups`; this module keeps DeepSpeed's import path)."""
from dsrun.moe.groups import (  # noqa: F401
    expert_group_name,
    _groups,
    _create_expert_and_data_parallel,
    _get_expert_parallel_ranks,
    initialize,
    _size_of,
    _get_expert_parallel_group,
    _get_expert_data_parallel_group,
    _get_expert_parallel_group_dict,
    _get_expert_data_parallel_group_dict,
    _get_expert_parallel_world_size,
    _get_expert_parallel_rank,
    _get_expert_data_parallel_world_size,
    _get_expert_data_parallel_rank,
    _get_expert_broadcast_src_rank,
    _get_expert_parallel_src_rank,
    _get_max_expert_size,
    _get_max_expert_size_name,
    _get_data_parallel_group,
    _get_data_parallel_world_size,
    _get_data_parallel_rank,
    _get_model_parallel_world_size,
    _get_model_parallel_rank,
    _reset,
)
from dsrun.sequence.groups import (  # noqa: F401,E402  (Ulysses: the sequence-parallel groups)
    _get_sequence_parallel_world_size,
    _get_sequence_parallel_rank,
    _get_sequence_parallel_group,
    _get_sequence_data_parallel_group,
    _get_sequence_data_parallel_world_size,
    _get_sequence_data_parallel_rank,
)
from dsrun.tensor_parallel.groups import (  # noqa: F401,E402  (AutoTP: the tensor-parallel groups)
    _init_tp_mesh_device,
    get_tensor_model_parallel_group,
    get_model_parallel_group,
    get_data_parallel_group,
    get_tensor_model_parallel_world_size,
    get_model_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_data_parallel_world_size,
    get_data_parallel_rank,
)

__all__ = ["expert_group_name", "initialize", "get_tensor_model_parallel_group", "get_model_parallel_group",
           "get_data_parallel_group", "get_tensor_model_parallel_world_size", "get_model_parallel_world_size",
           "get_tensor_model_parallel_rank", "get_model_parallel_rank", "get_tensor_model_parallel_src_rank",
           "get_data_parallel_world_size", "get_data_parallel_rank"]
