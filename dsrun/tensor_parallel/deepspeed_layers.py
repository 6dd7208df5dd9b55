"""DeepSpeed's AutoTP layer classes (``deepspeed.module_inject.layers``) on dsrun's column-/row-parallel layers.

``LinearLayer(module, mp_group)`` keeps this rank's rows of an ``nn.Linear`` (its output features, and its bias),
``LinearAllreduce(module, mp_group)`` its columns (input features; the bias stays whole and is added once after the
all-reduce), each with DeepSpeed's shard sizes (:func:`dsrun.tensor_parallel.shard_sizes.get_shard_size_list`,
so an uneven dimension splits as DeepSpeed splits it). The forward and backward are dsrun's
(:mod:`dsrun.tensor_parallel.layers`); ``gather_output=True`` all-gathers a column-parallel output over the group
(backward: this rank's slice of the gradient). Like DeepSpeed's, the layers keep the module's own ``Parameter``
objects, mark them (``tensor_model_parallel``; ``is_model_parallel_parameter`` is true of them) and hang
``gather_params`` / ``_tp_partition`` on them. ``set_autotp_mode(training=...)`` / ``is_autotp_training_mode()``
is DeepSpeed's process-wide switch, which ``initialize`` turns on for a run that asks for AutoTP.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dsrun import comm
from dsrun.checkpoint.autotp_meta import mark_replicated, mark_split

from .layers import ColumnParallelLinear, RowParallelLinear
from .shard_sizes import get_shard_size_list

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_TRAINING_MODE = False


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed's switch between AutoTP for inference (False) and for training (True)."""
    global _TRAINING_MODE
    _TRAINING_MODE = bool(training)


def is_autotp_training_mode() -> bool:
    return _TRAINING_MODE


def _group_rank_size(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None or not comm.is_initialized():
        return 0, 1
    return comm.get_rank(group=group), comm.get_world_size(group=group)


def _gather_uneven(local: torch.Tensor, sizes: list[int], dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """The whole tensor from every rank's slice along ``dim`` (slice ``r`` has ``sizes[r]`` entries)."""
    widest = max(sizes)
    moved = local.movedim(dim, 0).contiguous()
    padded = torch.zeros(widest, *moved.shape[1:], dtype=moved.dtype, device=moved.device)
    padded[:moved.shape[0]] = moved
    pieces = [torch.empty_like(padded) for _ in sizes]
    comm.all_gather(pieces, padded, group=group)
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)]).movedim(0, dim).contiguous()


def _slice(tensor: torch.Tensor, sizes: list[int], rank: int, dim: int) -> torch.Tensor:
    return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


class _GatherOutput(torch.autograd.Function):
    """Forward: the output slices of the group put together along the last dimension. Backward: this rank's
    slice of the gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, sizes: list[int], rank: int, group: ProcessGroup | None) -> torch.Tensor:
        ctx.sizes, ctx.rank = sizes, rank
        return _gather_uneven(x, sizes, x.dim() - 1, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _slice(grad, ctx.sizes, ctx.rank, grad.dim() - 1), None, None, None


def gather_output_slices(y: torch.Tensor, sizes: list[int], rank: int, group: ProcessGroup | None) -> torch.Tensor:
    """The group's output slices (rank ``r``'s has ``sizes[r]`` features) put together along the last dimension;
    the backward keeps this rank's slice of the gradient."""
    return _GatherOutput.apply(y, sizes, rank, group)


def _shape_before_zero3_partition(param: torch.Tensor) -> tuple[int, ...]:
    """``param``'s shape before ZeRO-3 emptied its data (its ``ds_shape``), else its shape."""
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def _subparam_shard_widths(subparam_sizes: list[int] | tuple[int, ...], tp_world_size: int,
                           name: str | None = None) -> list[list[int]]:
    """Each fused sub-parameter's per-rank widths, each cut by DeepSpeed's shard sizes (so a fused attention
    weight is cut on head boundaries; with more ranks than heads some ranks hold none of a part)."""
    return [list(get_shard_size_list(size, tp_world_size, name)) for size in subparam_sizes]


