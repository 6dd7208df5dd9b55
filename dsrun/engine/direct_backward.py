"""A backward the engine did not run: ``loss.backward()`` (or ``torch.autograd.backward``) instead of
``engine.backward(loss)``, then ``engine.step()``, as DeepSpeed allows.

A hook on every trainable parameter sees each gradient before torch accumulates it. In a backward the engine
did not run it divides the gradient by the gradient accumulation steps, as ``engine.backward`` divides the loss
(DeepSpeed divides the gradient flowing out of the forward's outputs by the same number; dividing at the
parameters counts an output computed from another output only once), and notes that gradients are waiting.
The gradients then stay where torch put them (``.grad``: the flat buffer at stages 0-1, the parameter at stages
2-3), so a script that clears them (a GAN's ``netD.zero_grad()`` after the generator's backward went through
the discriminator) clears them as in torch. The next ``step()`` hands the waiting gradients to the ZeRO
strategy as one more backward would (the engine's prologue and epilogue: stages 0-1 reduce at the accumulation
boundary, stages 2-3 on every micro-step), unless an ``engine.backward`` since has reduced them already. Unlike
DeepSpeed, which reduces during such a backward, stages 2-3 keep these whole gradients until ``step()``.

fp16 cannot: its gradients must come from the loss multiplied by the loss scale, which only
``engine.backward`` applies; the first ``step()`` after such a backward refuses (DeepSpeed refuses at the
backward's end, unless ``engine.scale(loss)`` was used). At every stage and precision, a ``step()`` at an
accumulation boundary with no gradient produced since the last optimizer step refuses instead of stepping on
nothing.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from dsrun.utils.errors import Problem, UserError

USE_ENGINE_BACKWARD = "call engine.backward(loss) instead of loss.backward()"


class DirectBackward:
    """The engine's record of backward passes: whether one produced gradients since the last optimizer step, and
    whether one it did not run left gradients the strategy has not taken (``engine.direct_backward``)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.engine_running = 0  # engine.backward (or the pipeline's own backward) is running: hooks stand aside
        self.waiting = False  # gradients of a backward the engine did not run wait for the strategy
        self.produced = False  # some parameter received a gradient since the last optimizer step
        # parameters() yields a tensor shared by two modules once, so each gradient is divided once
        self._handles = [p.register_hook(self._param_grad) for p in engine.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def engine_backward(self) -> Iterator[None]:
        """Around a backward the engine frames itself (``engine.backward``, the pipeline's passes)."""
        self.engine_running += 1
        try:
            yield
        finally:
            self.engine_running -= 1

    def _param_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.produced = True
        if self.engine_running:
            return None
        self.waiting = True
        divisor = self.engine._gas_divisor(self.engine.scale_wrt_gas is not False)
        return grad / divisor if divisor != 1.0 else None

    def reduced(self) -> None:
        """The strategy took every gradient there is (a reducing backward, an explicit reduction)."""
        self.waiting = False

    def hand_over(self) -> None:
        """At ``step()``: give the strategy the gradients a backward it did not see left (fp16: refuse)."""
        if not self.waiting:
            return
        engine = self.engine
        if engine.precision.scales_loss:
            self.waiting = False
            raise UserError(Problem("engine.step()", "the gradients came from a backward engine.backward() did not "
                                    f"run, and {engine.precision.name} training needs the loss multiplied by its loss "
                                    "scale", USE_ENGINE_BACKWARD))
        engine._backward_epilogue(engine._backward_prologue())

    def check_step(self) -> None:
        """At an accumulation boundary: refuse an optimizer step on no gradient; start counting again."""
        if not self.produced:
            raise UserError(Problem("engine.step()", "no gradient was produced since the last optimizer step, so "
                                    "there is nothing to update the weights with", "run engine.backward(loss) (or "
                                    "loss.backward()) before each step()"))
        self.produced = False

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
