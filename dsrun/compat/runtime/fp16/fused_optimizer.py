"""``deepspeed.runtime.fp16.fused_optimizer``: DeepSpeed's fp16 optimizer name (fp16 without ZeRO over a fused
Adam); ``isinstance(engine.optimizer, FP16_Optimizer)`` answers as DeepSpeed's engine would
(:mod:`dsrun.optim.optimizer_wrappers`). Mixed precision itself is :mod:`dsrun.precision.strategy`."""
from __future__ import annotations

from dsrun.optim.optimizer_wrappers import OptimizerWrapperKind


class FP16_Optimizer(metaclass=OptimizerWrapperKind):  # noqa: N801 - DeepSpeed's name
    """An optimizer stepped in fp16 without ZeRO, a fused Adam."""
