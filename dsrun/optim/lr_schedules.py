"""DeepSpeed's learning-rate schedules, with its class names, constructor signatures and per-step values.

``last_batch_iteration`` (k) counts optimizer steps: after the (k+1)-th ``step()`` the optimizer's lr is the
schedule's value at k. A schedule built with ``last_batch_iteration=-1`` (a fresh start) sets the optimizer's
lr to its value before the first step, ``get_lr()`` (WarmupLR: ``warmup_min_lr``, so a warm-up from 0 moves
nothing on the first step, as in DeepSpeed). The engine steps a schedule once per optimizer step (at a
gradient-accumulation boundary) and not on a step skipped for fp16 overflow. A tensor lr stays the same tensor
(filled in place). Arguments DeepSpeed rejects raise ``ValueError``: a ``warmup_num_steps`` or
``lr_range_test_step_size`` that is not a positive integer, a non-positive ``cycle_first_step_size``, a negative
``cycle_second_step_size``, and a per-group list whose length is not the number of param groups.
``state_dict()`` is ``{"last_batch_iteration": k}``.

The edge cases follow today's DeepSpeed (0.19, its tests/unit/runtime/test_lr_schedulers.py), not 0.14:
``WarmupLR`` without ``warmup_max_lr`` warms each param group up to its own optimizer lr (0.14: to 0.001;
``WarmupDecayLR`` keeps 0.001, its own signature's default, as DeepSpeed does); ``WarmupCosineLR`` stays at
``cos_min_ratio`` from ``total_num_steps`` on (also when ``total_num_steps <= warmup_num_steps``) and falls back
to the log warm-up for an unknown ``warmup_type``; ``OneCycle``'s stair counts hold the lr and momentum flat.
Values per step are listed in docs/engine.md and pinned by tests/unit/runtime/test_lr_schedules.py.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import torch

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
# the ``scheduler.params`` keys, under DeepSpeed's constant names
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
TOTAL_NUM_STEPS = "total_num_steps"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"


def _per_group(optimizer: torch.optim.Optimizer, value: float | Sequence[float], name: str) -> list[float]:
    """One value per param group: a scalar is repeated, a list must match the group count."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"expected {groups} values for {name}, got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * groups


def _positive_steps(value: object, name: str) -> int:
    """``value`` (as the user gave it, any type) when it is a positive int; else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_type(name: str) -> str:
    """``log`` or ``linear``; anything else warns and is ``log``, as DeepSpeed does."""
    if name in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        return name
    warnings.warn(f"warmup_type {name!r} is not 'log' or 'linear'; using 'log'")
    return WARMUP_LOG_RATE


def set_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> list[Any]:
    """Write one lr per param group; a tensor lr is filled in place, so it stays the caller's tensor."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


def _base_lr(group: dict[str, Any]) -> float:
    return float(group["lr"])


