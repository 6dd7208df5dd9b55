"""Named points on the one optimizer-step path (:meth:`dsrun.zero.base.ZeroStrategy.step`) where
features attach without flags inside the ZeRO strategies.

Every stage, offloaded or not, steps the same way: gradients checked for overflow on every rank, the global
norm measured (when clipping), one coefficient ``coef`` that removes the loss scale and clips (the reduction
already finished the average: averaging.py), then the update and the write-back of the weights. Around the update:

``before_update``  called with a :class:`StepState` after overflow, norm and clipping are decided and before
                   the optimizer runs. ``state.coef`` may be changed (it multiplies every gradient); the
                   resident gradients the update will read are ``state.gradients()`` (fp32, this rank's
                   partition at stages 1-3, still multiplied by the loss scale: multiply by
                   ``state.coef`` to get what the optimizer sees). Compression schedules that mask or
                   scale gradients attach here (MoE experts need no hook: they are reduced over their
                   expert-data group by the strategies); so do the 1-bit optimizers, which turn the backward
                   reduction off (``strategy.reduction.enabled = False``, DeepSpeed's
                   ``enable_backward_allreduce``) once their warm-up ends and then read each rank's own gradient,
                   ``state.local_gradients()`` (``state.reduced`` is False on such steps; ``state.coef`` then
                   holds no averaging).
``after_update``   called after the update has reached the model's parameters (stage 3: its shards).
                   Compression schedules that prune or quantize weights after each step attach here.

Whether the step's gradients were reduced is the strategy's :class:`GradientReduction` (``strategy.reduction``),
set by whoever switches the backward reduction and latched by the backward path at each accumulation boundary;
the step reads it, it names no feature.

A hook is ``fn(state) -> None``; :meth:`StepHooks.add` returns a handle whose ``remove()`` detaches it. Hooks
run in the order they were added, on every rank (they may use collectives on ``state.strategy.ctx.group``).
A step skipped for an fp16 overflow runs neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

BEFORE_UPDATE, AFTER_UPDATE = "before_update", "after_update"
POINTS = (BEFORE_UPDATE, AFTER_UPDATE)


class StepSource(Protocol):
    """What a :class:`StepState` reads of the strategy stepping (``dsrun.zero.base.ZeroStrategy``)."""

    reduction: "GradientReduction"

    def step_gradients(self) -> list[torch.Tensor]: ...

    def local_gradients(self) -> list[torch.Tensor] | None: ...


class GradientReduction:
    """Whether backward reduces gradients across ranks. ``enabled`` is the switch (DeepSpeed's
    ``enable_backward_allreduce``; an optimizer that communicates itself turns it off), read by the backward of
    each accumulation boundary, which latches it into ``reduced``: what the next step's gradients are (False:
    each rank's own local gradient; the step then checks overflow and measures the norm per rank)."""

    def __init__(self) -> None:
        self.enabled = True
        self.reduced = True

    def latch(self) -> None:
        """Called by the backward of an accumulation boundary."""
        self.reduced = self.enabled


@dataclass
class StepState:
    """What a step hook receives."""

    strategy: StepSource
    coef: float  # multiplies every gradient before the optimizer: 1 / loss scale, the average, the clip
    grad_norm: float | None  # the global gradient norm (unscaled), when clipping measured it; a before_update hook
    # that changes what the update reads may set it anew (Muon: the norm over its orthogonalised updates), and the
    # step reports that value
    step: int = 0  # optimizer steps taken by this strategy before this one
    extra: dict[str, Any] = field(default_factory=dict)  # for hooks to pass data on to later hooks

    @property
    def reduced(self) -> bool:
        """Whether backward reduced this step's gradients across ranks (``strategy.reduction.reduced``)."""
        return self.strategy.reduction.reduced

    def gradients(self) -> list[torch.Tensor]:
        """The resident fp32 gradients the update reads (scaled: see the module docstring)."""
        return self.strategy.step_gradients()

    def local_gradients(self) -> list[torch.Tensor] | None:
        """This rank's whole gradients (model dtype, one flat tensor per master, scaled like ``gradients()``;
        unreduced when ``reduced`` is False); None at stages that do not keep them (2, 3, offload)."""
        return self.strategy.local_gradients()


class _Handle:
    def __init__(self, hooks: list[Callable[[StepState], None]], fn: Callable[[StepState], None]):
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class StepHooks:
    """The hooks of one strategy, by point."""

    def __init__(self) -> None:
        self._points: dict[str, list[Callable[[StepState], None]]] = {point: [] for point in POINTS}

    def add(self, point: str, fn: Callable[[StepState], None]) -> _Handle:
        if point not in self._points:
            raise ValueError(f"unknown step hook point {point!r}; allowed: {', '.join(POINTS)}")
        self._points[point].append(fn)
        return _Handle(self._points[point], fn)

    def run(self, point: str, state: StepState) -> None:
        for fn in list(self._points[point]):
            fn(state)

    def clear(self) -> None:
        for hooks in self._points.values():
            hooks.clear()
