"""``deepspeed.inference.v2.kernels.core_ops``: DeepSpeed's core inference kernels (CUDA there) as torch on any
device: the gated and the bias activation, the FP6 weight-only linear, the cuBLAS linear, the layer norms (plain,
post- and pre-norm with the residual add) and the RMS norms, each validating its configuration as DeepSpeed's
kernel does and computing in float32."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ..inference_utils import ActivationType, DtypeEnum, elem_size
from . import DSKernelBase, fp6

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


class BlasLibLinear(DSKernelBase):
    """``output = hidden_states @ weights.T`` (DeepSpeed's cuBLAS GEMM), leading dimensions of ``hidden_states``
    folded, computed in float32."""
    supported_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16, DtypeEnum.fp32]

    def __init__(self, fp_dtype: DtypeEnum) -> None:
        fp_dtype = DtypeEnum(fp_dtype)
        if fp_dtype not in BlasLibLinear.supported_dtypes:
            raise ValueError(f"Unsupported data type: {fp_dtype}, supported_dtypes are {self.supported_dtypes}")

    def __call__(self, output: torch.Tensor, hidden_states: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1]).float() @ weights.float().t()
        output.copy_(rows.view(output.shape))
        return output


class _NormKernel(DSKernelBase):
    """The validation DeepSpeed's layer and RMS norm kernels share: one dtype for inputs, outputs and gamma
    (fp16, bf16, fp32), rows aligned to 16 bytes."""
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]

    def __init__(self, channels: int, fp_dtype: torch.dtype, epsilon: float = 1e-5) -> None:
        if fp_dtype not in self.supported_dtypes:
            raise ValueError(f"Unsupported data type: {fp_dtype}, supported_dtypes are {self.supported_dtypes}")
        if elem_size(fp_dtype) * channels % 16 != 0:
            raise ValueError("channels must be divisible by 16 bytes")
        self.epsilon = epsilon

    def _layer_norm(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), gamma.float(), beta.float(), self.epsilon)

    def _rms_norm(self, x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon) * gamma.float()


class CUDAFPLN(_NormKernel):
    """``z = layer_norm(x) * gamma + beta``, statistics in float32."""

    def __call__(self, output_z: torch.Tensor, input_x: torch.Tensor, gamma: torch.Tensor,
                 beta: torch.Tensor) -> torch.Tensor:
        output_z.copy_(self._layer_norm(input_x.float(), gamma, beta))
        return output_z


class CUDAFPPostLN(_NormKernel):
    """``z = layer_norm(x + y)``, the sum in float32 (``z`` may alias ``x`` or ``y``)."""

    def __call__(self, output_z: torch.Tensor, input_x: torch.Tensor, input_y: torch.Tensor, gamma: torch.Tensor,
                 beta: torch.Tensor) -> torch.Tensor:
        output_z.copy_(self._layer_norm(input_x.float() + input_y.float(), gamma, beta))
        return output_z


class CUDAFPPreLN(_NormKernel):
    """``z_res = x_res + y_hid``; ``z_hid = layer_norm(z_res)``, normalized from the float32 sum."""

    def __call__(self, z_res: torch.Tensor, z_hid: torch.Tensor, x_res: torch.Tensor, y_hid: torch.Tensor,
                 gamma: torch.Tensor, beta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        total = x_res.float() + y_hid.float()
        z_hid.copy_(self._layer_norm(total, gamma, beta))
        z_res.copy_(total)
        return z_res, z_hid


class CUDARMSNorm(_NormKernel):
    """``z = x / sqrt(mean(x**2) + eps) * gamma``."""

    def __call__(self, output_z: torch.Tensor, input_x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        output_z.copy_(self._rms_norm(input_x.float(), gamma))
        return output_z


class CUDARMSPreNorm(_NormKernel):
    """``z_res = x_res + y_hid``; ``z_hid = rms_norm(z_res)``, normalized from the sum as stored in the residual's
    dtype (as DeepSpeed's tests' reference computes it)."""

    def __call__(self, z_res: torch.Tensor, z_hid: torch.Tensor, x_res: torch.Tensor, y_hid: torch.Tensor,
                 gamma: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        z_res.copy_(x_res.float() + y_hid.float())
        z_hid.copy_(self._rms_norm(z_res.float(), gamma))
        return z_res, z_hid


__all__ = ["BlasLibLinear", "CUDABiasActivation", "CUDAFPLN", "CUDAFPPostLN", "CUDAFPPreLN", "CUDAGatedActivation",
           "CUDARMSNorm", "CUDARMSPreNorm", "CUDAWf6Af16Linear"]
