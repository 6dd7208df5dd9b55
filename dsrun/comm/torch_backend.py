"""DeepSpeed's ``TorchBackend`` (``deepspeed.comm.torch``): its thin wrapper over ``torch.distributed``.

Scripts reach for it to ask which all-gather and reduce-scatter torch has
(``deepspeed.comm.TorchBackend.get_all_gather_function()``, a class method) or to hold a backend object. Here
it is a face over :mod:`dsrun.comm.comm`: the functions it hands out and the collectives it wraps are dsrun's
own, so every call is counted by the comms logger like any other. The functions keep torch's keyword names
(``output_tensor=``, ``input_tensor=``), which is how DeepSpeed calls what ``get_all_gather_function``
returns.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from . import comm
from .comm import ProcessGroup, ReduceOp


def _all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup = None,
                            async_op: bool = False) -> Any:
    return comm.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                           group: ProcessGroup = None, async_op: bool = False) -> Any:
    return comm.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


class TorchBackend:
    """``deepspeed.comm.TorchBackend``: initializes the default group on construction (if none exists) and
    wraps dsrun's collectives under DeepSpeed's method names."""

    def __init__(self, backend: str | None, timeout: timedelta, init_method: str | None, rank: int = -1,
                 world_size: int = -1, name: str = "torch"):
        self.name = name
        self.all_gather_function = self.get_all_gather_function()
        self.reduce_scatter_function = self.get_reduce_scatter_function()
        self.initialized = True
        self.single_gpu_mode = True  # DeepSpeed's attribute (its unfinished single-GPU mode)
        self.init_process_group(backend, timeout, init_method, rank, world_size)

    @classmethod
    def get_all_gather_function(cls) -> Optional[Callable[..., Any]]:
        """The all-gather into one tensor, ``fn(output_tensor, input_tensor, group=None, async_op=False)``;
        None where torch has none (then callers gather into a list)."""
        return _all_gather_into_tensor if comm._all_gather_single is not None else None

    @classmethod
    def get_reduce_scatter_function(cls) -> Optional[Callable[..., Any]]:
        """The reduce-scatter of one tensor, ``fn(output, input, op=SUM, group=None, async_op=False)``; None
        where torch has none."""
        return _reduce_scatter_tensor if comm._reduce_scatter_single is not None else None

    def has_all_gather_into_tensor(self) -> bool:
        return self.all_gather_function is not None

    def has_reduce_scatter_tensor(self) -> bool:
        return self.reduce_scatter_function is not None

    def init_process_group(self, backend: str | None, timeout: timedelta, init_method: str | None, rank: int,
                           world_size: int) -> None:
        comm.init_distributed(dist_backend=backend, timeout=timeout, init_method=init_method, rank=rank,
                              world_size=world_size, verbose=False)
        self.using_mpi = comm.get_backend() == "mpi"

    def is_initialized(self) -> bool:
        return comm.is_initialized()

    def get_rank(self, group: ProcessGroup = None) -> int:
        return comm.get_rank(group)

    def get_world_size(self, group: ProcessGroup = None) -> int:
        return comm.get_world_size(group)

    def get_backend(self, group: ProcessGroup = None) -> str:
        return comm.get_backend(group)

    def new_group(self, ranks: Sequence[int] | None) -> ProcessGroup:
        return comm.new_group(ranks)

    def barrier(self, group: ProcessGroup = None) -> None:
        comm.barrier(group)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup = None,
                   async_op: bool = False) -> Any:
        return comm.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup = None,
               async_op: bool = False) -> Any:
        return comm.reduce(tensor, dst, op=op, group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: ProcessGroup = None, async_op: bool = False) -> Any:
        return comm.broadcast(tensor, src, group=group, async_op=async_op)

    def all_gather(self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup = None,
                   async_op: bool = False) -> Any:
        return comm.all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               group: ProcessGroup = None, async_op: bool = False) -> Any:
        return comm.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                       group: ProcessGroup = None, async_op: bool = False) -> Any:
        return comm.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)

    def reduce_scatter_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                              op: ReduceOp = ReduceOp.SUM, group: ProcessGroup = None, async_op: bool = False) -> Any:
        return comm.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, group: ProcessGroup = None,
                          async_op: bool = False) -> Any:
        return comm.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                      input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    def destroy_process_group(self, group: ProcessGroup = None) -> None:
        comm.destroy_process_group(group)
