"""``deepspeed.inference.v2.modules.implementations.linear``: the FP6 quantized linear (DeepSpeed's cuBLAS
``BlasFPLinear`` is a CUDA kernel and not provided)."""
from .quantized_linear import QuantizedWf6Af16Linear

__all__ = ["QuantizedWf6Af16Linear"]
