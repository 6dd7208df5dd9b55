"""DeepSpeed's inference v2 (FastGen), served as ``deepspeed.inference.v2``: everything but the engine.

dsrun has the ragged batch, the state manager with its blocked KV cache (``ragged``), the engine config
(``RaggedInferenceEngineConfig``), the parameter containers with their checkpoint-name mapping, flat buffer and
tensor-parallel sharding helpers (``model_implementations``), DeepSpeed's CUDA kernels as torch implementations of
the same math on the same layouts (``kernels``: core ops, ragged ops, the MoE GEMM), the modules built over them
(``modules``) and EXAONE 4.5's model logic. The engine itself (``InferenceEngineV2``, ``build_hf_engine``) and
building a model are refused with one line. For CPU inference, ``dsrun.init_inference`` (docs/inference.md).
"""
from __future__ import annotations

from .config_v2 import DeepSpeedTPConfig, QuantizationConfig, RaggedInferenceEngineConfig
from .kernels import NotOnCPUError, cuda_function, cuda_kernel

_ENGINE = "FastGen's engine, whose models need DeepSpeed's embedding and unembedding modules"
InferenceEngineV2 = cuda_kernel("inference.v2.engine_v2.InferenceEngineV2", _ENGINE)
build_hf_engine = cuda_function("inference.v2.build_hf_engine", _ENGINE)
build_engine_from_ds_checkpoint = cuda_function("inference.v2.build_engine_from_ds_checkpoint", _ENGINE)

__all__ = ["DeepSpeedTPConfig", "InferenceEngineV2", "NotOnCPUError", "QuantizationConfig",
           "RaggedInferenceEngineConfig", "build_engine_from_ds_checkpoint", "build_hf_engine"]