class _Schedule:
    """Shared stepping and state for the five schedules."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        assert getattr(self, "_last_lr", None) is not None, "need to call step() first"
        return self._last_lr

    def _start(self, last_batch_iteration: int) -> None:
        """A fresh schedule (-1) puts its value before the first step into the optimizer."""
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = set_lrs(self.optimizer, self._values()) if last_batch_iteration == -1 else None

    def _values(self) -> list[float]:
        """The schedule's lrs at ``last_batch_iteration`` (no warning before the start)."""
        return self.get_lr()

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = set_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class LRRangeTest(_Schedule):
    """LR range test: ``lr = min_lr * (1 + step_rate * interval)``, ``interval = (k + 1) / step_size``
    (floored when ``staircase``). Sets the optimizer to ``min_lr`` on construction."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_steps(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start(last_batch_iteration)

    def _interval(self) -> float:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list[float]:
        factor = 1 + self.step_rate * self._interval()
        return [lr * factor for lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: lr rises linearly from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size`` steps,
    falls back over ``cycle_second_step_size`` (default: the same), then decays as
    ``min_lr / (1 + decay_lr_rate * (k - total + 1) / decay_step_size)`` (no decay when the rate or the step size
    is 0). With ``cycle_momentum`` the first Adam beta cycles the other way between ``cycle_max_mom`` and
    ``cycle_min_mom`` (the second beta is held at 0.99, as DeepSpeed does). A stair count s > 0 holds lr and
    momentum flat in s stairs over its half of the cycle: the scale is ``floor(i * s / half) / s``, i the steps
    from the nearer end of the cycle (DeepSpeed 0.19; 0.14 accepted the counts and ignored them)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        if not cycle_first_step_size > 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if cycle_second_step_size is not None and cycle_second_step_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size!r}")
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_lr_rate == 0.0 or decay_step_size == 0
        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(f"cycle_momentum is disabled: {type(optimizer).__name__} has no 'betas'")
            self.cycle_momentum = False
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = decay_mom_rate == 0.0 or decay_step_size == 0
        self._start(last_batch_iteration)
        if last_batch_iteration == -1 and self.cycle_momentum:
            for group, mom in zip(optimizer.param_groups, self.min_moms):
                group["betas"] = mom

    def _scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        rising = x <= self.step_ratio
        stairs = self.first_stair_count if rising else self.second_stair_count
        if not stairs:
            return x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        # from the integer position in the cycle, not from x: a float just under a stair would floor a whole
        # stair lower (off the peak of an asymmetric cycle)
        position = batch_iteration % self.total_size
        if position <= self.first_step_size:
            return math.floor(position * stairs / self.first_step_size) / stairs
        return math.floor((self.total_size - position) * stairs / self.second_step_size) / stairs

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            factor = self._scale_factor()
            return [lo + (hi - lo) * factor for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay = 1 + self.decay_lr_rate * self._decay_interval()
        return [lr / decay for lr in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]]:
        if not self.cycle_momentum:
            return [group.get("betas") for group in self.optimizer.param_groups]
        if self.last_batch_iteration < self.total_size:
            factor = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * factor, hi[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decay = 1 + self.decay_mom_rate * self._decay_interval()
        return [(beta0 * decay, beta1) for beta0, beta1 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = mom


class WarmupLR(_Schedule):
    """Warm-up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (n, at least 2), then
    constant. ``log``: ``gamma = ln(k + 1) / ln(n)``; ``linear``: ``gamma = k / n``; ``lr = min + (max - min) * gamma``.
    ``warmup_max_lr`` None (left out): each param group's own lr, as the optimizer has it at construction."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = [_base_lr(group) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _positive_steps(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start(last_batch_iteration)

    def _warmup_gamma(self) -> float:
        k = self.last_batch_iteration
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(k + 1)
        return k / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            warnings.warn("attempting to get learning rate from scheduler before it has started")
        return self._values()

    def _values(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``: ``gamma = max(0, (total - k) / max(1, total - n))``.
    ``warmup_max_lr`` defaults to 0.001, not to the optimizer's lr: DeepSpeed 0.19's own signature."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0, warmup_max_lr: float | Sequence[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Warm-up then cosine decay, as ratios of the optimizer's lr at construction. Warm-up ratio
    ``warmup_min_ratio + gamma * (1 - warmup_min_ratio)``; then
    ``max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)`` with the progress
    ``p = min(1, (k - n + 1) / max(1, total - n))``: from ``total_num_steps`` on the ratio stays at ``cos_min_ratio``
    (DeepSpeed 0.19; 0.14 let the cosine rise again, and divided by zero when ``total == n``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, _positive_steps(warmup_num_steps, "warmup_num_steps"))
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        self.org_lrs = [_base_lr(group) for group in optimizer.param_groups]
        self._start(last_batch_iteration)

    def get_lr_ratio(self) -> float:
        k = self.last_batch_iteration
        if k < 0:
            return 0.0
        if k < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LOG_RATE:
                ratio = self.inverse_log_warm_up * math.log(k + 1)
            else:
                ratio = k / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1 - self.warmup_min_ratio)
        progress = min(1.0, (k - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            warnings.warn("attempting to get learning rate from scheduler before it has started")
        return self._values()

    def _values(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


_SCHEDULES = {LR_RANGE_TEST: LRRangeTest, ONE_CYCLE: OneCycle, WARMUP_LR: WarmupLR,
              WARMUP_DECAY_LR: WarmupDecayLR, WARMUP_COSINE_LR: WarmupCosineLR}


def build_lr_scheduler(type_name: str, optimizer: torch.optim.Optimizer, params: dict[str, Any] | None) -> Any:
    """A scheduler from the config: one of the five DeepSpeed schedules, or a torch.optim.lr_scheduler class."""
    from dsrun.utils.errors import ConfigError, Problem
    from dsrun.utils.suggest import did_you_mean

    params = dict(params or {})
    cls = _SCHEDULES.get(type_name) or getattr(torch.optim.lr_scheduler, type_name, None)
    if cls is None or not isinstance(cls, type):
        raise ConfigError(Problem("scheduler.type", f"got {type_name!r}; allowed: {', '.join(VALID_LR_SCHEDULES)} "
                                  "or a torch.optim.lr_scheduler class", did_you_mean(type_name, VALID_LR_SCHEDULES)))
    try:
        return cls(optimizer, **params)
    except TypeError as exc:
        raise ConfigError(Problem("scheduler.params", f"{type_name} rejected the params: {exc}",
                                  "params must be keyword arguments of the scheduler's constructor")) from None
    except ValueError as exc:
        raise ConfigError(Problem("scheduler.params", f"{type_name}: {exc}",
                                  "see the schedule's parameters in docs/engine.md")) from None