class _DeepSpeedShards:
    """What DeepSpeed's two layer classes share: the cut by shard sizes, the marks, gather and re-partition, and
    the universal-checkpoint metadata of each parameter (``_mark_uc_metadata``)."""

    name: str | None
    shard_sizes: list[int]
    tp_rank: int
    tp_world_size: int
    group: ProcessGroup | None
    _orig_weight_shape: tuple[int, ...]
    _partition_sizes: tuple[int, ...]

    @property
    def tp_index(self) -> int:  # DeepSpeed's name for this rank's place in the group
        return self.tp_rank

    @tp_index.setter
    def tp_index(self, value: int) -> None:
        self.tp_rank = value

    def _freeze_partition_sizes(self, total_size: int) -> tuple[int, ...]:
        """This layer's cut of ``total_size`` over its ``tp_world_size`` ranks (DeepSpeed's shard sizes), resolved
        once: later changes of the process-wide shard settings do not move it."""
        self._partition_sizes = tuple(get_shard_size_list(total_size, self.tp_world_size, self.name))
        self.shard_sizes = list(self._partition_sizes)
        return self._partition_sizes

    def _cut(self, param: nn.Parameter, dim: int) -> None:
        if self.tp_world_size > 1:  # one rank (or DeepSpeed's metadata-only build without a group) keeps it whole
            with torch.no_grad():
                param.data = _slice(param.data, self.shard_sizes, self.tp_rank, dim)
        param.tensor_model_parallel = True
        param.partition_dim, param.partition_stride = dim, 1

    def _mark_split(self, param: nn.Parameter | None, dim: int, row: bool, is_bias: bool = False) -> None:
        if param is None:
            return
        whole = list(_shape_before_zero3_partition(param))
        if self.tp_world_size > 1 and param.numel():
            whole[dim] = sum(self._partition_sizes)
        mark_split(param, row=row, dim=dim, whole_shape=tuple(whole), widths=[list(self._partition_sizes)],
                   is_bias=is_bias)

    def gather_params(self, params_list: list[nn.Parameter]) -> None:
        """Put each split parameter of ``params_list`` back whole (collective over the group)."""
        for param in params_list:
            if not getattr(param, "tensor_model_parallel", False) or getattr(param, "_tp_gathered", False):
                continue
            with torch.no_grad():
                param.data = _gather_uneven(param.data, self.shard_sizes, param.partition_dim, self.group)
            param._tp_gathered = True

    def _tp_partition(self, params_list: list[nn.Parameter]) -> None:
        """Cut each gathered parameter of ``params_list`` back to this rank's shard."""
        for param in params_list:
            if not getattr(param, "_tp_gathered", False):
                continue
            with torch.no_grad():
                param.data = _slice(param.data, self.shard_sizes, self.tp_rank, param.partition_dim)
            param._tp_gathered = False


def _placement(mp_group: ProcessGroup | None, total: int, kwargs: dict[str, Any]) -> tuple[int, int, list[int]]:
    """This rank's place in the group and every rank's shard of a dimension of ``total``: DeepSpeed's (the group's
    rank and size, its shard sizes), or dsrun's split by rules' (``tp_rank``, ``tp_size``, ``shard_sizes``: it cuts
    without a live group, and by the bounds its checkpoints re-cut by)."""
    rank, size = _group_rank_size(mp_group)
    rank, size = int(kwargs.get("tp_rank", rank)), int(kwargs.get("tp_size", size))
    sizes = kwargs.get("shard_sizes") or get_shard_size_list(total, size, kwargs.get("name"))
    return rank, size, list(sizes)


class LinearLayer(_DeepSpeedShards, ColumnParallelLinear):
    """DeepSpeed's column-parallel ``LinearLayer(module, mp_group, skip_partition=False, gather_output=False)``:
    this rank's output features of ``module`` (an ``nn.Linear``); ``skip_partition`` keeps it whole."""

    def __init__(self, module: nn.Linear, mp_group: ProcessGroup | None, skip_partition: bool = False,
                 gather_output: bool = False, **kwargs: Any):
        self._orig_weight_shape = _shape_before_zero3_partition(module.weight)
        out_features = self._orig_weight_shape[0]
        rank, size, sizes = _placement(mp_group, out_features, kwargs)
        self.name, self.tp_rank, self.group, self.tp_world_size = kwargs.get("name"), rank, mp_group, size
        self.shard_sizes, self._partition_sizes = list(sizes), tuple(sizes)
        if skip_partition:
            rank, size = 0, 1
            self.tp_rank, self.tp_world_size = 0, 1
            self.shard_sizes, self._partition_sizes = [out_features], (out_features,)
        else:
            self._cut(module.weight, 0)
            if module.bias is not None:
                self._cut(module.bias, 0)
        super().__init__(module.weight, module.bias, False, mp_group, size, rank)
        self.gather_output = bool(gather_output)
        self._mark_uc_metadata()

    def _mark_uc_metadata(self) -> None:
        """Each parameter's universal-checkpoint metadata: weight and bias cut along dim 0 (column-parallel)."""
        self._mark_split(self.weight, 0, row=False)
        self._mark_split(self.bias, 0, row=False, is_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.gather_output and self.tp_size > 1:
            y = gather_output_slices(y, self.shard_sizes, self.tp_rank, self.group)
        return y


class LinearAllreduce(_DeepSpeedShards, RowParallelLinear):
    """DeepSpeed's row-parallel ``LinearAllreduce(module, mp_group)``: this rank's input features of ``module``;
    the partial outputs are all-reduced, then the whole bias is added."""

    def __init__(self, module: nn.Linear, mp_group: ProcessGroup | None, **kwargs: Any):
        self._orig_weight_shape = _shape_before_zero3_partition(module.weight)
        rank, size, sizes = _placement(mp_group, self._orig_weight_shape[1], kwargs)
        self.name, self.tp_rank, self.group, self.tp_world_size = kwargs.get("name"), rank, mp_group, size
        self.shard_sizes, self._partition_sizes = list(sizes), tuple(sizes)
        self._cut(module.weight, 1)
        super().__init__(module.weight, module.bias, False, mp_group, size, rank)
        self._mark_uc_metadata()

    def _mark_uc_metadata(self) -> None:
        """Each parameter's universal-checkpoint metadata: the weight cut along dim 1 (row-parallel), the bias
        whole on every rank."""
        self._mark_split(self.weight, 1, row=True)
        if self.bias is not None:
            mark_replicated(self.bias, row=True)
