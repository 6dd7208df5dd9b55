"""1-bit Adam (https://arxiv.org/abs/2102.02888): Adam for ``freeze_step`` steps with gradients all-reduced,
then the variance frozen and only the momentum communicated, compressed to 1 bit with error feedback.

Step t (``t`` counts this optimizer's steps, from 1):

* **warm-up**, ``t <= freeze_step``: plain Adam on the all-reduced gradient ``g``:
  ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``.
* **compression**, ``t > freeze_step``: backward reduces nothing; each rank forms
  ``b1 m + (1 - b1) g_local`` from its own gradient and the compressed all-reduce
  (:mod:`dsrun.comm.compressed`) returns their mean, the same on every rank, as the new ``m``
  (``exp_avg_mask`` zeroes its masked elements); ``v`` stays as it was after step ``freeze_step``.

Both phases then update ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)`` (decoupled weight
decay, as DeepSpeed applies it), where with ``bias_correction`` (default) ``m_hat = m / (1 - b1^t)`` and
``v_hat = v / (1 - b2^k)``, k the number of variance updates (``min(t, freeze_step)``); without it the hats
are dropped. ``eps_inside_sqrt`` puts eps under the root.

Differences from DeepSpeed's ``OnebitAdam`` (docs/onebit.md): DeepSpeed spends its first ``step()`` on
allocating buffers (no update) and never applies ``bias_correction`` or ``eps_inside_sqrt`` although it takes
them; dsrun updates from the first step, honours both, and warms up exactly ``freeze_step`` steps.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from dsrun.optim.onebit.base import OneBitOptimizer, adam_denominator, bias_corrections, check_common, check_step_count


class OnebitAdam(OneBitOptimizer):
    """DeepSpeed's ``deepspeed.runtime.fp16.onebit.adam.OnebitAdam`` (module docstring)."""

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl"):
        beta1, beta2 = check_common(lr, betas, eps, weight_decay, max_grad_norm, amsgrad, "OneBitAdam")
        self.freeze_step = check_step_count(freeze_step, "freeze_step")
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=(beta1, beta2), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed, cuda_aware, comm_backend_name)
        self._momentum: list[Any] = []  # stage 1: the last exchange's result (every rank's new momentum)

    def reduce_next_step(self) -> bool:
        return self.steps_taken() < self.freeze_step

    def phase_note(self) -> str:
        return (f"warm-up done after {self.freeze_step} steps: the variance is frozen and only the momentum is "
                "communicated, compressed to 1 bit")

    def after_load(self) -> None:
        self._momentum = []

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.begin_step(closure)
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.moment_state(p)
                state["step"] += 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if t <= self.freeze_step:
                    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                else:
                    self._compressed_momentum(gi, p, exp_avg, beta1)
                bias1, bias2 = bias_corrections(group["bias_correction"], beta1, beta2, t, min(t, self.freeze_step))
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = adam_denominator(exp_avg_sq, bias2, group["eps"], self.eps_inside_sqrt)
                p.addcdiv_(exp_avg, denom, value=-group["lr"] / bias1)
        return loss

    def _compressed_momentum(self, gi: int, p: torch.Tensor, exp_avg: torch.Tensor, beta1: float) -> None:
        """``exp_avg`` = the compressed mean over ranks of ``b1 exp_avg + (1 - b1) g_local``, masked."""
        if self.world_size == 1:  # nothing to exchange (DeepSpeed skips the compression too)
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            self.mask(gi, exp_avg)
            return
        if self.stage == 0:
            worker_input = exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        else:  # the worker side needs the whole previous momentum, kept as the last exchange's 1-bit result
            while len(self._momentum) <= gi:
                self._momentum.append(None)
            previous = self._momentum[gi]
            full = self.gather_full(gi, exp_avg) if previous is None else self.mask_full(gi, previous.decode())
            worker_input = full.mul_(beta1).add_(self.full_local_gradient(gi, p)[:full.numel()], alpha=1 - beta1)
        result = self.exchange(gi, worker_input)
        exp_avg.copy_(self.own_part(gi, result))
        self.mask(gi, exp_avg)
        if self.stage == 1:
            self._momentum[gi] = result
