"""``DeepSpeedCPUAdagrad``: Adagrad on CPU tensors through the ``cpu_adagrad`` SIMD kernel.

Numerically it follows ``torch.optim.Adagrad`` with ``lr_decay=0`` and ``initial_accumulator_value=0``
(L2 weight decay added to the gradient). See :mod:`dsrun.ops.cpu_optimizer` for dtypes.
"""
from __future__ import annotations

from typing import Any, Iterable

from dsrun.ops.adam import _write_back
from dsrun.ops.cpu_optimizer import CPUOptimizer, _GroupWork


class DeepSpeedCPUAdagrad(CPUOptimizer):
    """Adagrad for CPU (offloaded) parameters, with DeepSpeed's signature. ``amsgrad`` must stay False.

    State per parameter: ``step`` (int), ``exp_avg_sq`` (the running sum of squared gradients) and, for
    16-bit parameters with fp32 states, ``master_param``.
    """

    OP_NAME = "cpu_adagrad"
    STATE_KEYS = ("exp_avg_sq",)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad does not support amsgrad=True")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"DeepSpeedCPUAdagrad: invalid hyper-parameters lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay} (all must be >= 0)")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=False)
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _kernel(self, group: dict[str, Any], work: _GroupWork) -> None:
        self.op.adagrad_step(work.params, work.grads, work.states["exp_avg_sq"],
                             work.low_precision if work.has_low_precision else [], float(group["lr"]),
                             float(group["eps"]), float(group["weight_decay"]))

    def _fallback(self, group: dict[str, Any], work: _GroupWork) -> None:
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        for i, param in enumerate(work.params):
            p, g, s = param.float(), work.grads[i].float(), work.states["exp_avg_sq"][i].float()
            if wd != 0:
                g = g.add(p, alpha=wd)
            s.addcmul_(g, g, value=1)
            p.addcdiv_(g, s.sqrt().add_(eps), value=-lr)
            _write_back((param, p), (work.states["exp_avg_sq"][i], s))
            if work.low_precision[i].numel():
                work.low_precision[i].copy_(p)
