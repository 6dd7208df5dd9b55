"""Adam in plain torch, with DeepSpeed's options (``bias_correction``, ``adam_w_mode``).

Used when torch's own ``Adam``/``AdamW`` cannot express the request (``bias_correction=False``) and the
compiled CPU op is not available. The update follows torch's order of operations so results agree with
``torch.optim.AdamW`` to rounding.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from .base import PerParameterOptimizer


class Adam(PerParameterOptimizer):
    """Adam/AdamW. ``adam_w_mode=True`` decays weights directly (decoupled, AdamW); ``False`` adds
    ``weight_decay * p`` to the gradient (L2, classic Adam)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        if amsgrad:
            raise ValueError("dsrun Adam: amsgrad is not supported (as in DeepSpeed's FusedAdam); "
                             "use torch.optim.Adam via \"torch_adam\": true")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode)
        super().__init__(params, defaults)

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] = int(state["step"]) + 1  # a DeepSpeed/torch checkpoint stores it as a tensor
        step = state["step"]
        if wd != 0:
            if group["adam_w_mode"]:
                p.mul_(1 - lr * wd)
            else:
                grad = grad.add(p, alpha=wd)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"] else (1.0, 1.0)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bc1)
