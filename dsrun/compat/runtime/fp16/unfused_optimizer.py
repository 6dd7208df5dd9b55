"""``deepspeed.runtime.fp16.unfused_optimizer``: DeepSpeed's fp16 optimizer name for optimizers other than a
fused Adam (LAMB, a client's torch optimizer); ``isinstance(engine.optimizer, FP16_UnfusedOptimizer)`` answers
as DeepSpeed's engine would (:mod:`dsrun.optim.optimizer_wrappers`)."""
from __future__ import annotations

from dsrun.optim.optimizer_wrappers import OptimizerWrapperKind


class FP16_UnfusedOptimizer(metaclass=OptimizerWrapperKind):  # noqa: N801 - DeepSpeed's name
    """An optimizer stepped in fp16 without ZeRO, not a fused Adam."""
