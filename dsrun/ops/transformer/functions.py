"""The memory-saving pieces of the transformer layer, as autograd functions that save less.

Each computes exactly what the plain torch expression computes and differs only in what it keeps for
backward (measured in tests/unit/ops/test_transformer_layer.py with saved-tensor hooks):

* :class:`InvertibleLayerNorm` keeps the LayerNorm's *output* (already kept by the next matmul) instead of
  its input, and recovers ``x̂ = (y - β) / γ`` in backward (DeepSpeed's ``normalize_invertible``; needs
  every ``γ`` non-zero).
* :class:`DropoutContext` is ``dropout(probs) @ v`` keeping the probabilities (already kept by softmax)
  and the boolean mask instead of the dropped-out probabilities (``attn_dropout_checkpoint``).
* :class:`GeluLinear` is ``linear(gelu(h))`` keeping ``h`` (already kept by GELU) instead of ``gelu(h)``
  (``gelu_checkpoint``).

:func:`dropout` draws its keep-mask from an optional generator and saves it as booleans.
"""
from __future__ import annotations


import torch
from torch.autograd.function import FunctionCtx
import torch.nn.functional as F


def keep_mask(shape: torch.Size, p: float, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """A boolean mask, True with probability ``1 - p``."""
    return torch.rand(shape, device=device, generator=generator) >= p


def dropout(x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Inverted dropout; autograd keeps only the boolean mask (1 byte per element)."""
    if p <= 0:
        return x
    return x * keep_mask(x.shape, p, x.device, generator) * (1.0 / (1.0 - p))


def _sum_to_last(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


class InvertibleLayerNorm(torch.autograd.Function):
    """``layer_norm(x, γ, β)`` over the last dimension, saving ``y``, ``γ``, ``β`` and ``1/σ`` only."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
        y, _, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(y, weight, bias, rstd)
        return y

    @staticmethod
    def backward(ctx: FunctionCtx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, weight, bias, rstd = ctx.saved_tensors
        x_hat = (y - bias) / weight
        grad_weight = _sum_to_last(grad_y * x_hat) if ctx.needs_input_grad[1] else None
        grad_bias = _sum_to_last(grad_y) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = grad_y * weight
            grad_x = rstd * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True))
        return grad_x, grad_weight, grad_bias, None


class DropoutContext(torch.autograd.Function):
    """``(dropout(probs, p) @ v)`` saving ``probs``, the boolean mask and ``v``; recomputes the dropout."""

    @staticmethod
    def forward(ctx: FunctionCtx, probs: torch.Tensor, v: torch.Tensor, p: float,
                generator: torch.Generator | None) -> torch.Tensor:
        keep = keep_mask(probs.shape, p, probs.device, generator)
        ctx.save_for_backward(probs, keep, v)
        ctx.scale = 1.0 / (1.0 - p)
        return torch.matmul(probs * keep * ctx.scale, v)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        probs, keep, v = ctx.saved_tensors
        grad_probs = torch.matmul(grad_out, v.transpose(-1, -2)) * keep * ctx.scale
        grad_v = torch.matmul((probs * keep * ctx.scale).transpose(-1, -2), grad_out)
        return grad_probs, grad_v, None, None


class GeluLinear(torch.autograd.Function):
    """``linear(gelu(h), weight, bias)`` saving ``h`` and ``weight``; recomputes ``gelu(h)`` in backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        return F.linear(F.gelu(h), weight, bias)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight = ctx.saved_tensors
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_(True)
            activation = F.gelu(h_leaf)
        grad_h = grad_weight = None
        if ctx.needs_input_grad[0]:
            (grad_h,) = torch.autograd.grad(activation, h_leaf, torch.matmul(grad_out, weight))
        if ctx.needs_input_grad[1]:
            grad_weight = torch.matmul(grad_out.reshape(-1, grad_out.shape[-1]).transpose(0, 1),
                                       activation.detach().reshape(-1, activation.shape[-1]))
        grad_bias = _sum_to_last(grad_out) if ctx.needs_input_grad[2] else None
        return grad_h, grad_weight, grad_bias
