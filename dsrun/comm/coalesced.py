"""Reduce-scatters of several tensors in one collective (DeepSpeed's
``deepspeed.runtime.comm.coalesced_collectives``): ``reduce_scatter_coalesced`` and qgZ's
``all_to_all_quant_reduce`` and ``all_to_all_loco_quant_reduce``.

**reduce_scatter_coalesced(tensors, group)** averages each tensor over the ranks of ``group`` and gives each rank
its partition: rank r's part of a tensor of n elements is elements ``[r * c, r * c + c)`` of the flattened tensor
(``c = ceil(n / P)``; the last ranks' parts are shorter or empty when P does not divide n). The parts are laid out
rank by rank, each tensor's part padded to c, in one buffer, pre-divided by P, and reduce-scattered at once; each
output is a view of this rank's piece of that buffer. As in DeepSpeed, a single tensor that P divides is its own
buffer: it is divided in place and the output is a view of it (no allocation).

**all_to_all_quant_reduce(tensors, groups)** is the same average and partition through ZeRO++'s quantized
gradient exchange (INT4 codes, :class:`dsrun.comm.quantized.QuantizedReduceScatter`): inside each node, then across
nodes. ``groups`` is DeepSpeed's dict of the run's node groups: ``local_{i}`` the ranks of node i, ``global_{j}``
the ranks with local index j (nodes of ``accelerator.device_count()`` ranks). A 1-D tensor, or one whose size
``2 * world`` does not divide, takes ``reduce_scatter_coalesced`` over the world instead (as DeepSpeed, which warns).
On one node the exchange is one quantized all-to-all over the world. Quantization blocks: DeepSpeed's group count,
``max(rows, columns, world)`` groups per tensor.

**all_to_all_loco_quant_reduce(params, groups, loco_param)** is that exchange of each parameter's ``.grad`` with
LoCo's error feedback (``{"err_beta", "reset_T"}``): each parameter keeps its quantization errors
(``ds_loco_feedback``, INT8 between calls) and adds them to its next gradient before quantizing.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from dsrun.comm import comm
from dsrun.comm.quantized import LocoFeedback, QuantizedReduceScatter
from dsrun.utils.logging import logger


@torch.no_grad()
def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor], group: comm.ProcessGroup = None) -> list[torch.Tensor]:
    """Each tensor averaged over ``group`` (None: the world), this rank's partition of each (module docstring)."""
    world = comm.get_world_size(group)
    rank = comm.get_rank(group)
    part_sizes = [math.ceil(t.numel() / world) for t in tensors]
    if len(tensors) == 1 and tensors[0].numel() % world == 0:
        buffer = tensors[0].view(-1)
    else:
        pieces = []
        for r in range(world):
            for tensor, size in zip(tensors, part_sizes):
                part = tensor.reshape(-1)[r * size:(r + 1) * size]
                pieces.append(part)
                if part.numel() < size:
                    pieces.append(part.new_zeros(size - part.numel()))
        buffer = torch.cat(pieces)
    buffer.div_(world)
    mine = buffer.chunk(world)[rank]
    comm.reduce_scatter_fn(mine, buffer, group=group)
    outputs, offset = [], 0
    for tensor, size in zip(tensors, part_sizes):
        length = max(0, min(size, tensor.numel() - rank * size))
        outputs.append(mine.narrow(0, offset, length))
        offset += size
    return outputs


@torch.no_grad()
def all_to_all_quant_reduce(tensors: Sequence[torch.Tensor], groups: dict) -> list[torch.Tensor]:
    """Each tensor averaged over the world through INT4 quantized all-to-alls, this rank's partition of each
    (module docstring)."""
    return _quant_reduce(tensors, groups, [None] * len(tensors))


@torch.no_grad()
def all_to_all_loco_quant_reduce(params: Sequence[torch.Tensor], groups: dict,
                                 loco_param: dict | None = None) -> list[torch.Tensor]:
    """:func:`all_to_all_quant_reduce` of each parameter's ``.grad`` with LoCo's error feedback
    (``loco_param``: ``{"err_beta", "reset_T"}``; :class:`dsrun.comm.quantized.LocoFeedback`): each parameter
    keeps its quantization errors (``ds_loco_feedback``) and sends them with its next gradient."""
    feedbacks = []
    for p in params:
        if getattr(p, "ds_loco_feedback", None) is None:
            p.ds_loco_feedback = LocoFeedback(**(loco_param or {}))
        feedbacks.append(p.ds_loco_feedback)
    return _quant_reduce([p.grad for p in params], groups, feedbacks)


def _quant_reduce(tensors: Sequence[torch.Tensor], groups: dict,
                  feedbacks: Sequence[LocoFeedback | None]) -> list[torch.Tensor]:
    from dsrun.accelerator import get_accelerator

    world = comm.get_world_size()
    rank = comm.get_rank()
    local = get_accelerator().device_count()
    nodes = world // local if local <= world else 1
    outputs = []
    for tensor, feedback in zip(tensors, feedbacks):
        if tensor.dim() == 1 or tensor.numel() % (2 * world):
            if tensor.dim() > 1:
                logger.warning(f"qgZ falls back to reduce_scatter because tensor size = {tensor.numel()} is not "
                               f"divisible by (2 * global_world_size) = {2 * world}. Please consider allocating a "
                               "new world to enable qgZ")
            outputs.append(reduce_scatter_coalesced([tensor])[0])
            continue
        block = max(1, tensor.numel() // max(tensor.shape[0], tensor.shape[1], world))
        if nodes > 1:
            exchange = QuantizedReduceScatter(intra=_node_group(groups, f"local_{rank // local}"),
                                              inter=_node_group(groups, f"global_{rank % local}"), bits=4,
                                              block=block, loco=feedback)
        else:
            exchange = QuantizedReduceScatter(bits=4, block=block, loco=feedback)
        summed = torch.empty(tensor.numel() // world, dtype=torch.float32, device=tensor.device)
        exchange(summed, tensor.reshape(world, -1), "grad" if feedback is not None else None)
        outputs.append(summed.div_(world).to(tensor.dtype))
    return outputs


def _node_group(groups: dict, key: str):
    if key not in groups:
        raise KeyError(f"all_to_all_quant_reduce: groups has no {key!r}; expected DeepSpeed's node groups "
                       "'local_<node>' and 'global_<local index>' (ZeRO-3's all2all_process_group)")
    return groups[key]
