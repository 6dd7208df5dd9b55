"""AutoTP's collectives as graph ops (DeepSpeed's ``deepspeed.compile.custom_ops.tp_collectives``): what the AutoTP
compile pass (:mod:`.compile_pass`) puts into the graph in place of the layers' own autograd functions
(:mod:`.layers`), so that a whole model traces as one graph (``fullgraph``).

* ``autotp::copy_to_tp_region(x)``: the identity; its gradient summed over the tensor-parallel group (Megatron's
  ``f``, before a column-parallel matmul: each rank's partial input gradient);
* ``autotp::reduce_from_tp_region(x)``: ``x`` summed over the group; its gradient the identity (``g``, after a
  row-parallel matmul's partial sums);
* ``autotp::gather_from_tp_region(x, partition_sizes)``: the last dimension's slices of every rank, concatenated
  (uneven widths padded to the widest for the all-gather); its gradient this rank's slice (a column-parallel
  layer's ``gather_output``).

The group is the run's tensor-parallel group (:func:`get_tp_group`).
"""
from __future__ import annotations

import torch

from dsrun import comm
from dsrun.tensor_parallel.groups import get_tensor_model_parallel_group


def get_tp_group() -> object:
    """The tensor-parallel group the AutoTP setup made (the topology's ``model`` axis)."""
    return get_tensor_model_parallel_group()


@torch.library.custom_op("autotp::copy_to_tp_region", mutates_args=())
def copy_to_tp_region(input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (DeepSpeed's op schema)
    return input.clone()  # a custom op's output may not alias its input


@copy_to_tp_region.register_fake
def _copy_to_tp_region_fake(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return torch.empty_like(input)


@torch.library.custom_op("autotp::reduce_from_tp_region", mutates_args=())
def reduce_from_tp_region(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    output = input.contiguous().clone()
    comm.all_reduce(output, group=get_tp_group())
    return output


@reduce_from_tp_region.register_fake
def _reduce_from_tp_region_fake(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return torch.empty_like(input)


@torch.library.custom_op("autotp::gather_from_tp_region", mutates_args=())
def gather_from_tp_region(input: torch.Tensor, partition_sizes: list[int]) -> torch.Tensor:  # noqa: A002
    group = get_tp_group()
    world = comm.get_world_size(group=group)
    if world == 1:
        return input.clone()
    if len(partition_sizes) != world:
        raise ValueError(f"partition_sizes={partition_sizes} does not match the tensor-parallel size {world}")
    rank = comm.get_rank(group=group)
    if input.shape[-1] != partition_sizes[rank]:
        raise ValueError(f"rank {rank} produced width {input.shape[-1]}, but partition_sizes says "
                         f"{partition_sizes[rank]}")
    widest = max(partition_sizes)
    local = input.contiguous()
    if local.shape[-1] != widest:
        padded = input.new_zeros((*input.shape[:-1], widest))
        padded[..., :input.shape[-1]] = input
        local = padded
    gathered = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    comm.all_gather_into_tensor(gathered, local, group=group)
    slices = gathered.view(world, *local.shape)
    return torch.cat([slices[r].narrow(-1, 0, size) for r, size in enumerate(partition_sizes)], dim=-1)


@gather_from_tp_region.register_fake
def _gather_from_tp_region_fake(input: torch.Tensor, partition_sizes: list[int]) -> torch.Tensor:  # noqa: A002
    return input.new_empty((*input.shape[:-1], sum(partition_sizes)))


def _no_saved_state(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    pass


def _copy_backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return reduce_from_tp_region(grad.contiguous())  # f's backward is g


def _reduce_backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return grad


def _gather_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.partition_sizes = tuple(inputs[1])


def _gather_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
    group = get_tp_group()
    if comm.get_world_size(group=group) == 1:
        return grad, None
    sizes = ctx.partition_sizes
    rank = comm.get_rank(group=group)
    return grad.narrow(-1, sum(sizes[:rank]), sizes[rank]).contiguous(), None


copy_to_tp_region.register_autograd(_copy_backward, setup_context=_no_saved_state)
reduce_from_tp_region.register_autograd(_reduce_backward, setup_context=_no_saved_state)
gather_from_tp_region.register_autograd(_gather_backward, setup_context=_gather_setup)

COLUMN_PARALLEL_OP = torch.ops.autotp.copy_to_tp_region.default
ROW_PARALLEL_OP = torch.ops.autotp.reduce_from_tp_region.default
GATHER_OUTPUT_OP = torch.ops.autotp.gather_from_tp_region.default
