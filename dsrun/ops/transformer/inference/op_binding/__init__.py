"""DeepSpeed's v1 inference op classes (``deepspeed.ops.transformer.inference.op_binding.*``: one module per op
there, this one package here; ``dsrun/alias/paths.py`` serves each of DeepSpeed's paths with it).

Each op is an ``nn.Module`` built from a :class:`~.config.DeepSpeedInferenceConfig` that calls the kernel the
``transformer_inference`` op (``InferenceBuilder().load()``, :mod:`.kernels`) holds for the config's dtype, as
DeepSpeed's classes pick ``bias_add_fp16`` or ``bias_add_fp32``. The kernels are torch, so the ops run on a CPU.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch
from torch import nn

from dsrun.utils.types import ActivationFuncType

from .. import kernels
from ..config import DeepSpeedInferenceConfig

_SUFFIX = {torch.float16: "fp16", torch.int8: "fp16", torch.bfloat16: "bf16"}


class BaseOp(nn.Module):
    """An op over the ``transformer_inference`` module (loaded once per process, DeepSpeed's class attribute)."""

    inference_module: ModuleType | None = None

    def __init__(self, config: DeepSpeedInferenceConfig | None):
        super().__init__()
        self.config = config
        if BaseOp.inference_module is None:
            from op_builder import InferenceBuilder

            BaseOp.inference_module = InferenceBuilder().load()

    def _kernel(self, name: str) -> Callable:
        """The kernel ``name`` for the config's dtype (``name_fp16``, ``name_bf16``, ``name_fp32``)."""
        return getattr(self.inference_module, f"{name}_{_SUFFIX.get(self.config.dtype, 'fp32')}")


class BiasAddOp(BaseOp):
    """``activation + bias``."""

    def __init__(self, config: DeepSpeedInferenceConfig):
        super().__init__(config)
        self.bias_add_func = self._kernel("bias_add")

    bias_add_fallback = staticmethod(kernels.bias_add)

    def forward(self, activation: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.bias_add_func(activation, bias)


class BiasGeluOp(BaseOp):
    """GELU (tanh approximation) of ``activation + bias``, in float32."""

    def __init__(self, config: DeepSpeedInferenceConfig):
        super().__init__(config)
        self.bias_gelu_func = self._kernel("bias_gelu")

    bias_gelu_fallback = staticmethod(kernels.bias_gelu)

    def forward(self, activation: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.bias_gelu_func(activation, bias)


class BiasReluOp(BaseOp):
    """ReLU of ``activation + bias``, in float32."""

    def __init__(self, config: DeepSpeedInferenceConfig):
        super().__init__(config)
        self.bias_relu_func = self._kernel("bias_relu")

    bias_relu_fallback = staticmethod(kernels.bias_relu)

    def forward(self, activation: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.bias_relu_func(activation, bias)


class GatedActivationOp(BaseOp):
    """``value * act(gate)`` of ``[value | gate] = activation + bias`` (GEGLU, SwiGLU)."""

    def __init__(self, config: DeepSpeedInferenceConfig | None = None):
        super().__init__(config or DeepSpeedInferenceConfig())
        self.gated_activation_func = self.inference_module.gated_activation

    gated_activation_fallback = staticmethod(kernels.gated_activation)

    def forward(self, activation: torch.Tensor, bias: torch.Tensor,
                activation_func_type: ActivationFuncType) -> torch.Tensor:
        return self.gated_activation_func(activation, bias, activation_func_type)


class LayerNormOp(BaseOp):
    """LayerNorm in float32, in ``gamma``'s dtype; the residual forms are class-level (DeepSpeed's)."""

    def __init__(self, config: DeepSpeedInferenceConfig | None = None):
        super().__init__(config)
        self.layer_norm_func = self.inference_module.layer_norm

    layer_norm_fallback = staticmethod(kernels.layer_norm)
    layer_norm_residual = staticmethod(kernels.layer_norm_residual)
    layer_norm_residual_store_pre_ln_res = staticmethod(kernels.layer_norm_residual_store_pre_ln_res)

    def forward(self, vals: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, epsilon: float) -> torch.Tensor:
        return self.layer_norm_func(vals, gamma, beta, epsilon)


class RMSNormOp(BaseOp):
    """RMSNorm, the mean of squares in float32."""

    def __init__(self, config: DeepSpeedInferenceConfig | None = None):
        super().__init__(config or DeepSpeedInferenceConfig())
        self.rms_norm_func = self.inference_module.rms_norm

    rms_norm_fallback = staticmethod(kernels.rms_norm)

    def forward(self, vals: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
        return self.rms_norm_func(vals, gamma, epsilon)


class PreRMSNormOp(BaseOp):
    """``(rms_norm(vals + residual), vals + residual)``."""

    def __init__(self, config: DeepSpeedInferenceConfig | None = None):
        super().__init__(config or DeepSpeedInferenceConfig())
        self.pre_rms_norm_func = self.inference_module.pre_rms_norm

    pre_rms_norm_fallback = staticmethod(kernels.pre_rms_norm)

    def forward(self, vals: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pre_rms_norm_func(vals, residual, gamma, epsilon)


class MoEResMatmulOp(BaseOp):
    """PR-MoE's residual mix ``residual * c1 + output * c2`` (``coef``: ``[batch, 2 * hidden, 1]``)."""

    def __init__(self, config: DeepSpeedInferenceConfig | None = None):
        super().__init__(config or DeepSpeedInferenceConfig())
        self.moe_res_matmul_func = self.inference_module.moe_res_matmul

    moe_res_matmul_fallback = staticmethod(kernels.moe_res_matmul)

    def forward(self, residual: torch.Tensor, coef: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return self.moe_res_matmul_func(residual, coef, output)


class VectorAddOp(BaseOp):
    """``gamma * a + b`` in float32."""

    def __init__(self, config: DeepSpeedInferenceConfig | None = None):
        super().__init__(config or DeepSpeedInferenceConfig())
        self.vector_add_func = self.inference_module._vector_add

    vector_add_fallback = staticmethod(kernels.vector_add)

    def forward(self, a: torch.Tensor, b: torch.Tensor, gamma: float) -> torch.Tensor:
        return self.vector_add_func(a, b, gamma)


class ResidualAddOp(BaseOp):
    """A block's residual add (:func:`.kernels.residual_add_bias`, shaped by the config's ``mp_size``,
    ``mlp_after_attn`` and ``pre_layer_norm``); without biases, ``(residual + attention_output) / mp_size +
    hidden_state``."""

    def __init__(self, config: DeepSpeedInferenceConfig):
        super().__init__(config)
        self.residual_add_func = self._kernel("residual_add_bias")
        self.vector_add = VectorAddOp()

    residual_add_fallback = staticmethod(kernels.residual_add_bias)

    def forward(self, hidden_state: torch.Tensor, residual: torch.Tensor, add_bias: bool,
                attention_output: Optional[torch.Tensor] = None, residual_add: Optional[torch.Tensor] = None,
                attention_bias: Optional[torch.Tensor] = None,
                final_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if final_bias is None and attention_bias is None:
            return self.vector_add(residual + attention_output, hidden_state, 1.0 / self.config.mp_size)
        if not self.config.pre_layer_norm and residual_add is not None:
            residual = residual_add  # Post-LN: the residual the caller kept before its norm
        return self.residual_add_func(hidden_state, residual, attention_output, attention_bias, final_bias,
                                      self.config.mp_size, self.config.mlp_after_attn, add_bias,
                                      self.config.pre_layer_norm)


__all__ = ["BaseOp", "BiasAddOp", "BiasGeluOp", "BiasReluOp", "GatedActivationOp", "LayerNormOp", "MoEResMatmulOp",
           "PreRMSNormOp", "RMSNormOp", "ResidualAddOp", "VectorAddOp"]
