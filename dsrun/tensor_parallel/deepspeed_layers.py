"""DeepSpeed's AutoTP layer classes (``deepspeed.module_inject.layers``) on dsrun's column-/row-parallel layers.

``LinearLayer(module, mp_group)`` keeps this rank's rows of an ``nn.Linear`` (its output features, and its bias),
``LinearAllreduce(module, mp_group)`` its columns (input features; the bias stays whole and is added once after the
all-reduce), each with DeepSpeed's shard sizes (:func:`dsrun.tensor_parallel.shard_sizes.get_shard_size_list`,
so an uneven dimension splits as DeepSpeed splits it). The forward and backward are dsrun's
(:mod:`dsrun.tensor_parallel.layers`); ``gather_output=True`` all-gathers a column-parallel output over the group
(backward: this rank's slice of the gradient). Like DeepSpeed's, the layers keep the module's own ``Parameter``
objects, mark them (``tensor_model_parallel``; ``is_model_parallel_parameter`` is true of them) and hang
``gather_params`` / ``_tp_partition`` on them. ``set_autotp_mode(training=...)`` / ``is_autotp_training_mode()``
is DeepSpeed's process-wide switch, which ``initialize`` turns on for a run that asks for AutoTP. Also here:
Yuan 2's shared-QK layers (``Yuan_LinearLayer``, ``Yuan_LinearAllreduce``: whole heads picked by
:func:`share_qk_heads`, never gathered) and ``LmHeadLinearAllreduce`` (the LM head cut by its input features).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dsrun import comm
from dsrun.checkpoint.autotp_meta import DS_AUTOTP_UC_META, _build_param_uc_restore_meta, mark_replicated, mark_split

from .graph_collectives import GATHER_OUTPUT_OP
from .layers import ColumnParallelLinear, RowParallelLinear, reduce_from_group
from .shard_sizes import get_num_kv_heads, get_shard_size_list

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
            if self.defer_collectives_to_compiler:  # traced: the graph op (it changes the width downstream sees)
                return GATHER_OUTPUT_OP(y, list(self.shard_sizes))
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


# --- Yuan 2's shared-QK attention, and the LM head cut by its input features ---

_YUAN_UNSUPPORTED = ("Yuan shared-QK tensor parallelism selects noncontiguous head groups that universal checkpoint "
                     "conversion cannot currently describe")


def share_qk_heads(num_heads: int, rank: int, world_size: int) -> list[int]:
    """The heads of Yuan 2's value (and output-projection) weights that rank ``rank`` of ``world_size`` holds
    (DeepSpeed's ``shard_value_with_share_qk``): the model packs query and key heads so that each rank's query heads
    pair up, two by two, with one value head from the first half and the same one from the second half. A
    ValueError when the heads do not divide over the ranks or there are fewer than two per rank."""
    if num_heads % world_size:
        raise ValueError(f"Yuan shared-QK AutoTP: {num_heads} heads do not divide over {world_size} ranks; use a "
                         "tensor-parallel size that divides the head count")
    if world_size > num_heads // 2:
        raise ValueError(f"Yuan shared-QK AutoTP: world_size {world_size} is larger than half of num_heads "
                         f"{num_heads}; use at most {num_heads // 2} ranks")
    per_rank = num_heads // world_size
    start = rank * per_rank
    first = [(start + 2 * i) // 2 for i in range((per_rank + 1) // 2)]
    return first + [head + num_heads // 2 for head in first]


def _share_qk_cut(param: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    heads = get_num_kv_heads()
    if heads is None:
        raise ValueError("Yuan shared-QK AutoTP: the number of heads is not set; call "
                         "deepspeed.module_inject.tp_shard.set_num_kv_heads(n) before building the layer")
    width = param.shape[dim] // heads
    index = torch.cat([torch.arange(h * width, (h + 1) * width) for h in share_qk_heads(heads, rank, world_size)])
    return param.index_select(dim, index.to(param.device)).contiguous()


class _YuanShareQK:
    """What DeepSpeed's two Yuan layers share: the cut by :func:`share_qk_heads` (the value heads' rows of a column
    weight and bias, the same heads' columns of a row weight; a row bias stays whole), no gather (RuntimeError, as
    in DeepSpeed: the heads a rank holds are not contiguous), metadata naming the layout unsupported."""

    tp_rank: int
    tp_world_size: int
    weight: nn.Parameter
    bias: nn.Parameter | None
    _orig_weight_shape: tuple[int, ...]

    def _cut(self, param: nn.Parameter, dim: int) -> None:
        if self.tp_world_size > 1:
            with torch.no_grad():
                param.data = _share_qk_cut(param.data, dim, self.tp_rank, self.tp_world_size)
        param.tensor_model_parallel = True
        param.partition_dim, param.partition_stride = dim, 1

    def gather_params(self, params_list: list[nn.Parameter]) -> None:
        raise RuntimeError(_YUAN_UNSUPPORTED)

    def _tp_partition(self, params_list: list[nn.Parameter | None]) -> None:
        """Cut each whole parameter of ``params_list`` (weight first, then the bias) to this rank's heads."""
        row = isinstance(self, RowParallelLinear)
        for param in params_list:
            if param is not None and not (row and param is self.bias):
                self._cut(param, 1 if row and param is self.weight else 0)

    def _mark_uc_metadata(self) -> None:
        row = isinstance(self, RowParallelLinear)
        for param in (self.weight, self.bias):
            if param is None:
                continue
            shape = self._orig_weight_shape if param is self.weight else tuple(_shape_before_zero3_partition(param))
            if param is self.bias and not row:
                shape = (self._orig_weight_shape[0],)
            dim = (1 if row else 0) if param is self.weight or not row else None
            setattr(param, DS_AUTOTP_UC_META, _build_param_uc_restore_meta(
                partition_type="row" if row else "column", partition_dim=dim, logical_shape=shape,
                original_shape=shape, is_bias=param is self.bias, unsupported_reason=_YUAN_UNSUPPORTED))


class Yuan_LinearLayer(_YuanShareQK, LinearLayer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's column-parallel layer of Yuan 2's value projection: each rank keeps its value heads' rows
    (:func:`share_qk_heads`; the head count from ``tp_shard.set_num_kv_heads``)."""


class Yuan_LinearAllreduce(_YuanShareQK, LinearAllreduce):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's row-parallel layer of Yuan 2's output projection: each rank keeps the columns of its value heads
    (:func:`share_qk_heads`); the partial outputs are all-reduced, then the whole bias is added."""


class LmHeadLinearAllreduce(LinearAllreduce):
    """DeepSpeed's LM head cut by its input features: built on fresh copies of the module's weight and bias (a
    tied input embedding stays whole), named ``lm_head`` for the shard sizes; the forward takes the whole hidden
    state and keeps this rank's features by the sizes frozen at construction (a later model's shard settings do not
    move them), then all-reduces the partial logits over the group and adds the bias."""

    def __init__(self, module: nn.Linear, mp_group: ProcessGroup | None, **kwargs: object):
        module.weight = nn.Parameter(module.weight.detach().clone())
        if getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(module.bias.detach().clone())
        super().__init__(module, mp_group, **{**kwargs, "name": "lm_head"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = self._partition_sizes
        if sum(sizes) != x.shape[-1]:
            raise ValueError(f"lm_head was partitioned for an input of {sum(sizes)} features, got {x.shape[-1]}; "
                             "pass the whole hidden state")
        start = sum(sizes[:self.tp_rank])
        y = torch.matmul(x[..., start:start + sizes[self.tp_rank]], self.weight.transpose(-1, -2))
        if self.group is not None and self.tp_world_size > 1:
            y = reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias
