"""Lion (evolved sign momentum), as DeepSpeed's ``Lion``/``FusedLion`` computes it:
``update = sign(beta1 * m + (1 - beta1) * g)``, decoupled weight decay, then ``m = beta2 * m + (1 - beta2) * g``.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from .base import PerParameterOptimizer


class Lion(PerParameterOptimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
        exp_avg = state["exp_avg"]
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_(), alpha=-group["lr"])
        exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
