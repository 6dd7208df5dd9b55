"""``dsrun.inference``: DeepSpeed's inference entry point for dsrun.

::

    import dsrun
    engine = dsrun.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    logits = engine(input_ids)
    tokens = engine.generate(input_ids, max_new_tokens=32)

Automatic tensor parallelism splits any Transformer's blocks over the model-parallel group
(:mod:`.auto_tp`); ``replace_with_kernel_inject`` gives dsrun's GPT a fused KV-cache forward
(:mod:`.fused_gpt`); ``checkpoint`` loads a dsrun training checkpoint or a 16-bit model file
(:mod:`.loading`). DeepSpeed's inference v2 (FastGen) is :mod:`.v2`: its CPU-side parts, the engine refused.
``docs/inference.md`` has the details and figures.
"""
from __future__ import annotations

from .config import (DeepSpeedInferenceConfig, DeepSpeedMoEConfig, DeepSpeedTPConfig, InferenceCheckpointConfig,
                     QuantizationConfig)
from .engine import InferenceEngine, init_inference
from .v2 import InferenceEngineV2, RaggedInferenceEngineConfig, build_engine_from_ds_checkpoint, build_hf_engine

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedMoEConfig", "DeepSpeedTPConfig", "InferenceCheckpointConfig",
           "InferenceEngine", "InferenceEngineV2", "QuantizationConfig", "RaggedInferenceEngineConfig",
           "build_engine_from_ds_checkpoint", "build_hf_engine", "init_inference"]
