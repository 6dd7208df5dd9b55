"""The global gradient norm of a tensor-parallel run, for gradient clipping.

The ZeRO step measures the norm over the data-parallel group, where every rank of a tensor-parallel group
would count its own slice of a split parameter and, again, its copy of every whole parameter. The norm of the
unsplit model's gradient is the slices' squares summed over the tensor-parallel group plus the whole
parameters' squares counted once. :func:`clip_by_tensor_parallel_norm`, a ``before_update`` step hook, measures
that and sets the step's coefficient the way the strategy's step does (loss scale removed, then clipped:
``dsrun/zero/base.py``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from dsrun import comm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dsrun.zero.step_hooks import StepState


def squared_norms(strategy: Any) -> torch.Tensor:
    """``[split, whole]``: this rank's sums of squares of the split and of the whole parameters' gradients
    (float64), summed over the data-parallel group where the strategy partitions them (stages 1-3)."""
    if hasattr(strategy, "sub_groups"):  # stage 3: each sub-group's gradient holds its parameters' shards in order
        pieces = [(param, sg.grad.narrow(0, offset, param.ds_partition_numel)) for sg in strategy.sub_groups
                  if sg.grad is not None for param, offset in zip(sg.params, sg.offsets)]
        partitioned = True
    else:
        grads = strategy.step_gradients()
        partitioned = bool(getattr(strategy, "partitioned", False))
        pieces = []
        for flat, local in zip(strategy.groups, grads):
            start = flat.partition_range(flat.rank)[0] if partitioned else 0
            for param, offset, numel in zip(flat.params, flat.offsets, flat.numels):
                lo, hi = max(offset, start), min(offset + numel, start + local.numel())
                if lo < hi:
                    pieces.append((param, local[lo - start:hi - start]))
    sums = torch.zeros(2, dtype=torch.float64, device=pieces[0][1].device if pieces else None)
    for param, piece in pieces:
        piece = piece.double()
        sums[0 if getattr(param, "tensor_model_parallel", False) else 1] += torch.dot(piece, piece)
    if partitioned and comm.get_world_size(strategy.norm_group) > 1:
        comm.all_reduce(sums, group=strategy.norm_group)
    return sums


def tensor_parallel_norm(strategy: Any, tp_group: ProcessGroup | None, scale: float) -> float:
    """The gradient norm of the unsplit model (``scale`` removes the loss scale)."""
    sums = squared_norms(strategy)
    split = sums[:1].clone()
    comm.all_reduce(split, group=tp_group)
    return math.sqrt(float(split.item() + sums[1].item())) * scale


def clip_by_tensor_parallel_norm(state: StepState, tp_group: ProcessGroup | None, clipping: float) -> None:
    """``before_update``: the step's norm and coefficient from the unsplit model's norm."""
    strategy = state.strategy
    if not clipping or not state.reduced:
        return
    coef = 1.0 / strategy.precision.loss_scale
    norm = tensor_parallel_norm(strategy, tp_group, coef)
    clip_coef = clipping / (norm + 1e-6)
    state.coef = coef * clip_coef if clip_coef < 1.0 else coef
    state.grad_norm = norm
