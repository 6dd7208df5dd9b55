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
from .kernels import NotOnCPUError, cuda_kernel

InferenceEngineV2 = cuda_kernel("inference.v2.engine_v2.InferenceEngineV2")


def _engine_refusal(name: str):
    def build(path: str, engine_config: RaggedInferenceEngineConfig, debug_level: int = 20) -> None:
        raise NotOnCPUError(f"deepspeed.inference.v2.{name}: FastGen's engine runs DeepSpeed's CUDA kernels "
                            "(blocked flash attention, ragged embedding), which dsrun does not provide (not on CPU); "
                            "use dsrun.init_inference (docs/inference.md)")
    build.__name__ = name
    return build


build_hf_engine = _engine_refusal("build_hf_engine")
build_engine_from_ds_checkpoint = _engine_refusal("build_engine_from_ds_checkpoint")

__all__ = ["DeepSpeedTPConfig", "InferenceEngineV2", "QuantizationConfig", "RaggedInferenceEngineConfig",
           "build_engine_from_ds_checkpoint", "build_hf_engine"]
