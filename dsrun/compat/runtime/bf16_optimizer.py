"""``deepspeed.runtime.bf16_optimizer``: DeepSpeed's ``BF16_Optimizer`` name. Where DeepSpeed wraps the optimizer in
it (a bf16 model at ZeRO stage 1 accumulating gradients in fp32, or bf16 in a pipeline without ZeRO), dsrun's ZeRO
strategy steps the client's optimizer itself; ``isinstance(engine.optimizer, BF16_Optimizer)`` says whether that
is the case (:mod:`dsrun.optim.optimizer_wrappers`)."""
from __future__ import annotations

from dsrun.checkpoint.universal_checkpoint import UniversalCheckpointGroups
from dsrun.optim.optimizer_wrappers import OptimizerWrapperKind


class BF16_Optimizer(UniversalCheckpointGroups, metaclass=OptimizerWrapperKind):  # noqa: N801 - DeepSpeed's name
    """An optimizer stepped where DeepSpeed's engine would use its bf16 wrapper."""

    lp_groups_attr = "bf16_groups"  # the groups its universal-checkpoint methods walk
