"""Domino's two tensor-parallel linear layers (DeepSpeed's ``runtime.domino.async_linear``).

``DominoAsyncColumnParallelLinear`` holds this rank's rows of ``W`` (``output_size`` of them). Forward is a
plain ``x @ W_r.T``; its input gradient is a partial sum over the ranks, so backward starts the all-reduce of it
asynchronously, records the pending reduction in the caller's ``handle_dic[h_id]`` and computes the weight
gradient while it travels. The gradient must not be read before :func:`wait_for_input_grad` (the
``_Wait_bwd_comm`` node the transformer puts on the layer's input) has waited for it.

``RowParallelLinearNoComm`` holds this rank's columns of ``W``: its output is this rank's partial sum, which the
caller all-reduces (asynchronously, to overlap it with the other half batch).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from dsrun import comm


class Waitable(Protocol):
    def wait(self) -> object: ...


class MegatronConfig(Protocol):
    """What Domino reads of Megatron's transformer config (any object with these attributes)."""

    hidden_size: int
    num_attention_heads: int
    kv_channels: int
    ffn_hidden_size: int
    num_layers: int
    layernorm_epsilon: float
    hidden_dropout: float
    attention_dropout: float
    add_bias_linear: bool
    apply_residual_connection_post_layernorm: bool
    params_dtype: torch.dtype
    init_method: Callable
    output_layer_init_method: Callable


class PendingReduce:
    """An input gradient being all-reduced: ``wait()`` (DeepSpeed stores the bare work handle; this keeps the
    tensor too, so the waiting node hands on the reduced tensor itself)."""

    def __init__(self, work: Waitable | None, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor


class DominoAsyncColumnParallelLinearImpl(torch.autograd.Function):
    """``x @ W_r.T (+ b_r)``; backward all-reduces the input gradient asynchronously (see the module)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, handle_dic, h_id, group=None):
        ctx.save_for_backward(inp, weight)
        ctx.has_bias, ctx.handle_dic, ctx.h_id, ctx.group = bias is not None, handle_dic, h_id, group
        out = torch.matmul(inp, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        grad_input = torch.matmul(grad_output, weight)
        work = comm.all_reduce(grad_input, group=ctx.group, async_op=True)
        ctx.handle_dic[ctx.h_id] = PendingReduce(work, grad_input)
        # computed while the input gradient travels
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = flat_grad.t().matmul(inp.reshape(-1, inp.shape[-1]))
        grad_bias = flat_grad.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


def _local_parameter(shape: tuple[int, ...], config: MegatronConfig, init: Callable | None) -> Parameter:
    from dsrun.accelerator import get_accelerator

    param = Parameter(torch.empty(*shape, device=get_accelerator().current_device_name(),
                                  dtype=getattr(config, "params_dtype", torch.float32)))
    if getattr(config, "perform_initialization", True):
        with torch.no_grad():
            init(param) if init is not None else param.zero_()
    return param


class DominoAsyncColumnParallelLinear(torch.nn.Module):
    """This rank's ``output_size`` rows of a column-parallel linear over ``_tp_group``; ``forward(x, handle_dic,
    h_id)`` returns ``(output, bias or None)`` (the bias when ``skip_bias_add``, for the caller to add)."""

    def __init__(self, input_size: int, output_size: int, _tp_group: torch.distributed.ProcessGroup | None, config: MegatronConfig, init_method: Callable,
                 bias: bool = True, skip_bias_add: bool = False):
        super().__init__()
        self.tp_group, self.skip_bias_add = _tp_group, skip_bias_add
        self.weight = _local_parameter((output_size, input_size), config, init_method)
        if bias:
            self.bias = _local_parameter((output_size,), config, None)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, handle_dic: dict, h_id: str):
        bias = None if self.skip_bias_add else self.bias
        out = DominoAsyncColumnParallelLinearImpl.apply(input_, self.weight, bias, handle_dic, h_id, self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinearNoComm(torch.nn.Module):
    """This rank's ``input_size`` columns of a row-parallel linear, without its all-reduce (the caller starts
    it); ``forward(x)`` returns ``(partial output, bias or None)``."""

    def __init__(self, input_size: int, output_size: int, config: MegatronConfig, init_method: Callable, bias: bool = True,
                 stride: int = 1, skip_bias_add: bool = False):
        super().__init__()
        self.skip_bias_add = skip_bias_add
        self.weight = _local_parameter((output_size, input_size), config, init_method)
        if bias:
            self.bias = _local_parameter((output_size,), config, None)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        out = F.linear(input_, self.weight, None if self.skip_bias_add else self.bias)
        return out, (self.bias if self.skip_bias_add else None)
