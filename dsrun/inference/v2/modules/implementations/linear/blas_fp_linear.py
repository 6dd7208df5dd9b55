"""``deepspeed.inference.v2.modules.implementations.linear.blas_fp_linear``: DeepSpeed's ``blas_fp_linear``, the
fp16/bf16 linear: ``x @ W.T`` (:class:`BlasLibLinear`), then the bias and the activation (a gated activation
halves the channels: the weight is ``[out_channels * 2, in_channels]``), on the torch core kernels."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ....allocator import current_device, empty_from
from ....inference_parameter import InferenceParameter
from ....inference_utils import is_gated
from ....kernels.core_ops import BlasLibLinear, CUDABiasActivation, CUDAGatedActivation
from ...configs import DSLinearConfig
from ...interfaces import DSLinearBase, DSLinearRegistry


def activation_supported(config: DSLinearConfig) -> bool:
    """Whether the activation kernel after the GEMM (gated or bias-plus-activation) takes ``config``."""
    try:
        if is_gated(config.activation):
            CUDAGatedActivation(config.out_channels, config.output_dtype, config.activation)
        else:
            CUDABiasActivation(config.out_channels, config.output_dtype, config.activation)
    except ValueError:
        return False
    return True


@DSLinearRegistry.register_module
class BlasFPLinear(DSLinearBase):

    @staticmethod
    def name() -> str:
        return 'blas_fp_linear'

    @staticmethod
    def supports_config(config: DSLinearConfig) -> bool:
        if config.input_dtype != config.output_dtype or config.input_dtype not in (torch.float16, torch.bfloat16):
            return False
        return activation_supported(config)

    def __init__(self, config: DSLinearConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)
        self._linear_impl = BlasLibLinear(config.input_dtype)
        self._is_gated = is_gated(config.activation)
        if self._is_gated:
            self._act_fn = CUDAGatedActivation(config.out_channels, config.output_dtype, config.activation)
            self._double_buffer = torch.empty((config.max_tokens, config.out_channels * 2), dtype=config.output_dtype,
                                              device=current_device())
        else:
            self._act_fn = CUDABiasActivation(config.out_channels, config.output_dtype, config.activation)
        self._output = torch.empty((config.max_tokens, config.out_channels), dtype=config.output_dtype,
                                   device=current_device())

    def transform_param(self, param: torch.Tensor) -> InferenceParameter:
        """A weight or bias in the activations' dtype."""
        return InferenceParameter.initialize(param.to(self._config.output_dtype))

    def forward(self, hidden_states: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        output = empty_from(self._output, (hidden_states.shape[0], self._config.out_channels))
        if self._is_gated:
            staging = empty_from(self._double_buffer, (hidden_states.shape[0], self._config.out_channels * 2))
            self._linear_impl(staging, hidden_states, w)
            self._act_fn(output, staging, b)
        else:
            self._linear_impl(output, hidden_states, w)
            self._act_fn(output, b)
        return output

    @property
    def output(self) -> torch.Tensor:
        return self._output
