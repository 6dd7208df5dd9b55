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


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


class TensorParallelLinear(nn.Module):
    """One linear of a split pair, holding this rank's slice of the weight (and bias) as the model's own
    parameters. ``transposed``: the weight is stored ``[in, out]`` (a Hugging Face ``Conv1D``)."""

    row_parallel = False

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, transposed: bool,
                 group: ProcessGroup | None, tp_size: int, tp_rank: int = 0):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.transposed, self.group, self.tp_size, self.tp_rank = transposed, group, tp_size, tp_rank
        in_dim = 0 if transposed else 1
        self.in_features, self.out_features = weight.shape[in_dim], weight.shape[1 - in_dim]
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
                pieces = [torch.empty_like(param.data) for _ in range(self.tp_size)]
                comm.all_gather(pieces, param.data.contiguous(), group=self.group)
                param.data = merge_slices(pieces, param.partition_dim, param.partition_stride)
            param._tp_gathered = True

    def _tp_partition(self, params_list: list[nn.Parameter]) -> None:
        """Cut each gathered parameter of ``params_list`` back to this rank's slice (the inverse of
        :meth:`gather_params`)."""
        for param in params_list:
            if not getattr(param, "_tp_gathered", False):
                continue
            with torch.no_grad():
                param.data = slice_dim(param.data, param.partition_dim, param.partition_stride, self.tp_rank,
                                       self.tp_size)
            param._tp_gathered = False

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) if self.transposed else F.linear(x, self.weight)

    def extra_repr(self) -> str:
        kind = "row" if self.row_parallel else "column"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {kind}-parallel over "
                f"{self.tp_size}" + (", Conv1D layout" if self.transposed else ""))


class ColumnParallelLinear(TensorParallelLinear):
    """This rank's slice of the output features; the input's gradient is summed over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            x = copy_to_group(x, self.group)
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(TensorParallelLinear):
    """This rank's slice of the input features; the partial outputs are summed over the group, then the
    (whole) bias is added once."""

    row_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        if self.tp_size > 1:
            y = reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """DeepSpeed's ``runtime.utils.is_model_parallel_parameter``: a parameter split over the tensor-parallel group
    (Megatron's ``model_parallel`` or ``tensor_model_parallel`` mark, which the AutoTP split sets)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))
