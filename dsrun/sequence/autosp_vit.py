"""AutoSP's ViT attention under sequence parallelism (``deepspeed.sequence.autosp_vit``).

A vision encoder's self-attention is not causal: every patch attends to every patch, so a rank holding
``1/P`` of the patches cannot attend locally. :class:`UlyssesSPViTAttention` wraps an encoder's attention module
and gathers the patches of the sequence-parallel group, runs the wrapped attention over the whole sequence on
every rank, and keeps this rank's slice of its output; everything outside attention (MLP, norms) stays per
shard. A ``[CLS]`` token, when the encoder has one, is the first token on every rank and is not sharded.
Shards may differ in length (``num_patches % P != 0``): each rank's real patches are gathered, without
padding reaching the attention, in rank order.

Unlike DeepSpeed's (its ``all_gather`` is outside autograd), the gather here is differentiable: the gradient
of every rank's output reaches the patches it came from (:func:`gather_sequence`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from dsrun import comm


class _GatherSequence(torch.autograd.Function):
    """All-gather of ``[bs, len_r, ...]`` shards along dim 1 into the whole sequence; the backward sums the
    whole sequence's gradient over the group (each rank's output used every shard) and keeps this rank's."""

    @staticmethod
    def forward(ctx: FunctionCtx, group: comm.ProcessGroup, lengths: list[int], x: torch.Tensor) -> torch.Tensor:
        rank, longest = comm.get_rank(group), max(lengths)
        padded = F.pad(x, (0,) * (2 * (x.dim() - 2)) + (0, longest - x.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in lengths]
        comm.all_gather(parts, padded, group=group)
        ctx.group, ctx.start, ctx.length = group, sum(lengths[:rank]), lengths[rank]
        return torch.cat([part[:, :n] for part, n in zip(parts, lengths)], dim=1)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        grad = grad.contiguous()
        comm.all_reduce(grad, group=ctx.group)
        return None, None, grad[:, ctx.start:ctx.start + ctx.length]


def shard_lengths(x: torch.Tensor, group: comm.ProcessGroup) -> list[int]:
    """Every rank's length of dim 1 of ``x`` (the sequence), in rank order."""
    lengths = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(comm.get_world_size(group))]
    comm.all_gather(lengths, torch.tensor([x.shape[1]], dtype=torch.long, device=x.device), group=group)
    return [int(n.item()) for n in lengths]


def gather_sequence(x: torch.Tensor, group: comm.ProcessGroup, lengths: list[int] | None = None) -> torch.Tensor:
    """The group's shards of ``x`` (``[bs, local_len, ...]``) joined along dim 1 in rank order, differentiably;
    ``lengths`` (each rank's ``local_len``) is asked of the group when not given."""
    return _GatherSequence.apply(group, shard_lengths(x, group) if lengths is None else lengths, x)


class UlyssesSPViTAttention(nn.Module):
    """``UlyssesSPViTAttention(attn, process_group, has_cls_token=True)``: see the module docstring. The wrapped
    ``attn`` maps ``hidden_states`` (``[bs, seq, hidden]``) to the same shape, or to a tuple whose first element
    is that (the rest is returned as it is); keyword arguments reach it unchanged."""

    def __init__(self, attn: nn.Module, process_group: comm.ProcessGroup, has_cls_token: bool = True) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.has_cls_token = has_cls_token

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> torch.Tensor | tuple:
        cls_token = hidden_states[:, :1] if self.has_cls_token else None
        patches = hidden_states[:, 1:] if self.has_cls_token else hidden_states
        lengths = shard_lengths(patches, self.process_group)
        full = gather_sequence(patches, self.process_group, lengths)
        out = self.attn(full if cls_token is None else torch.cat([cls_token, full], dim=1), **kwargs)
        first, extra = (out[0], tuple(out[1:])) if isinstance(out, (tuple, list)) else (out, ())
        start = sum(lengths[:comm.get_rank(self.process_group)])
        skip = 1 if self.has_cls_token else 0
        local = first[:, skip + start:skip + start + patches.shape[1]]
        if cls_token is not None:
            local = torch.cat([first[:, :1], local], dim=1)
        local = local.contiguous()
        return (local, *extra) if extra else local
