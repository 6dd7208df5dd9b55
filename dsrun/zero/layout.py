"""Flat buffers: the parameters of one optimizer param group laid end to end in one tensor.

Flattening lets a whole group be reduced, partitioned and updated as one tensor. The model's parameters
become views into the flat buffer, so writing the buffer (an all-gather, a master-weight copy) updates the
model without a copy per tensor. For ZeRO stages 1-2 the buffer is padded to a multiple of
``2 * world_size`` (DeepSpeed's alignment rule) and split into ``world_size`` equal, contiguous partitions:
rank r owns elements ``[r * P, (r + 1) * P)``; the padding sits at the end, in the last ranks' partitions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsrun.comm.comm import ProcessGroup


def aligned(numel: int, alignment: int) -> int:
    """``numel`` rounded up to a multiple of ``alignment``."""
    return -(-numel // alignment) * alignment


@dataclass
class FlatGroup:
    """One param group flattened: ``params`` in order, their ``offsets`` and sizes, and the flat buffer."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    numels: list[int]
    numel: int
    padded_numel: int
    world_size: int
    flat_param: torch.Tensor
    hyperparams: dict = field(default_factory=dict)
    # the group this flat group is reduced and partitioned over (None: the world) and this rank's place in
    # it: the data-parallel group, or an expert-data-parallel group for MoE experts
    process_group: ProcessGroup = None
    rank: int = 0

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def partition_numel(self) -> int:
        return self.padded_numel // self.world_size

    def partition_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.partition_numel
        return start, start + self.partition_numel

    def partition_padding(self, rank: int) -> int:
        """Padding elements inside rank's partition (DeepSpeed's ``group_paddings`` entry)."""
        start, end = self.partition_range(rank)
        return max(0, end - max(start, self.numel))

    def param_shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]


def flatten_params(params: list[torch.nn.Parameter], dtype: torch.dtype, device: torch.device,
                   alignment: int, world_size: int, process_group: ProcessGroup = None, rank: int = 0) -> FlatGroup:
    """Copy ``params`` into a new flat buffer (padded to ``alignment``) and re-point each at its slice."""
    numels = [p.numel() for p in params]
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    padded = aligned(max(total, 1), alignment)
    flat = torch.zeros(padded, dtype=dtype, device=device)
    with torch.no_grad():
        for p, off, n in zip(params, offsets, numels):
            view = flat[off:off + n].view_as(p)
            view.copy_(p.data)
            p.data = view
    return FlatGroup(params=params, offsets=offsets, numels=numels, numel=total, padded_numel=padded,
                     world_size=world_size, flat_param=flat, process_group=process_group, rank=rank)


class FlatGradients:
    """Full-size gradient buffers for stages 0-1: one flat tensor per group, each parameter's ``.grad`` a view
    into it, so autograd accumulates in place there and a bucket is reduced without gathering anything.

    ``param.grad`` stays the user's to touch, as in plain torch: ``zero_grad()`` (set to None or zeroed), an
    assignment, or an out-of-place accumulation replaces the view, and :meth:`adopt` copies whatever ``.grad``
    then holds into the buffer and re-points it at the view, so the reduction sees exactly torch's gradient.
    """

    def __init__(self, groups: list[FlatGroup]):
        self.groups = groups
        self.flats = [torch.zeros_like(g.flat_param) for g in groups]
        self.views = [[flat[off:off + n].view_as(p) for p, off, n in zip(g.params, g.offsets, g.numels)]
                      for g, flat in zip(groups, self.flats)]
        for gi in range(len(groups)):
            self.attach(gi)

    def attach(self, gi: int) -> None:
        for p, view in zip(self.groups[gi].params, self.views[gi]):
            p.grad = view

    def adopt(self, gi: int, pi: int) -> None:
        """Make parameter ``pi`` of group ``gi``'s ``.grad`` the buffer's view again, keeping its value
        (None counts as zero). An identity check when nothing replaced it."""
        param, view = self.groups[gi].params[pi], self.views[gi][pi]
        grad = param.grad
        if grad is view:
            return
        with torch.no_grad():
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
        param.grad = view

    def zero(self) -> None:
        for gi, flat in enumerate(self.flats):
            flat.zero_()
            self.attach(gi)

    def nbytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self.flats)
