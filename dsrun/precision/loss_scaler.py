"""Loss scalers (``deepspeed.runtime.fp16.loss_scaler``): DeepSpeed's ``LossScaler`` (a fixed scale) and
``DynamicLossScaler``, with DeepSpeed's constructors, attributes and scale schedule. dsrun's fp16 precision
strategy (:mod:`dsrun.precision.strategy`) steps one of them, and checkpoint files name these classes, so a plain
``torch.load(path, weights_only=False)`` of a dsrun or DeepSpeed optimizer-states file under the ``deepspeed``
alias builds these objects (dsrun's own loader reads them without unpickling code:
:mod:`dsrun.checkpoint.deepspeed_format`).

The dynamic schedule: an overflowing step is skipped; it first uses up one unit of hysteresis
(``delayed_shift``), and once none is left the scale is divided by ``scale_factor``, never below
``min_scale`` (at ``min_scale``, ``raise_error_at_min_scale`` makes a further overflow an error, as in
DeepSpeed). After ``scale_window`` steps without overflow the scale is multiplied by ``scale_factor`` and the
hysteresis refilled; ``consecutive_hysteresis`` refills it on every clean step instead.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

# DeepSpeed's names for the dynamic scaler's keyword arguments
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class LossScalerBase:
    """What every scaler has: ``cur_scale`` (also ``loss_scale``), ``dynamic``, ``update_scale(overflow)``."""

    dynamic = False

    def __init__(self, cur_scale: float):
        self.cur_scale = cur_scale
        self.dynamic = type(self).dynamic

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: torch.nn.Module, grad_in: tuple, grad_out: tuple) -> tuple:
        """A backward hook that multiplies the incoming gradients by the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        return None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key, value in sd.items():
            setattr(self, key, value)


class LossScaler(LossScalerBase):
    """A fixed loss scale (``fp16.loss_scale > 0``); overflowing steps are still skipped."""

    def __init__(self, scale: float = 1):
        super().__init__(float(scale))

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scale (the schedule is in the module docstring)."""

    dynamic = True

    def __init__(self, init_scale: float = 2 ** 32, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1, delayed_shift: int = 1, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True, dtype: torch.dtype = torch.half):
        super().__init__(float(init_scale))
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dtype = dtype

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return not bool(torch.isfinite(x.float()).all())

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return any(p.grad is not None and self._has_inf_or_nan(p.grad.data) for p in params)

    has_overflow = has_overflow_serial

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(f"fp16 loss scale is already at its minimum ({self.min_scale:g}) and the "
                                       f"gradients still overflow: the run cannot go on (lower the learning rate, "
                                       f"or use bf16)")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}
