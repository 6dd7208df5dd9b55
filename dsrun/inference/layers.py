"""The linear layers of a split model: column-parallel, row-parallel, and weight-only INT8.

A Transformer block's linears come in pairs. The first of a pair (q/k/v, the MLP up-projection) is
*column-parallel*: each rank holds a slice of its output features (whole heads, a slice of the MLP width)
and computes that slice without talking to anyone. The second (the attention output projection, the MLP
down-projection) is *row-parallel*: each rank holds the matching slice of its input features, computes a
partial sum of the full output, and one all-reduce over the model-parallel group adds the partial sums. The
bias is added once, after the all-reduce. So a block costs two all-reduces of the hidden state per forward.

Any of them may hold its weight as INT8 with one scale per group of output rows (``quantize_``); the
product then runs on ``torch._weight_int8pack_mm`` where torch has it, else on the dequantized weight.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsrun import comm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

INT8_MAX = 127


class InferenceLinear(nn.Module):
    """``y = x Wᵀ + b`` with a frozen weight ``[out, in]``, optionally stored as INT8 (weight-only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        self.register_buffer("weight_scale", None)

    @property
    def quantized(self) -> bool:
        return self.weight_scale is not None

    @torch.no_grad()
    def quantize_(self, q_groups: int = 1) -> None:
        """Store the weight as symmetric INT8: rows split into ``q_groups`` equal groups, each with the scale
        ``max|w| / 127`` of its group (``q_groups=1``: one scale for the matrix, ``= out_features``: per row)."""
        if self.quantized:
            return
        rows = self.out_features
        if rows % q_groups:
            raise ValueError(f"quant.weight.q_groups={q_groups} does not divide the {rows} output rows of a "
                             "linear layer")
        weight = self.weight.float()
        grouped = weight.view(q_groups, -1)
        scale = grouped.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
        q = torch.round(grouped / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).view(rows, -1)
        compute_dtype = self.weight.dtype  # the activations keep it; only the stored weight shrinks
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale.repeat_interleave(rows // q_groups).to(compute_dtype)

    def dequantized_weight(self) -> torch.Tensor:
        if not self.quantized:
            return self.weight
        return self.weight.to(self.weight_scale.dtype) * self.weight_scale[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` without the bias."""
        if not self.quantized:
            return F.linear(x, self.weight)
        x = x.to(self.weight_scale.dtype)
        kernel = getattr(torch, "_weight_int8pack_mm", None)
        if kernel is not None and x.dim() >= 2:
            try:
                flat = x.reshape(-1, x.shape[-1])
                return kernel(flat, self.weight, self.weight_scale).view(*x.shape[:-1], self.out_features)
            except RuntimeError:  # no kernel for this device/dtype: the dequantized weight below
                pass
        return F.linear(x, self.dequantized_weight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kind = "int8" if self.quantized else str(self.weight.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={kind}"


class ColumnParallelLinear(InferenceLinear):
    """This rank's slice of a linear's output features; no communication."""


class RowParallelLinear(InferenceLinear):
    """This rank's slice of a linear's input features; the partial outputs are all-reduced over ``group``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: ProcessGroup | None, world: int):
        super().__init__(weight, bias)
        self.group, self.world = group, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.world > 1:
            comm.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", all_reduce_over={self.world}"


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear``, or a Hugging Face ``Conv1D`` (GPT-2's linear with a transposed ``[in, out]`` weight)."""
    return isinstance(module, (nn.Linear, InferenceLinear)) or is_conv1d(module)


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def linear_parts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias)`` of any linear :func:`is_linear` accepts."""
    if is_conv1d(module):
        return module.weight.t(), module.bias
    return module.weight, module.bias


def out_in(module: nn.Module) -> tuple[int, int]:
    weight, _ = linear_parts(module)
    return weight.shape[0], weight.shape[1]
