"""``deepspeed.inference.v2.modules.heuristics``: which implementation a model's layer gets. The linear is the FP6
quantized one when the engine config asks for ``wf6af16``; every other layer of DeepSpeed's (attention,
embedding, norms, MoE, unembedding, the cuBLAS linear) is a CUDA kernel and is refused here."""
from __future__ import annotations

from typing import Callable, NoReturn

from ..config_v2 import RaggedInferenceEngineConfig
from ..kernels import cuda_function, not_on_cpu
from .configs import DSLinearConfig
from .ds_module import ConfigBundle
from .interfaces import DSLinearBase, DSLinearRegistry


def instantiate_linear(config: DSLinearConfig, engine_config: RaggedInferenceEngineConfig) -> DSLinearBase:
    mode = engine_config.quantization.quantization_mode
    if mode == "wf6af16":
        return DSLinearRegistry.instantiate_config(ConfigBundle(name="quantized_wf6af16_linear", config=config))
    raise not_on_cpu("inference.v2.modules.heuristics.instantiate_linear",
                     f"quantization_mode={mode!r} takes DeepSpeed's cuBLAS linear, a CUDA kernel ('wf6af16' has a "
                     "torch path)")


def _refused(layer: str) -> Callable[..., NoReturn]:
    return cuda_function(f"inference.v2.modules.heuristics.instantiate_{layer}",
                         f"DeepSpeed's {layer} modules are CUDA kernels")


instantiate_attention = _refused("attention")
instantiate_embed = _refused("embed")
instantiate_moe = _refused("moe")
instantiate_post_norm = _refused("post_norm")
instantiate_pre_norm = _refused("pre_norm")
instantiate_unembed = _refused("unembed")
