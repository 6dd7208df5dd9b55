"""``deepspeed.runtime.base_optimizer``: DeepSpeed's base classes of its optimizer wrappers, ``DeepSpeedOptimizer``
(all five) and ``ZeROOptimizer`` (the ZeRO ones: ``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``,
``BF16_Optimizer``). dsrun's ZeRO strategies step the client's optimizer themselves; ``isinstance(engine.optimizer,
ZeROOptimizer)`` says whether one of them stands where DeepSpeed would put such a wrapper
(:mod:`dsrun.optim.optimizer_wrappers`)."""
from __future__ import annotations

from dsrun.optim.optimizer_wrappers import ALL_WRAPPERS, ZERO_WRAPPERS, OptimizerWrapperKind


class DeepSpeedOptimizer(metaclass=OptimizerWrapperKind):
    """An optimizer that a strategy steps where DeepSpeed's engine would wrap it in any of its wrappers."""

    deepspeed_wrappers = ALL_WRAPPERS


class ZeROOptimizer(metaclass=OptimizerWrapperKind):
    """An optimizer that a ZeRO strategy steps (DeepSpeed's ZeRO-1/2, ZeRO-3 or bf16 wrapper)."""

    deepspeed_wrappers = ZERO_WRAPPERS


__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
