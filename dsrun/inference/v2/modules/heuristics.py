"""``deepspeed.inference.v2.modules.heuristics``: which implementation a model's layer gets: dense blocked
attention, the multi-GEMM MoE, the layer/RMS pre-norm by norm type, the post layer norm, the fp16/bf16 linear or
the FP6 quantized one when the engine config asks for ``wf6af16``. DeepSpeed's embedding and unembedding modules
are not provided (refused with one line)."""
from __future__ import annotations

from typing import Callable, NoReturn

from ..config_v2 import RaggedInferenceEngineConfig
from ..kernels import cuda_function
from .configs import DSLinearConfig, DSMoEConfig, DSNormConfig, DSSelfAttentionConfig, NormTypeEnum
from .ds_module import ConfigBundle
from .interfaces import (DSLinearBase, DSLinearRegistry, DSMoEBase, DSMoERegistry, DSPostNormBase,
                         DSPostNormRegistry, DSPreNormBase, DSPreNormRegistry, DSSelfAttentionBase,
                         DSSelfAttentionRegistry)


def instantiate_attention(attention_config: DSSelfAttentionConfig,
                          engine_config: RaggedInferenceEngineConfig) -> DSSelfAttentionBase:
    return DSSelfAttentionRegistry.instantiate_config(ConfigBundle(name="dense_blocked_attention",
                                                                   config=attention_config))


def instantiate_linear(config: DSLinearConfig, engine_config: RaggedInferenceEngineConfig) -> DSLinearBase:
    """``blas_fp_linear``, or the FP6 quantized linear when the engine asks for ``wf6af16``. DeepSpeed allows
    ``wf6af16`` only on an Ampere GPU; its torch path here runs anywhere."""
    mode = engine_config.quantization.quantization_mode
    name = "quantized_wf6af16_linear" if mode == "wf6af16" else "blas_fp_linear"
    return DSLinearRegistry.instantiate_config(ConfigBundle(name=name, config=config))


def instantiate_moe(moe_config: DSMoEConfig, engine_config: RaggedInferenceEngineConfig) -> DSMoEBase:
    return DSMoERegistry.instantiate_config(ConfigBundle(name="cutlass_multi_gemm_moe", config=moe_config,
                                                         implementation_config={"weight_dtype": moe_config.input_dtype}))


def instantiate_post_norm(norm_config: DSNormConfig, engine_config: RaggedInferenceEngineConfig) -> DSPostNormBase:
    return DSPostNormRegistry.instantiate_config(ConfigBundle(name="cuda_post_ln", config=norm_config))


def instantiate_pre_norm(norm_config: DSNormConfig, engine_config: RaggedInferenceEngineConfig) -> DSPreNormBase:
    name = "cuda_pre_ln" if NormTypeEnum(norm_config.type) == NormTypeEnum.LayerNorm else "cuda_pre_rms"
    return DSPreNormRegistry.instantiate_config(ConfigBundle(name=name, config=norm_config))


def _refused(layer: str) -> Callable[..., NoReturn]:
    return cuda_function(f"inference.v2.modules.heuristics.instantiate_{layer}",
                         f"DeepSpeed's {layer} module, which dsrun does not provide (its ragged kernels are in "
                         "kernels.ragged_ops)")


instantiate_embed = _refused("embed")
instantiate_unembed = _refused("unembed")
