"""DeepSpeed's v1 inference MLP (``deepspeed.ops.transformer.inference.ds_mlp``) in torch.

:class:`DeepSpeedMLP` holds the post-attention norm (``attn_nw``/``attn_nb``), the input-major intermediate and
output weights (``inter_w`` ``[hidden, intermediate / mp]``, twice as wide for a gated activation with the value
half first, ``output_w`` ``[intermediate / mp, hidden]``) and their biases. Its forward is DeepSpeed's
``mlp_gemm`` (residual add of the attention output, norm, intermediate GEMM, activation, output GEMM) followed
by the block's residual add (``ResidualAddOp``), summed over the model-parallel group. Without ``attn_nw``
(GPT-J: attention and MLP side by side) the MLP reads the attention's normed input instead (DeepSpeed's
``fused_gemm_gelu``). Served as DeepSpeed's ``ops.transformer.inference.ds_mlp``.
"""
from __future__ import annotations

import math
import torch
from torch import nn
from torch.distributed import ProcessGroup

from dsrun import comm as dist
from dsrun.accelerator import get_accelerator
from dsrun.ops.transformer.inference import kernels
from dsrun.ops.transformer.inference.config import DeepSpeedInferenceConfig
from dsrun.ops.transformer.inference.op_binding import ResidualAddOp
from dsrun.utils.types import GATED_ACTIVATION_TYPES, ActivationFuncType, NormType


def activate(values: torch.Tensor, bias: torch.Tensor | None, kind: ActivationFuncType) -> torch.Tensor:
    """``act(values + bias)`` with DeepSpeed's kernels: GELU is the tanh approximation, gated kinds take
    ``[value | gate]``."""
    bias = torch.zeros(values.shape[-1], dtype=values.dtype, device=values.device) if bias is None else bias
    if kind in GATED_ACTIVATION_TYPES:
        return kernels.gated_activation(values, bias, kind)
    if kind == ActivationFuncType.ReLU:
        return kernels.bias_relu(values, bias)
    if kind == ActivationFuncType.GELU:
        return kernels.bias_gelu(values, bias)
    raise ValueError(f"DeepSpeedMLP: mlp_act_func_type {kind!r} has no kernel; expected GELU, ReLU, GATED_GELU or "
                     "GATED_SILU")


class DeepSpeedMLP(nn.Module):
    """A v1 inference layer's MLP (DeepSpeed's arguments; the quantization ones are kept as attributes)."""

    def __init__(self, config: DeepSpeedInferenceConfig, mp_group: ProcessGroup | None = None,
                 q_scales: torch.Tensor | None = None, q_groups: int = 1, merge_count: int = 1,
                 mlp_extra_grouping: bool = False):
        super().__init__()
        self.config = config
        dtype = config.dtype
        dtype_fp = torch.half if dtype == torch.int8 else dtype
        device = get_accelerator().current_device_name()
        proj_factor = 2 if config.mlp_act_func_type in GATED_ACTIVATION_TYPES else 1
        if config.intermediate_size <= 0:
            config.intermediate_size = 4 * config.hidden_size
        self.intm_w_sz_per_partition = config.intermediate_size * proj_factor // config.mp_size
        self.intm_o_sz_per_partition = config.intermediate_size // config.mp_size
        if config.set_empty_params:
            self.attn_nw = self.attn_nb = self.inter_w = self.inter_b = self.output_w = self.output_b = None
        else:
            def empty(*shape: int, dt: torch.dtype = dtype_fp) -> nn.Parameter:
                return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

            self.attn_nw, self.attn_nb = empty(config.hidden_size), empty(config.hidden_size)
            self.inter_w = empty(config.hidden_size, self.intm_w_sz_per_partition, dt=dtype)
            self.inter_b = empty(self.intm_w_sz_per_partition)
            self.output_w = empty(self.intm_o_sz_per_partition, config.hidden_size, dt=dtype)
            self.output_b = empty(config.hidden_size)
        self.q_scales = q_scales
        self.q_groups = q_groups * 2 if mlp_extra_grouping else q_groups
        self.merge_count = int(math.log2(merge_count))
        self.mp_group = mp_group
        self.residual_add_func = ResidualAddOp(config)

    def _norm(self, values: torch.Tensor) -> torch.Tensor:
        if self.config.norm_type == NormType.RMSNorm:
            return kernels.rms_norm(values, self.attn_nw, self.config.epsilon)
        return kernels.layer_norm(values, self.attn_nw, self.attn_nb, self.config.epsilon)

    def _gemms(self, normed: torch.Tensor) -> torch.Tensor:
        inter = torch.matmul(normed.to(self.inter_w.dtype), self.inter_w)
        return torch.matmul(activate(inter, self.inter_b, self.config.mlp_act_func_type), self.output_w)

    def forward(self, input: torch.Tensor, residual: torch.Tensor, residual_norm: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """The block's output: ``input`` is the attention output (without ``bias``, its projection bias),
        ``residual`` the block's input, ``residual_norm`` the attention's normed input."""
        residual_add = None
        if self.attn_nw is None:
            output = self._gemms(residual_norm)
        else:
            summed = input.to(torch.float32) + residual.to(torch.float32)
            if bias is not None:
                summed = summed + bias.to(torch.float32)
            residual_add = self._norm(summed.to(input.dtype))
            output = self._gemms(residual_add)
        residual = residual.clone()  # the residual add writes in place; the caller's hidden states stay intact
        residual = self.residual_add_func(hidden_state=output, residual=residual, add_bias=bias is not None,
                                          attention_output=input,
                                          attention_bias=bias if bias is not None else self.output_b,
                                          final_bias=self.output_b, residual_add=residual_add)
        if self.mp_group is not None and dist.get_world_size(group=self.mp_group) > 1:
            dist.all_reduce(residual, group=self.mp_group)
        return residual


__all__ = ["DeepSpeedMLP", "activate"]
