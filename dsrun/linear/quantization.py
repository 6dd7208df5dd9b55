"""``deepspeed.linear.quantization``: ``QuantizedParameter`` and ``QuantizedLinear``, a frozen weight kept
quantized on the accelerator and dequantized for each use.

DeepSpeed quantizes with its FP quantizer (``FP_Quantize``), a CUDA kernel (``FPQuantizerBuilder``) that dsrun
does not build, and that DeepSpeed itself cannot build on a CPU: a ``QuantizedParameter`` then needs the
``quantizer=`` argument, an object with DeepSpeed's ``Quantizer`` methods (``quantize(tensor, q_bits=,
q_mantisa_bits=)``, ``dequantize(tensor, q_bits=, q_mantisa_bits=)``, ``to(...)``). With one, the weight is
quantized whenever it is on the accelerator in another dtype than ``q_dtype`` (at construction, and after
``.to(device)``), as DeepSpeed does.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.accelerator import get_accelerator

from .config import QuantizationConfig


class Quantizer(Protocol):
    """DeepSpeed's ``deepspeed.ops.fp_quantizer.Quantizer`` methods a ``QuantizedParameter`` calls."""

    def quantize(self, tensor: torch.Tensor, q_bits: int, q_mantisa_bits: int) -> torch.Tensor: ...

    def dequantize(self, tensor: torch.Tensor, q_bits: int, q_mantisa_bits: int) -> torch.Tensor: ...

    def to(self, *args: object, **kwargs: object) -> object: ...


class QuantizedParameter(nn.Parameter):
    """A frozen parameter stored quantized; ``dequantized()`` gives the weight to compute with."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = False,
                quantization_config: QuantizationConfig | None = None,
                quantizer: Quantizer | None = None) -> "QuantizedParameter":
        if requires_grad:
            raise ValueError("requires_grad=True is not supported with QuantizedParameter (its weight is frozen)")
        if quantizer is None:
            raise ValueError("QuantizedParameter: DeepSpeed's FP quantizer (FP_Quantize) is a CUDA kernel "
                             "(FPQuantizerBuilder) that dsrun does not build; pass quantizer=<an object with "
                             "quantize/dequantize/to>")
        self = torch.Tensor._make_subclass(cls, torch.empty(0) if data is None else data, False)
        self.quantization_config = QuantizationConfig() if quantization_config is None else quantization_config
        self.quantizer = quantizer
        self._ensure_quantized(self)
        return self

    def _ensure_quantized(self, tensor: torch.Tensor) -> None:
        config = self.quantization_config
        if get_accelerator().on_accelerator(tensor) and tensor.dtype != config.q_dtype:
            tensor.data = self.quantizer.quantize(tensor.data, q_bits=config.q_bits,
                                                  q_mantisa_bits=config.mantissa_bits)
            if tensor.dtype != config.q_dtype:
                raise TypeError(f"QuantizedParameter: the quantizer returned {tensor.dtype}, expected the "
                                f"config's q_dtype {config.q_dtype}")

    def dequantized(self) -> torch.Tensor:
        config = self.quantization_config
        if get_accelerator().on_accelerator(self.data) and self.data.dtype == config.q_dtype:
            return self.quantizer.dequantize(self.data, q_bits=config.q_bits, q_mantisa_bits=config.mantissa_bits)
        return self.data

    def to(self, *args: object, **kwargs: object) -> torch.Tensor:
        """Move, then quantize where it landed on the accelerator (the quantizer moves along)."""
        tensor = super().to(*args, **kwargs)
        self.quantizer.to(*args, **kwargs)
        self._ensure_quantized(tensor)
        return tensor


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` whose weight is a :class:`QuantizedParameter` (bfloat16 only, as in DeepSpeed), dequantized
    in each forward."""

    def __init__(self, input_dim: int, output_dim: int, bias: bool = False,
                 quantization_config: QuantizationConfig | None = None, dtype: torch.dtype = torch.bfloat16,
                 quantizer: Quantizer | None = None):
        if dtype != torch.bfloat16:
            raise ValueError(f"QuantizedLinear supports dtype=torch.bfloat16 only, got {dtype}")
        super().__init__(input_dim, output_dim, bias=bias, dtype=dtype)
        self.weight = QuantizedParameter(self.weight.data, quantization_config=quantization_config,
                                         quantizer=quantizer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantized(), self.bias)
