"""``deepspeed.inference.v2.kernels.core_ops``: the core kernels with a torch path on any device (the gated and the
bias activation, the FP6 weight-only linear), each validating its configuration as DeepSpeed's CUDA kernel does;
DeepSpeed's other core kernels (layer and RMS norms, the cuBLAS linear) are refused when built."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..inference_utils import ActivationType, DtypeEnum, elem_size
from . import DSKernelBase, cuda_kernel, fp6

ACTIVATIONS: dict[ActivationType, Callable[[torch.Tensor], torch.Tensor]] = {
    ActivationType.GELU: F.gelu,
    ActivationType.RELU: F.relu,
    ActivationType.SILU: F.silu,
    ActivationType.IDENTITY: lambda x: x,
    # the gated ones: the function applied to the gate channels (GEGLU's GELU is the tanh approximation)
    ActivationType.GEGLU: lambda x: F.gelu(x, approximate="tanh"),
    ActivationType.ReGLU: F.relu,
    ActivationType.SiGLU: F.silu,
}


class CUDAGatedActivation(DSKernelBase):
    """``output = act(input[..., ::2] + bias[::2]) * (input[..., 1::2] + bias[1::2])``, computed in float32:
    gate and value channels are interleaved in the input, the output has half its channels."""
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_act_fns = [ActivationType.GEGLU, ActivationType.ReGLU, ActivationType.SiGLU]

    def __init__(self, channels: int, fp_dtype: torch.dtype, act_fn: ActivationType) -> None:
        if fp_dtype not in self.supported_dtypes:
            raise ValueError(f"Unsupported data type: {fp_dtype}, supported_dtypes are {self.supported_dtypes}")
        act_fn = ActivationType(act_fn)
        if act_fn not in self.supported_act_fns:
            raise ValueError(f"Unsupported activation function: {act_fn}, supported_act_fns are "
                             f"{self.supported_act_fns}")
        if elem_size(fp_dtype) * channels % 8 != 0:
            raise ValueError("Channels must be divisible by 16 bytes")
        if elem_size(fp_dtype) * channels > 98304:  # DeepSpeed's kernel holds one row in shared memory
            raise ValueError("Kernel only compiled to support 98304 bytes per row, please file an issue if your "
                             "model requires more.")
        self.act_fn = act_fn

    def __call__(self, output: torch.Tensor, input: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        values = input.float()
        if bias is not None:
            values = values + bias.float()
        output.copy_(ACTIVATIONS[self.act_fn](values[..., ::2]) * values[..., 1::2])


class CUDABiasActivation(DSKernelBase):
    """``activation = act(activation + bias)``, in place, computed in float32."""
    supported_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16]
    supported_act_fns = [ActivationType.IDENTITY, ActivationType.GELU, ActivationType.RELU, ActivationType.SILU]

    def __init__(self, channels: int, dtype: DtypeEnum, act_fn: ActivationType) -> None:
        if channels % 8 != 0:
            raise ValueError("channels must be divisible by 8")
        if DtypeEnum(dtype) not in self.supported_dtypes:
            raise ValueError(f"Unsupported data type: {dtype}, supported_dtypes are {self.supported_dtypes}")
        act_fn = ActivationType(act_fn)
        if act_fn not in self.supported_act_fns:
            raise ValueError(f"Unsupported activation function: {act_fn}, supported_act_fns are "
                             f"{self.supported_act_fns}")
        self.act_fn = act_fn

    def __call__(self, activation: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        values = activation.float()
        if bias is not None:
            values = values + bias.float()
        return activation.copy_(ACTIVATIONS[self.act_fn](values))


class CUDAWf6Af16Linear(DSKernelBase):
    """The FP6 weight-only linear: ``output = hidden_states @ (fp6(weight) * scale).T``, the weight held as the
    2-bit and 4-bit slices of its codes (:func:`.fp6.split_2_4`) and one scale per output channel. Here the
    weight is dequantized in float32 and multiplied with torch; the shape limits are the CUDA kernel's."""

    def __init__(self) -> None:
        pass

    def __call__(self, output: torch.Tensor, hidden_states: torch.Tensor, weights_2bit: torch.Tensor,
                 weights_4bit: torch.Tensor, scale: torch.Tensor, out_channels: int, tokens: int,
                 in_channels: int) -> torch.Tensor:
        if out_channels % 256 != 0 or in_channels % 64 != 0:
            raise ValueError("The out and in channel should be multiple of 256 and 64 respectively.")
        weight = fp6.decode(fp6.join_2_4(weights_2bit, weights_4bit)) * scale.float().view(-1, 1)
        output.copy_(hidden_states[:tokens].float() @ weight.t())
        return output


BlasLibLinear = cuda_kernel("inference.v2.kernels.core_ops.BlasLibLinear")
CUDAFPLN = cuda_kernel("inference.v2.kernels.core_ops.CUDAFPLN")
CUDAFPPostLN = cuda_kernel("inference.v2.kernels.core_ops.CUDAFPPostLN")
CUDAFPPreLN = cuda_kernel("inference.v2.kernels.core_ops.CUDAFPPreLN")
CUDARMSNorm = cuda_kernel("inference.v2.kernels.core_ops.CUDARMSNorm")
CUDARMSPreNorm = cuda_kernel("inference.v2.kernels.core_ops.CUDARMSPreNorm")

__all__ = ["BlasLibLinear", "CUDABiasActivation", "CUDAFPLN", "CUDAFPPostLN", "CUDAFPPreLN", "CUDAGatedActivation",
           "CUDARMSNorm", "CUDARMSPreNorm", "CUDAWf6Af16Linear"]
