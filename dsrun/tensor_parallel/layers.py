"""The linear layers of a model split for *training*: column- and row-parallel, with their backward right.

A Transformer block's linears come in pairs (dsrun/inference/auto_tp.py reads them). The first of a pair is
column-parallel: this rank holds a slice of its output features, so it computes its slice of the output from
the whole input. The input is the same on every rank of the tensor-parallel group, but each rank's slice of the
output depends on it, so the input's gradient is the *sum* of the ranks' gradients: forward is the identity,
backward one all-reduce (Megatron's ``f``). The second is row-parallel: this rank holds the matching slice of
the input features, computes a partial sum of the whole output, and one all-reduce adds the partial sums
(Megatron's ``g``); its backward is the identity, since every rank's partial sum receives the whole output's
gradient. The row-parallel bias is added once, after the all-reduce, and is whole on every rank.

The layers keep the model's own ``Parameter`` objects (their ``.data`` replaced by this rank's slice) and their
attribute names, so an optimizer built over ``model.parameters()`` before the split still holds them and the
state-dict keys stay the model's. A Hugging Face ``Conv1D`` (GPT-2) keeps its ``[in, out]`` layout.

As DeepSpeed's AutoTP layers do, each split parameter carries its layer's ``gather_params(params)`` (the whole
tensor put back from the group's slices, in place) and ``_tp_partition(params)`` (this rank's slice cut again from
the whole), which DeepSpeed's tests and its ``GatheredParameters``-style save paths call.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dsrun import comm
from dsrun.checkpoint.tensor_parallel import slice_dim
from dsrun.utils.zero_to_fp32 import merge_slices

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _CopyToGroup(torch.autograd.Function):
    """Forward: the identity. Backward: the gradient all-reduced (summed) over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: the partial sums all-reduced over the group. Backward: the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _OverlappedColumn(torch.autograd.Function):
    """A column-parallel matmul (``tp_overlap_comm``): forward ``x W^T + b``; backward starts the all-reduce of the
    input's gradient, computes the weight's and bias' gradients while it runs, then waits (DeepSpeed's
    ``AsyncColumnParallel``). The sums are those of :func:`copy_to_group` followed by the matmul's own backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, transposed: bool, group: ProcessGroup | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.group, ctx.has_bias = transposed, group, bias is not None
        y = torch.matmul(x, weight) if transposed else F.linear(x, weight)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        grad_x = (torch.matmul(grad, weight.t()) if ctx.transposed else torch.matmul(grad, weight)).contiguous()
        pending = comm.all_reduce(grad_x, group=ctx.group, async_op=True)
        rows, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_weight = flat_x.t().matmul(rows) if ctx.transposed else rows.t().matmul(flat_x)
        grad_bias = rows.sum(0) if ctx.has_bias else None
        pending.wait()
        return grad_x, grad_weight, grad_bias, None, None


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


def gather_slices(local: torch.Tensor, dim: int, group: ProcessGroup | None, size: int) -> list[torch.Tensor]:
    """Every rank's slice of a tensor cut along ``dim`` (slices may differ in length: uneven shards), in rank
    order; collective over ``group``."""
    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    comm.all_gather(lengths, torch.tensor([local.shape[dim]]), group=group)
    moved = local.movedim(dim, 0).contiguous()
    padded = moved.new_zeros(int(max(lengths)), *moved.shape[1:])
    padded[:moved.shape[0]] = moved
    pieces = [torch.empty_like(padded) for _ in range(size)]
    comm.all_gather(pieces, padded, group=group)
    return [piece[:int(length)].movedim(0, dim) for piece, length in zip(pieces, lengths)]


def _parts_of(param: nn.Parameter) -> Any:
    """How a split parameter was cut: its explicit widths (an uneven or unequal-parts cut), else its fused parts."""
    widths = getattr(param, "partition_widths", None)
    return widths if widths is not None else param.partition_stride


class TensorParallelLinear(nn.Module):
    """One linear of a split pair, holding this rank's slice of the weight (and bias) as the model's own
    parameters. ``transposed``: the weight is stored ``[in, out]`` (a Hugging Face ``Conv1D``); ``name``: the
    module's path in the model (DeepSpeed's layers' ``name``, None when built outside a split)."""

    row_parallel = False
    # DeepSpeed's tensor_parallel.tp_overlap_comm, process-wide as DeepSpeed's TensorParallel_Layer keeps it
    # (initialize sets it): the column-parallel backward overlaps its all-reduce with the weight's gradient
    overlap_comm = False
    # the AutoTP compile pass (compile.passes: ["autotp"]) emits this layer's collectives into the graph instead
    defer_collectives_to_compiler = False

    @property
    def mp_group(self) -> ProcessGroup | None:  # DeepSpeed's name for the layer's group
        return self.group

    @mp_group.setter
    def mp_group(self, group: ProcessGroup | None) -> None:
        self.group = group

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, transposed: bool,
                 group: ProcessGroup | None, tp_size: int, tp_rank: int = 0, name: str | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.transposed, self.group, self.tp_size, self.tp_rank = transposed, group, tp_size, tp_rank
        # DeepSpeed's layer name (the module's path), which its shard sizes are asked under; a subclass may set it first
        self.name = name if name is not None else getattr(self, "name", None)
        in_dim = 0 if transposed else 1
        shape = tuple(getattr(weight, "ds_shape", None) or weight.shape)  # ZeRO-3 leaves its data empty
        self.in_features, self.out_features = shape[in_dim], shape[1 - in_dim]
        for param in (weight, bias):
            if param is not None and is_model_parallel_parameter(param):
                # DeepSpeed's AutoTP layers hang these on their parameters
                param.gather_params, param._tp_partition = self.gather_params, self._tp_partition

    def gather_params(self, params_list: list[nn.Parameter]) -> None:
        """Put each split parameter of ``params_list`` back whole (its data: the group's slices merged along the
        dimension it was cut, fused parts kept apart); collective over the tensor-parallel group."""
        for param in params_list:
            if not is_model_parallel_parameter(param) or getattr(param, "_tp_gathered", False):
                continue
            with torch.no_grad():
                pieces = gather_slices(param.data, param.partition_dim, self.group, self.tp_size)
                param.data = merge_slices(pieces, param.partition_dim, _parts_of(param))
            param._tp_gathered = True

    def _tp_partition(self, params_list: list[nn.Parameter]) -> None:
        """Cut each gathered parameter of ``params_list`` back to this rank's slice (the inverse of
        :meth:`gather_params`)."""
        for param in params_list:
            if not getattr(param, "_tp_gathered", False):
                continue
            with torch.no_grad():
                param.data = slice_dim(param.data, param.partition_dim, _parts_of(param), self.tp_rank,
                                       self.tp_size)
            param._tp_gathered = False

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return torch.matmul(x, self.weight)
        # the AutoTP compile pass finds torch's linear in the graph: not a replacement of F.linear (ZeRO-3's
        # memory-efficient linear stays installed for the rest of the process once a stage-3 run put it there)
        return (torch._C._nn.linear if self.defer_collectives_to_compiler else F.linear)(x, self.weight)

    def extra_repr(self) -> str:
        kind = "row" if self.row_parallel else "column"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {kind}-parallel over "
                f"{self.tp_size}" + (", Conv1D layout" if self.transposed else ""))


