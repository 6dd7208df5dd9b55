"""``deepspeed.ops.fp_quantizer``: DeepSpeed's group-wise FP8/FP12/FP6/FP4 quantizer in torch (:mod:`.quantize`,
which also serves DeepSpeed's ``fp8_gemm`` module)."""
from dsrun.ops.fp_quantizer.quantize import FP_Quantize, Quantizer, matmul_fp8

__all__ = ["FP_Quantize", "Quantizer", "matmul_fp8"]
