"""LAMB (layer-wise adaptive moments), with the options of DeepSpeed's ``FusedLamb``.

The Adam-style update of each parameter tensor is rescaled by the trust ratio ``||w|| / ||update||``,
clipped to ``[min_coeff, max_coeff]``. Without ZeRO partitioning (stage 0) the engine steps one flat buffer per
param group; it marks the model tensors inside it (``ds_tensor_segments``: (offset, numel) pairs) and each
gets its own trust ratio, as DeepSpeed's per-parameter ``FusedLamb`` (in every precision: DeepSpeed keeps LAMB
out of its flattening fp16 wrapper). Under ZeRO stages 1-3 the "parameter tensor" is a rank's flat partition
(stage 3: a sub-group), as in DeepSpeed, so the trust ratio there is per partition rather than per layer.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from .base import PerParameterOptimizer


class Lamb(PerParameterOptimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        if amsgrad:
            raise ValueError("Lamb: amsgrad is not supported (as in DeepSpeed's FusedLamb)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        grad = grad.float()
        if not state:
            state["step"] = 0
            # fp32 states, except beside bf16 masters (bf16.bf16_optimizer_states), where they follow the masters as
            # torch's optimizers' states do (fp16 would underflow the second moment)
            dtype = torch.bfloat16 if p.dtype == torch.bfloat16 else torch.float32
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["step"] = int(state["step"]) + 1  # a DeepSpeed/torch checkpoint stores it as a tensor
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["bias_correction"]:
            m_hat, v_hat = exp_avg / (1 - beta1 ** step), exp_avg_sq / (1 - beta2 ** step)
        else:
            m_hat, v_hat = exp_avg, exp_avg_sq
        if group["eps_inside_sqrt"]:
            update = m_hat / (v_hat + group["eps"]).sqrt()
        else:
            update = m_hat / (v_hat.sqrt() + group["eps"])
        if group["weight_decay"] != 0:
            update.add_(p.float(), alpha=group["weight_decay"])
        segments = getattr(p, "ds_tensor_segments", None) or [(0, p.numel())]
        flat_p, flat_u = p.view(-1), update.view(-1)
        for offset, numel in segments:
            piece = flat_p[offset:offset + numel]
            step_piece = flat_u[offset:offset + numel]
            w_norm, u_norm = piece.float().norm(), step_piece.norm()
            trust = ((w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]).item()
                     if w_norm > 0 and u_norm > 0 else 1.0)
            piece.add_(step_piece.to(p.dtype), alpha=-group["lr"] * trust)
