"""``deepspeed.inference.v2.modules.heuristics``: which implementation a model's layer gets. The linear is the FP6
quantized one when the engine config asks for ``wf6af16``; every other layer of DeepSpeed's (attention,
embedding, norms, MoE, unembedding, the cuBLAS linear) is a CUDA kernel and is refused here."""
from __future__ import annotations

from typing import Optional

import torch

from dsrun.config.config_utils import DeepSpeedConfigModel

from ..config_v2 import RaggedInferenceEngineConfig
from ..kernels import NotOnCPUError
from .configs import DSLinearConfig
from .ds_module import ConfigBundle
from .interfaces import DSLinearBase, DSLinearRegistry


def instantiate_linear(config: DSLinearConfig, engine_config: RaggedInferenceEngineConfig) -> DSLinearBase:
    mode = engine_config.quantization.quantization_mode
    if mode == "wf6af16":
        return DSLinearRegistry.instantiate_config(ConfigBundle(name="quantized_wf6af16_linear", config=config))
    raise NotOnCPUError(f"deepspeed.inference.v2.modules.heuristics.instantiate_linear: quantization_mode={mode!r} "
                        "takes DeepSpeed's cuBLAS linear, a CUDA kernel dsrun does not provide (not on CPU); "
                        "quantization_mode='wf6af16' has a torch path")


def _refused(layer: str):
    def instantiate(config: DeepSpeedConfigModel,
                    engine_config: Optional[RaggedInferenceEngineConfig] = None) -> torch.nn.Module:
        raise NotOnCPUError(f"deepspeed.inference.v2.modules.heuristics.instantiate_{layer}: DeepSpeed's {layer} "
                            "modules are CUDA kernels, which dsrun does not provide (not on CPU)")
    instantiate.__name__ = f"instantiate_{layer}"
    return instantiate


instantiate_attention = _refused("attention")
instantiate_embed = _refused("embed")
instantiate_moe = _refused("moe")
instantiate_post_norm = _refused("post_norm")
instantiate_pre_norm = _refused("pre_norm")
instantiate_unembed = _refused("unembed")
