"""A linear layer whose backward keeps no copy of a ZeRO-3 weight (``memory_efficient_linear``).

``torch.nn.functional.linear`` records ``weight.t()`` for backward: a view that keeps the *gathered* weight
alive from forward to backward, so releasing the parameter after its forward would free nothing and a
ZeRO-3 rank would hold every linear weight in full at the end of forward. :class:`ZeroLinearFunction` saves
the Parameter itself instead; its ``.data`` is the empty placeholder until the backward pre-hook gathers it
again. :func:`zero3_linear` (DeepSpeed's ``zero3_linear_wrap``) takes it for partitioned weights only (other
calls are untouched); ``memory_efficient_linear`` (the default) makes it ``F.linear`` for the rest of the process,
as DeepSpeed does (:func:`dsrun.zero.partitioner_internals.enable_memory_efficient_linear`). A weight kept whole
(a partition group of one) is never released, so it takes torch's own ``F.linear``.
:class:`LinearModuleForZeroStage3` is DeepSpeed's ``nn.Linear`` that calls it whatever ``F.linear`` is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from dsrun.zero.partition_params import WHOLE_ATTR, is_zero_param

_original_linear = F.linear


class ZeroLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)  # the leaf Parameter itself, not a view of its data
        return _original_linear(input, weight, bias)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                input.reshape(-1, input.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through :class:`ZeroLinearFunction` when ``weight`` is a partitioned parameter (not one
    kept whole, :mod:`.whole_params`: nothing is released, so torch's own backward is stage 0's)."""
    if torch.is_grad_enabled() and is_zero_param(weight) and not getattr(weight, WHOLE_ATTR, False) and (
            weight.requires_grad or input.requires_grad):
        return ZeroLinearFunction.apply(input, weight, bias)
    return _original_linear(input, weight, bias)


zero3_linear_wrap = zero3_linear  # DeepSpeed's name


class LinearModuleForZeroStage3(torch.nn.Linear):
    """DeepSpeed's ZeRO-3 linear layer: ``torch.nn.Linear`` (the same parameters, initialisation and
    ``in_features``/``out_features``) whose forward is :func:`zero3_linear` whether or not ``F.linear`` is."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear(input, self.weight, self.bias)
