"""A linear layer whose backward keeps no copy of a ZeRO-3 weight (``memory_efficient_linear``).

``torch.nn.functional.linear`` records ``weight.t()`` for backward: a view that keeps the *gathered* weight
alive from forward to backward, so releasing the parameter after its forward would free nothing and a
ZeRO-3 rank would hold every linear weight in full at the end of forward. :class:`LinearFunctionForZeroStage3`
saves the Parameter itself instead; its ``.data`` is the empty placeholder until the backward pre-hook gathers it
again. :func:`zero3_linear_wrap` (dsrun's ``zero3_linear``) takes it whenever autograd records the call, as
DeepSpeed's does, but for a weight kept whole (below); ``memory_efficient_linear`` (the default) makes it
``F.linear`` for the rest of the process, as DeepSpeed does
(:func:`dsrun.zero.partitioner_internals.enable_memory_efficient_linear`). A weight kept whole (a partition group
of one) is never released, so it takes torch's own ``F.linear``.
:class:`LinearModuleForZeroStage3` is DeepSpeed's ``nn.Linear`` that calls it whatever ``F.linear`` is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from dsrun.zero.partition_params import WHOLE_ATTR, is_zero_param

_original_linear = F.linear


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """DeepSpeed's ZeRO-3 linear: ``F.linear`` whose backward recomputes from the saved Parameter (not a view of
    its gathered data). Written in torch.func's form (``setup_context``, a generated vmap rule), so
    ``torch.func.grad``/``vmap`` take it; backward runs under the autocast state forward ran under (recorded on
    the node as DeepSpeed does: ``_fwd_used_autocast``, ``_dtype``), whatever autocast surrounds backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _original_linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        input, weight, bias = (*inputs, None)[:3]
        ctx._device_type = input.device.type
        ctx._fwd_used_autocast = torch.is_autocast_enabled(ctx._device_type)
        ctx._dtype = torch.get_autocast_dtype(ctx._device_type)
        ctx.save_for_backward(input, weight, bias)  # the leaf Parameter itself, not a view of its data

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        with torch.autocast(ctx._device_type, dtype=ctx._dtype, enabled=ctx._fwd_used_autocast):
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                    input.reshape(-1, input.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSpeed's ``zero3_linear_wrap``: ``F.linear`` through :class:`LinearFunctionForZeroStage3` whenever autograd
    records it, except for a ZeRO-3 parameter kept whole (:mod:`.whole_params`: nothing is released, so torch's own
    backward, stage 0's, is kept); without gradients it is torch's ``F.linear``."""
    needs_grad = weight.requires_grad or input.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and needs_grad and not (is_zero_param(weight) and getattr(weight, WHOLE_ATTR, False)):
        return LinearFunctionForZeroStage3.apply(input, weight, bias)
    return _original_linear(input, weight, bias)


zero3_linear = zero3_linear_wrap  # dsrun's name


class LinearModuleForZeroStage3(torch.nn.Linear):
    """DeepSpeed's ZeRO-3 linear layer: ``torch.nn.Linear`` (the same parameters, initialisation and
    ``in_features``/``out_features``) whose forward is :func:`zero3_linear` whether or not ``F.linear`` is."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear(input, self.weight, self.bias)
