"""DeepSpeed's gradient helpers of ``deepspeed.runtime.utils``, for client code that clips or checks gradients
itself (Megatron-style loops): ``clip_grad_norm_`` (the norm averaged over the data-parallel group, so ranks
whose expert gradients differ clip by the same factor), ``get_weight_norm``, ``CheckOverflow`` (an inf/NaN in
any rank's expert gradients is every rank's overflow) and ``count_used_parameters_in_backward``.

dsrun's engine does not call them: its strategies compute the norm and the overflow over their own shards
(:mod:`dsrun.zero.base`; the tensor-parallel norm is :mod:`dsrun.tensor_parallel.norm`). ``mpu`` is Megatron's
model-parallel unit, read as DeepSpeed reads it (``get_model_parallel_group``, ``get_model_parallel_rank``, and
``get_tensor_model_parallel_rank`` where it has one).
"""
from __future__ import annotations

import math
from typing import Iterable, Protocol, Sequence

import torch

from dsrun import comm
from dsrun.moe import groups
from dsrun.moe.utils import is_moe_param
from dsrun.tensor_parallel.layers import is_model_parallel_parameter

PIPE_REPLICATED = "ds_pipe_replicated"


class ModelParallelUnit(Protocol):
    """Megatron's ``mpu``, as far as these helpers read it."""

    def get_model_parallel_group(self) -> comm.ProcessGroup: ...

    def get_model_parallel_rank(self) -> int: ...

    def get_data_parallel_group(self) -> comm.ProcessGroup: ...


class EngineFlags(Protocol):
    """The engine's switch ``CheckOverflow`` reads: whether gradients are all-reduced in backward."""

    enable_backward_allreduce: bool


def _as_list(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _tensor_model_parallel_rank(mpu: ModelParallelUnit | None) -> int:
    if mpu is None:
        return 0
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return mpu.get_tensor_model_parallel_rank()
    return mpu.get_model_parallel_rank()


def _finite_or_minus_one(norm: float) -> float:
    return norm if math.isfinite(norm) else -1


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2,
                    mpu: ModelParallelUnit | None = None) -> torch.Tensor:
    """Scale the gradients in place so their total ``norm_type``-norm is at most ``max_norm``; returns the norm.

    With ``mpu``, a replicated (non model-parallel) parameter counts on model-parallel rank 0 only and the norm
    is summed (max for ``inf``) over the model-parallel group. The norm is then averaged over the data-parallel
    group, as DeepSpeed does for expert parameters, whose gradients are not all-reduced."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = torch.stack([p.grad.detach().abs().max().float() for p in params]).max()
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        norms = [p.grad.detach().float().norm(norm_type) for p in params
                 if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
        # DeepSpeed sums the squares whatever the norm type, then takes the norm_type-th root
        total = torch.stack(norms).square().sum() if norms else torch.zeros(())
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    data_group = groups._get_data_parallel_group()
    total = total.reshape(1) / float(comm.get_world_size(group=data_group))
    comm.all_reduce(total, group=data_group)
    total = total.to(params[0].device) if params else total
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(clip_coef.to(p.grad.dtype))
    return total


def get_weight_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2,
                    mpu: ModelParallelUnit | None = None) -> float:
    """The ``norm_type``-norm of the tensors themselves (DeepSpeed passes flattened gradients here), summed over
    the model-parallel group; ``-1`` where it is inf or NaN. A pipeline-replicated tensor, and a replicated one on
    a tensor-parallel rank other than 0, is not counted twice."""
    params = _as_list(parameters)
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = torch.tensor([float(max(p.detach().abs().max() for p in params))])
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mpu.get_model_parallel_group())
        return _finite_or_minus_one(total.item())
    tp_rank = _tensor_model_parallel_rank(mpu)
    total = torch.zeros(1)
    for p in params:
        if getattr(p, PIPE_REPLICATED, False):
            continue
        if tp_rank > 0 and not is_model_parallel_parameter(p):
            continue
        total += p.detach().float().norm(norm_type) ** norm_type
    if mpu is not None:
        comm.all_reduce(total, op=comm.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    return _finite_or_minus_one(total.item() ** (1.0 / norm_type))


class CheckOverflow:
    """Whether any gradient of ``param_groups`` (a list of lists of parameters) holds an inf or NaN, on any rank
    that shares the parameters: the flag is reduced (max) over the largest expert-parallel group when expert
    parameters are among them, over the world with ``zero_reduce_scatter``, and over the model-parallel group
    with ``mpu`` (also over the data-parallel group when ``deepspeed``, an engine, does not all-reduce in
    backward)."""

    def __init__(self, param_groups: Sequence[Sequence[torch.Tensor]] | None = None, mpu: ModelParallelUnit | None = None,
                 zero_reduce_scatter: bool = False, deepspeed: EngineFlags | None = None):
        self.mpu = mpu
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or [])

    def _reduce(self, flag: torch.Tensor, has_moe_params: bool, reduce_over_world: bool) -> bool:
        if has_moe_params:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=groups._get_max_expert_parallel_group())
        if reduce_over_world:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        if self.mpu is not None:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        return bool(flag.item())

    def check_using_norm(self, norm_group: Sequence[float], reduce_overflow: bool = True) -> bool:
        """Overflow from norms already computed (``-1`` marks an inf/NaN norm, as ``get_weight_norm`` returns)."""
        flag = torch.tensor([float(-1 in norm_group)])
        return self._reduce(flag, self.has_moe_params, reduce_overflow and self.mpu is None)

    def check(self, param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> bool:
        if param_groups is None:
            return self.has_overflow(self.params, self.has_moe_params)
        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        return any(p.grad is not None and self._has_inf_or_nan(p.grad.data) for p in params)

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: bool | None = None) -> bool:
        if has_moe_params is None:
            has_moe_params = self.has_moe_params
        flag = torch.tensor([float(self.has_overflow_serial(params))])
        engine_skips_allreduce = self.deepspeed is not None and not getattr(
            self.deepspeed, "pipeline_enable_backward_allreduce",
            getattr(self.deepspeed, "enable_backward_allreduce", True))
        if self.mpu is not None and engine_skips_allreduce:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.mpu.get_data_parallel_group())
        over_world = self.zero_reduce_scatter or (self.mpu is None and engine_skips_allreduce)
        return self._reduce(flag, has_moe_params, over_world)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor, i: int | None = None) -> bool:
        return not bool(torch.isfinite(x.float().sum()))


def count_used_parameters_in_backward(parameters: Sequence[torch.nn.Parameter]) -> int:
    """How many of ``parameters`` the running backward pass will reach: called from a backward hook, it asks
    autograd's engine whether each parameter's gradient node (its AccumulateGrad, or its grad_fn for a
    non-leaf) is going to execute. Parameters that do not require grad, or share a node, count once or not."""
    if not hasattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc") or not hasattr(torch._C, "_will_engine_execute_node"):
        raise RuntimeError("count_used_parameters_in_backward needs torch.autograd.graph._get_grad_fn_or_grad_acc "
                           "and torch._C._will_engine_execute_node, which this torch does not have")
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward (from a hook)")
    nodes = set()
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        # hooks run with grad mode off, and the AccumulateGrad lookup of a leaf needs it on
        with torch.enable_grad():
            node = torch.autograd.graph._get_grad_fn_or_grad_acc(param)
        if node is not None:
            nodes.add(node)
    return sum(bool(torch._C._will_engine_execute_node(node)) for node in nodes)
