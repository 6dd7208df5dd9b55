"""DeepSpeed's ``deepspeed.runtime.rollout`` package: its names are ``dsrun/inference/rollout.py``'s (its ``base`` and
``hybrid_engine_rollout`` modules are that module, ``dsrun/alias/paths.py``)."""
from dsrun.inference.rollout import (HybridEngineRollout, RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest,
                                     SamplingConfig, build_rollout)

__all__ = ["HybridEngineRollout", "RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig",
           "build_rollout"]
