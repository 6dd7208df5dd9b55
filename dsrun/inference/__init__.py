"""``dsrun.inference``: DeepSpeed's inference entry point for dsrun.

::

    import dsrun
    engine = dsrun.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    logits = engine(input_ids)
    tokens = engine.generate(input_ids, max_new_tokens=32)

Automatic tensor parallelism splits any Transformer's blocks over the model-parallel group
(:mod:`.auto_tp`); ``replace_with_kernel_inject`` gives dsrun's GPT a fused KV-cache forward
(:mod:`.fused_gpt`); ``checkpoint`` loads a dsrun training checkpoint or a 16-bit model file
(:mod:`.loading`). ``docs/inference.md`` has the details and figures.
"""
from __future__ import annotations

from .config import (DeepSpeedInferenceConfig, DeepSpeedMoEConfig, DeepSpeedTPConfig, InferenceCheckpointConfig,
                     QuantizationConfig)
from .engine import InferenceEngine, init_inference

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedMoEConfig", "DeepSpeedTPConfig", "InferenceCheckpointConfig",
           "InferenceEngine", "QuantizationConfig", "init_inference"]
