"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO stage 1-2 optimizer name. dsrun's stages 1 and 2
are :mod:`dsrun.zero.partitioned`; ``isinstance(engine.optimizer, DeepSpeedZeroOptimizer)`` says
whether one of them steps the engine's optimizer (:mod:`dsrun.optim.optimizer_wrappers`)."""
from __future__ import annotations

from dsrun.checkpoint.universal_checkpoint import UniversalCheckpointGroups
from dsrun.optim.optimizer_wrappers import OptimizerWrapperKind


class DeepSpeedZeroOptimizer(UniversalCheckpointGroups, metaclass=OptimizerWrapperKind):
    """An optimizer stepped by ZeRO stage 1 or 2."""

    lp_groups_attr = "bit16_groups"  # the groups its universal-checkpoint methods walk
