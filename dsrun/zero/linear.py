"""A linear layer whose backward keeps no copy of a ZeRO-3 weight (``memory_efficient_linear``).

``torch.nn.functional.linear`` records ``weight.t()`` for backward: a view that keeps the *gathered* weight
alive from forward to backward, so releasing the parameter after its forward would free nothing and a
ZeRO-3 rank would hold every linear weight in full at the end of forward. :class:`ZeroLinearFunction` saves
the Parameter itself instead; its ``.data`` is the empty placeholder until the backward pre-hook gathers it
again. :func:`install` routes ``F.linear`` through it for partitioned weights only (other calls are
untouched), once per process, as DeepSpeed does when ``memory_efficient_linear`` is on (the default). A weight
kept whole (a partition group of one) is never released, so it takes torch's own ``F.linear``.
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


def install() -> None:
    """Route ``torch.nn.functional.linear`` through :func:`zero3_linear` (idempotent)."""
    F.linear = zero3_linear
