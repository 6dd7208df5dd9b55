"""DeepSpeed's norm modules (``post_norm.cuda_post_ln``, ``pre_norm.cuda_pre_ln``, ``pre_norm.cuda_pre_rms``) over
the torch norm kernels of ``kernels.core_ops``: one dtype for residual, input and output; gamma and beta stored in
it; the residual updated in place.

- ``cuda_post_ln``: ``residual = layer_norm(residual + hidden_in)``, returned twice (the output aliases it);
- ``cuda_pre_ln``: ``residual += hidden_in`` (when given), ``hidden_out = layer_norm(residual)``;
- ``cuda_pre_rms``: the same with RMS norm (no beta), the residual sum in a buffer of its own."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ...allocator import current_device, empty_from
from ...inference_parameter import InferenceParameter
from ...kernels.core_ops import CUDAFPLN, CUDAFPPostLN, CUDAFPPreLN, CUDARMSNorm, CUDARMSPreNorm
from ..configs import DSNormConfig, NormTypeEnum
from ..interfaces import DSPostNormBase, DSPostNormRegistry, DSPreNormBase, DSPreNormRegistry


def _supports(config: DSNormConfig, norm: NormTypeEnum, kernel: type) -> bool:
    if NormTypeEnum(config.type) != norm:
        return False
    if len({config.residual_dtype, config.input_dtype, config.output_dtype}) != 1:
        return False
    try:
        kernel(config.channels, config.residual_dtype)
    except ValueError:
        return False
    return True


def _buffer(config: DSNormConfig) -> torch.Tensor:
    return torch.empty((config.max_tokens, config.channels), dtype=config.output_dtype, device=current_device())


class _NormModule:
    """The parameter transform the three share: gamma and beta in the activations' dtype."""

    def transform_param(self, param: torch.Tensor) -> InferenceParameter:
        return InferenceParameter.initialize(param.to(self._config.input_dtype))


@DSPostNormRegistry.register_module
class DSPostLNCUDAModule(_NormModule, DSPostNormBase):

    @staticmethod
    def name() -> str:
        return 'cuda_post_ln'

    @staticmethod
    def supports_config(config: DSNormConfig) -> bool:
        # DeepSpeed's post-norm module accepts any norm type and runs a LayerNorm
        return _supports(config, NormTypeEnum(config.type), CUDAFPPostLN)

    def __init__(self, config: DSNormConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)
        self._fp_post_ln = CUDAFPPostLN(config.channels, config.residual_dtype, epsilon=config.eps)
        self._output = _buffer(config)

    def forward(self, residual: torch.Tensor, hidden_in: torch.Tensor, gamma: torch.Tensor,
                beta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self._fp_post_ln(residual, residual, hidden_in, gamma, beta)
        return residual, residual


@DSPreNormRegistry.register_module
class DSPreLNCUDAModule(_NormModule, DSPreNormBase):

    @staticmethod
    def name() -> str:
        return 'cuda_pre_ln'

    @staticmethod
    def supports_config(config: DSNormConfig) -> bool:
        return _supports(config, NormTypeEnum.LayerNorm, CUDAFPPreLN)

    def __init__(self, config: DSNormConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)
        self._fp_pre_ln = CUDAFPPreLN(config.channels, config.residual_dtype, epsilon=config.eps)
        self._fp_ln = CUDAFPLN(config.channels, config.residual_dtype, epsilon=config.eps)
        self._hidden_output = _buffer(config)

    def forward(self, residual: torch.Tensor, hidden_in: Optional[torch.Tensor], gamma: torch.Tensor,
                beta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        hidden_out = empty_from(self._hidden_output, residual.shape)
        if hidden_in is None:
            self._fp_ln(hidden_out, residual, gamma, beta)
        else:
            self._fp_pre_ln(residual, hidden_out, residual, hidden_in, gamma, beta)
        return residual, hidden_out


@DSPreNormRegistry.register_module
class DSPreRMSCUDAModule(_NormModule, DSPreNormBase):

    @staticmethod
    def name() -> str:
        return 'cuda_pre_rms'

    @staticmethod
    def supports_config(config: DSNormConfig) -> bool:
        return _supports(config, NormTypeEnum.RMSNorm, CUDARMSPreNorm)

    def __init__(self, config: DSNormConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)
        self._fp_rms = CUDARMSNorm(config.channels, config.residual_dtype, epsilon=config.eps)
        self._fp_rms_pre = CUDARMSPreNorm(config.channels, config.residual_dtype, epsilon=config.eps)
        self._hidden_output = _buffer(config)
        self._residual_output = _buffer(config)

    def forward(self, residual: torch.Tensor, hidden_in: Optional[torch.Tensor], gamma: torch.Tensor,
                beta: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if beta is not None:
            raise ValueError("cuda_pre_rms: RMSNorm has no beta")
        hidden_out = empty_from(self._hidden_output, residual.shape)
        if hidden_in is None:
            self._fp_rms(hidden_out, residual, gamma)
            return residual, hidden_out
        residual_out = empty_from(self._residual_output, residual.shape)
        self._fp_rms_pre(residual_out, hidden_out, residual, hidden_in, gamma)
        return residual_out, hidden_out
