"""``deepspeed.inference.v2.modules.implementations.linear``: the fp16/bf16 linear (``blas_fp_linear``) and the
FP6 weight-only quantized linear (``quantized_wf6af16_linear``)."""
from .blas_fp_linear import BlasFPLinear
from .quantized_linear import QuantizedWf6Af16Linear

__all__ = ["BlasFPLinear", "QuantizedWf6Af16Linear"]
