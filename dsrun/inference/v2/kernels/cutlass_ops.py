"""``deepspeed.inference.v2.kernels.cutlass_ops``: the grouped GEMM of the MoE layer (``MoEGEMM``, CUTLASS in
DeepSpeed) as torch: expert ``e`` multiplies the rows ``total_rows_before_expert[e - 1] ..
total_rows_before_expert[e]`` of the ordered input by its weight [in, out], adds its bias and applies the
activation, in float32. DeepSpeed's weight-only quantized GEMMs (``MixedGEMM``, ``MixedMoEGEMM``: int4/int8
weights in CUTLASS's interleaved layout) are refused when built."""
from __future__ import annotations

from typing import Optional

import torch

from ..inference_utils import ActivationType, DtypeEnum
from . import DSKernelBase, cuda_kernel
from .core_ops import ACTIVATIONS


class MoEGEMM(DSKernelBase):
    supported_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16]
    supported_act_fns = [ActivationType.GELU, ActivationType.SILU, ActivationType.RELU, ActivationType.IDENTITY]

    def __init__(self, fp_dtype: DtypeEnum, act_fn: ActivationType) -> None:
        fp_dtype = DtypeEnum(fp_dtype)
        if fp_dtype not in MoEGEMM.supported_dtypes:
            raise ValueError(f"Unsupported data type: {fp_dtype}, supported_dtypes are {MoEGEMM.supported_dtypes}")
        if act_fn not in MoEGEMM.supported_act_fns:
            raise ValueError(f"Unsupported activation function: {act_fn}, supported_act_fns are "
                             f"{MoEGEMM.supported_act_fns}")
        self.act_fn = ActivationType(act_fn)

    def __call__(self, ordered_output: torch.Tensor, ordered_input: torch.Tensor, weights: torch.Tensor,
                 total_rows_before_expert: torch.Tensor, biases: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ordered_output`` [rows, out] from ``ordered_input`` [rows, in], ``weights`` [experts, in, out],
        ``total_rows_before_expert`` [experts] (the inclusive cumsum of the rows per expert), ``biases``
        [experts, out]."""
        ends = total_rows_before_expert.cpu().tolist()
        start = 0
        for expert, end in enumerate(ends):
            if end > start:
                rows = ordered_input[start:end].float() @ weights[expert].float()
                if biases is not None:
                    rows = rows + biases[expert].float()
                ordered_output[start:end] = ACTIVATIONS[self.act_fn](rows).to(ordered_output.dtype)
            start = end
        return ordered_output


MixedGEMM = cuda_kernel("inference.v2.kernels.cutlass_ops.MixedGEMM",
                        "a CUTLASS GEMM on int4/int8 weight-only quantized weights in CUTLASS's layout")
MixedMoEGEMM = cuda_kernel("inference.v2.kernels.cutlass_ops.MixedMoEGEMM",
                           "a CUTLASS MoE GEMM on int4/int8 weight-only quantized weights in CUTLASS's layout")

__all__ = ["MixedGEMM", "MixedMoEGEMM", "MoEGEMM"]
