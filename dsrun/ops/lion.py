"""``DeepSpeedCPULion``: Lion (Chen et al., 2023) on CPU tensors through the ``cpu_lion`` SIMD kernel.

Per step: ``p *= 1 - lr * wd``; ``c = beta1 * m + (1 - beta1) * g``; ``p -= lr * sign(c)``;
``m = beta2 * m + (1 - beta2) * g``. See :mod:`dsrun.ops.cpu_optimizer` for dtypes.
"""
from __future__ import annotations

from typing import Any, Iterable

from dsrun.ops.adam import _write_back
from dsrun.ops.cpu_optimizer import CPUOptimizer, _GroupWork


class DeepSpeedCPULion(CPUOptimizer):
    """Lion for CPU (offloaded) parameters, with DeepSpeed's signature.

    State per parameter: ``step`` (int), ``exp_avg`` and, for 16-bit parameters with fp32 states,
    ``master_param``.
    """

    OP_NAME = "cpu_lion"
    STATE_KEYS = ("exp_avg",)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True):
        if lr < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"DeepSpeedCPULion: invalid hyper-parameters lr={lr}, betas={betas}, "
                             f"weight_decay={weight_decay} (need lr, weight_decay >= 0 and 0 <= betas < 1)")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _kernel(self, group: dict[str, Any], work: _GroupWork) -> None:
        beta1, beta2 = group["betas"]
        self.op.lion_step(work.params, work.grads, work.states["exp_avg"],
                          work.low_precision if work.has_low_precision else [], float(group["lr"]), float(beta1),
                          float(beta2), float(group["weight_decay"]))

    def _fallback(self, group: dict[str, Any], work: _GroupWork) -> None:
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        beta1, beta2 = group["betas"]
        for i, param in enumerate(work.params):
            p, g, m = param.float(), work.grads[i].float(), work.states["exp_avg"][i].float()
            if wd != 0:
                p.mul_(1 - lr * wd)
            c = m.mul(beta1).add_(g.mul(1 - beta1))
            p.sub_(c.sign_().mul_(lr))
            m.mul_(beta2).add_(g.mul(1 - beta2))
            _write_back((param, p), (work.states["exp_avg"][i], m))
            if work.low_precision[i].numel():
                work.low_precision[i].copy_(p)


class FusedLion(DeepSpeedCPULion):
    """DeepSpeed's ``FusedLion`` signature on dsrun's fused path, the ``cpu_lion`` kernel (CPU parameters).

    DeepSpeed's ``FusedLion`` is its multi-tensor CUDA Lion; here the SIMD + OpenMP kernel updates every parameter
    of a group in one call, with the same update. ``set_grad_none`` makes ``zero_grad()`` set gradients to None
    (else zero them)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
