"""``DeepSpeedCPUAdam``: Adam/AdamW on CPU tensors through the ``cpu_adam`` SIMD kernel.

``ZenFlowSelectiveAdamW`` / ``ZenFlowSelectiveAdamW_stage3`` (``dsrun/ops/zenflow_adam.py``) are served here, as
DeepSpeed's ``deepspeed.ops.adam`` holds them. Numerically it follows ``torch.optim.AdamW`` (``adamw_mode=True``, decoupled weight decay) or
``torch.optim.Adam`` (``adamw_mode=False``, L2 weight decay added to the gradient). See
:mod:`dsrun.ops.cpu_optimizer` for parameter/state dtypes and ``fp32_optimizer_states``.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from dsrun.ops.cpu_optimizer import CPUOptimizer, _GroupWork
from dsrun.ops.zenflow_adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3  # DeepSpeed's names here


class DeepSpeedCPUAdam(CPUOptimizer):
    """Adam/AdamW for CPU (offloaded) parameters, with DeepSpeed's signature.

    ``bias_correction`` turns Adam's bias correction on or off; ``amsgrad`` is not supported (as in DeepSpeed)
    and raises ValueError when True. State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` and,
    for 16-bit parameters with fp32 states, ``master_param``.
    """

    OP_NAME = "cpu_adam"
    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam does not support amsgrad=True; use torch.optim.Adam(amsgrad=True)")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"DeepSpeedCPUAdam: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay} (need lr, eps, weight_decay >= 0 and 0 <= betas < 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=False)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.adamw_mode = adamw_mode

    def _kernel(self, group: dict[str, Any], work: _GroupWork) -> None:
        beta1, beta2 = group["betas"]
        self.op.adam_step(work.params, work.grads, work.states["exp_avg"], work.states["exp_avg_sq"],
                          work.low_precision if work.has_low_precision else [], work.steps, float(group["lr"]),
                          float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                          bool(group["bias_correction"]), bool(self.adamw_mode))

    def _fallback(self, group: dict[str, Any], work: _GroupWork) -> None:
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = group["betas"]
        for i, param in enumerate(work.params):
            step = work.steps[i]
            bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            p, g = param.float(), work.grads[i].float()
            m, v = work.states["exp_avg"][i].float(), work.states["exp_avg_sq"][i].float()
            if wd != 0:
                if self.adamw_mode:
                    p.mul_(1 - lr * wd)
                else:
                    g = g.add(p, alpha=wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt().div_(math.sqrt(bc2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bc1)
            _write_back((param, p), (work.states["exp_avg"][i], m), (work.states["exp_avg_sq"][i], v))
            if work.low_precision[i].numel():
                work.low_precision[i].copy_(p)


def _write_back(*pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy fp32 working values into their (possibly 16-bit) storage; a no-op when they are the same tensor."""
    for storage, value in pairs:
        if storage.data_ptr() != value.data_ptr():
            storage.copy_(value)


class FusedAdam(DeepSpeedCPUAdam):
    """DeepSpeed's ``FusedAdam`` signature on dsrun's fused path, the ``cpu_adam`` kernel (CPU parameters).

    DeepSpeed's ``FusedAdam`` is its multi-tensor CUDA Adam; here the SIMD + OpenMP kernel updates every
    parameter of a group in one call. ``adam_w_mode`` is ``adamw_mode``; ``set_grad_none`` makes
    ``zero_grad()`` set gradients to None (else zero them). For CUDA parameters use
    ``torch.optim.AdamW(fused=True)``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adam_w_mode)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]