class ColumnParallelLinear(TensorParallelLinear):
    """This rank's slice of the output features; the input's gradient is summed over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deferred = self.defer_collectives_to_compiler
        if self.tp_size > 1 and TensorParallelLinear.overlap_comm and not deferred:
            return _OverlappedColumn.apply(x, self.weight, self.bias, self.transposed, self.group)
        if self.tp_size > 1 and not deferred:
            x = copy_to_group(x, self.group)
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(TensorParallelLinear):
    """This rank's slice of the input features; the partial outputs are summed over the group, then the
    (whole) bias is added once."""

    row_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        if self.tp_size > 1 and not self.defer_collectives_to_compiler:
            y = reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """DeepSpeed's ``runtime.utils.is_model_parallel_parameter``: a parameter split over the tensor-parallel group
    (Megatron's ``model_parallel`` or ``tensor_model_parallel`` mark, which the AutoTP split sets)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def consolidated_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's parameters on global rank 0 (None elsewhere), CPU copies by name: each module's split
    parameters are gathered over its group (their ``gather_params``), copied, and cut back (DeepSpeed's
    ``engine._consolidated_16bit_state_dict`` under AutoTP). Collective: every rank calls it."""
    keep = comm.get_rank() == 0 if comm.is_initialized() else True
    state: dict[str, torch.Tensor] | None = {} if keep else None
    for module_name, module in model.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
        split = [p for _, p in params if is_model_parallel_parameter(p) and hasattr(p, "gather_params")]
        if split:
            split[0].gather_params(split)
        if state is not None:
            for name, param in params:
                state[f"{module_name}.{name}" if module_name else name] = param.detach().cpu().clone()
        if split:
            split[0]._tp_partition(split)
    return state
