"""DeepSpeed's inference v2 (FastGen), served as ``deepspeed.inference.v2``: the parts that are not CUDA kernels.

dsrun has the ragged KV cache's block allocator and the state manager's configs (``ragged``), the engine config
(``RaggedInferenceEngineConfig``), the parameter containers with their checkpoint-name mapping and the
tensor-parallel sharding helpers (``model_implementations``), the FP6 weight-only quantized linear with a torch
path (``modules``), the gated and bias activations (``kernels.core_ops``) and EXAONE 4.5's model logic. The
engine itself (``InferenceEngineV2``, ``build_hf_engine``) runs DeepSpeed's CUDA kernels (blocked flash attention,
ragged embedding, CUTLASS MoE) and is refused with one line, as it fails on DeepSpeed's own CPU side. For CPU
inference, ``dsrun.init_inference`` (docs/inference.md).
"""
from __future__ import annotations

from .config_v2 import DeepSpeedTPConfig, QuantizationConfig, RaggedInferenceEngineConfig
from .kernels import NotOnCPUError, cuda_function, cuda_kernel

_ENGINE = "FastGen's engine runs DeepSpeed's CUDA kernels (blocked flash attention, ragged embedding)"
InferenceEngineV2 = cuda_kernel("inference.v2.engine_v2.InferenceEngineV2", _ENGINE)
build_hf_engine = cuda_function("inference.v2.build_hf_engine", _ENGINE)
build_engine_from_ds_checkpoint = cuda_function("inference.v2.build_engine_from_ds_checkpoint", _ENGINE)

__all__ = ["DeepSpeedTPConfig", "InferenceEngineV2", "NotOnCPUError", "QuantizationConfig",
           "RaggedInferenceEngineConfig", "build_engine_from_ds_checkpoint", "build_hf_engine"]
