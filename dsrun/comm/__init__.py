"""``dsrun.comm``: process groups and collectives, the only module that calls torch.distributed.

Mirrors ``deepspeed.comm``: ``init_distributed``, ``get_rank``, ``get_world_size``, ``all_reduce``,
``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``broadcast``, ``barrier``, ``log_summary`` …, and the
run's topology and process groups (:mod:`.topology`, :mod:`.groups`), and the point-to-point ``send``,
``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv`` the pipeline engine uses. Every call is counted
(calls, message bytes, traffic bytes) by the comms logger; read the totals with :func:`get_comms_stats`.
DeepSpeed's capability-checked forms (``allgather_fn``, ``reduce_scatter_fn``, ``has_all_gather_into_tensor``,
``has_reduce_scatter_tensor``) and its ``TorchBackend`` (:mod:`.torch_backend`, ``deepspeed.comm.torch``) too.
"""
from .comm import (CollectiveTimeout, P2POp, ReduceOp, all_gather, all_gather_into_tensor, allgather_fn, all_gather_object, all_reduce,
                   all_to_all_single, barrier, batch_isend_irecv, before_destroy, broadcast, broadcast_object_list,
                   comms_logger, comms_report, configure, default_pg_timeout, destroy_at_exit, destroy_process_group, get_backend, get_comms_group_stats,
                   get_comms_stats, get_global_rank, get_local_rank, get_rank, get_world_group, get_world_size,
                   group_ranks,
                   has_all_gather_into_tensor, has_reduce_scatter_tensor, init_distributed, irecv, is_initialized,
                   isend, log_summary, new_group, recv, reduce, reduce_scatter,
                   reduce_scatter_fn, reduce_scatter_tensor, recv_op, reset_comms_stats, send, send_op)
from .groups import ProcessGroups
from .hierarchical import all_gather_hierarchical
from .logger import CommsLogger, OpStats
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from .torch_backend import TorchBackend

__all__ = [
    "CollectiveTimeout", "P2POp", "ReduceOp", "all_gather", "all_gather_hierarchical", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "all_to_all_single", "allgather_fn", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
    "reduce_scatter_fn", "TorchBackend",
    "barrier", "before_destroy", "broadcast", "batch_isend_irecv", "broadcast_object_list", "comms_logger", "comms_report", "configure",
    "default_pg_timeout",
    "destroy_at_exit", "destroy_process_group", "get_backend", "get_comms_group_stats", "group_ranks",
    "get_comms_stats", "get_global_rank", "get_local_rank", "get_rank", "get_world_group", "get_world_size",
    "init_distributed",
    "irecv", "is_initialized", "isend", "recv", "send",
    "log_summary", "new_group", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reset_comms_stats",
    "recv_op", "send_op",
    "CommsLogger", "OpStats", "ProcessGroups", "ProcessTopology", "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
]
