"""``deepspeed.inference.v2.modules.implementations.linear.quantized_linear``: DeepSpeed's FP6 weight-only linear
(``quantized_wf6af16_linear``: FP6 weights, FP16 activations) with a torch path. ``fp_quantize`` scales each row
of a weight so its largest magnitude is FP6's largest value, 28, and rounds onto the FP6 grid (:mod:`...kernels.fp6`);
``transform_param`` stores the codes as the kernel's 2-bit and 4-bit slices (6 bits a weight) with one fp16 scale
per output channel; ``forward`` dequantizes and multiplies in float32 and writes fp16."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ....allocator import empty_from
from ....inference_parameter import InferenceParameter
from ....inference_utils import is_gated
from ....kernels import fp6
from ....kernels.core_ops import CUDABiasActivation, CUDAGatedActivation, CUDAWf6Af16Linear
from ...configs import DSLinearConfig
from ...interfaces import DSLinearBase, DSLinearRegistry
from .blas_fp_linear import activation_supported


def fp_quantize(input: torch.Tensor, num_bits: int = 6, exp_bits: int = 3, min_value: torch.Tensor = None,
                max_value: torch.Tensor = None, group_size: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(quantized, scales)``: ``input`` (fp16) divided by its per-row scale and rounded to FP6 (E3M2), as fp16
    values, and the scales (fp16, ``[rows, 1]``); ``quantized * scales`` is the dequantized weight. A row's scale
    is its largest magnitude over 28 (1 for an all-zero row), or ``max(|min_value|, max_value) / 28`` for a
    static range. Only FP6 E3M2 with one group per row, as DeepSpeed."""
    if (min_value is None) != (max_value is None):
        raise ValueError("fp_quantize: give both min_value and max_value (a static range) or neither")
    if input.dtype != torch.float16:
        raise ValueError(f"fp_quantize: expected a torch.float16 tensor, got {input.dtype}")
    if (num_bits, exp_bits) != (6, 3):
        raise NotImplementedError(f"fp_quantize: only FP6 with 3 exponent bits, got num_bits={num_bits}, "
                                  f"exp_bits={exp_bits}")
    if group_size != -1:
        raise NotImplementedError("fp_quantize: only group_size=-1 (one scale per row)")
    shape = input.shape
    rows = input.float().reshape(-1, shape[-1])
    if min_value is None:
        largest = rows.abs().amax(dim=-1, keepdim=True)
    else:
        largest = torch.max(min_value.abs(), max_value).float().expand(rows.shape[0], 1)
    scales = largest / fp6.MAX_VALUE
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    quantized = fp6.decode(fp6.encode(rows / scales))
    return quantized.reshape(shape).to(torch.float16), scales.to(torch.float16)


@DSLinearRegistry.register_module
class QuantizedWf6Af16Linear(DSLinearBase):
    """FP6 weight-only quantized linear with a gated or plain activation after it."""

    @staticmethod
    def name() -> str:
        return 'quantized_wf6af16_linear'

    @staticmethod
    def supports_config(config: DSLinearConfig) -> bool:
        if config.input_dtype != config.output_dtype or config.input_dtype != torch.float16:
            return False
        return activation_supported(config)

    def __init__(self, config: DSLinearConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)
        from ....allocator import current_device
        device = current_device()
        self._linear_impl = CUDAWf6Af16Linear()
        self.in_channels = config.in_channels
        self._is_gated = is_gated(config.activation)
        if self._is_gated:
            self.out_channels = config.out_channels * 2
            self._act_fn = CUDAGatedActivation(config.out_channels, config.output_dtype, config.activation)
            self._double_buffer = torch.empty((config.max_tokens, self.out_channels), dtype=config.output_dtype,
                                              device=device)
        else:
            self.out_channels = config.out_channels
            self._act_fn = CUDABiasActivation(config.out_channels, config.output_dtype, config.activation)
        self._output = torch.empty((config.max_tokens, config.out_channels), dtype=config.output_dtype, device=device)
        self.quantizer = fp_quantize

    def preprocess_weight(self, quantized: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2-bit and 4-bit slices of FP6 values (as ``fp_quantize`` returns them)."""
        return fp6.split_2_4(fp6.encode(quantized.float()))

    def transform_param(self, param: torch.Tensor) -> InferenceParameter:
        """A bias is kept as it is; a weight ``[out, in]`` (fp16) becomes its 2-bit slice, carrying the 4-bit slice
        (``weights_4bit``) and the per-channel ``scales``."""
        if param.ndim == 1:
            return InferenceParameter.initialize(param)
        quantized, scales = self.quantizer(param, num_bits=6, exp_bits=3)
        if quantized.shape[0] != self.out_channels or scales.numel() != self.out_channels:
            raise ValueError(f"quantized_wf6af16_linear: weight has {quantized.shape[0]} output channels, the "
                             f"config {self.out_channels}")
        weights_2bit, weights_4bit = self.preprocess_weight(quantized)
        return InferenceParameter.initialize(weights_2bit, weights_4bit=weights_4bit, scales=scales)

    def forward(self, hidden_states: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        output = empty_from(self._output, (tokens, self._config.out_channels))
        if self._is_gated:
            staging = empty_from(self._double_buffer, (tokens, self.out_channels))
            self._linear_impl(staging, hidden_states, w, w.weights_4bit, w.scales, self.out_channels, tokens,
                              self.in_channels)
            self._act_fn(output, staging, b)
        else:
            self._linear_impl(output, hidden_states, w, w.weights_4bit, w.scales, self.out_channels, tokens,
                              self.in_channels)
            self._act_fn(output, b)
        return output

    @property
    def output(self) -> torch.Tensor:
        return self._output
