"""Flat buffers: the parameters of one optimizer param group laid end to end in one tensor.

Flattening lets a whole group be reduced, partitioned and updated as one tensor. The model's parameters
become views into the flat buffer, so writing the buffer (an all-gather, a master-weight copy) updates the
model without a copy per tensor. For ZeRO stages 1-2 the buffer is padded to a multiple of
``2 * world_size`` (DeepSpeed's alignment rule) and split into ``world_size`` equal, contiguous partitions:
rank r owns elements ``[r * P, (r + 1) * P)``; the padding sits at the end, in the last ranks' partitions.

``zero_optimization.parameter_alignment`` (stages 1-2) also pads between parameters, as DeepSpeed does: each
parameter but the last is followed by the zeros that bring the next one's start to a multiple of 16 bytes
(:func:`parameter_alignment` elements of the model's dtype), recorded per parameter (``FlatGroup.paddings``,
DeepSpeed's ``param_alignment_paddings``). The gaps hold zeros in the weights, gradients and optimizer state, so
they never enter the update or the norm.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from dsrun.comm.comm import ProcessGroup


def aligned(numel: int, alignment: int) -> int:
    """``numel`` rounded up to a multiple of ``alignment``."""
    return -(-numel // alignment) * alignment


def parameter_alignment(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in 16 bytes (DeepSpeed's ``16 // gcd(16, element_size)``): 4 for fp32, 8 for bf16."""
    size = torch.empty((), dtype=dtype).element_size()
    return 16 // math.gcd(16, size)


def aligned_offsets(numels: list[int], alignment: int) -> tuple[list[int], list[int], int]:
    """Each parameter's start, the padding after it (none after the last) and the end of the last one, with
    every start a multiple of ``alignment`` elements (1: packed end to end)."""
    offsets, paddings, end = [], [], 0
    for i, n in enumerate(numels):
        offsets.append(end)
        end += n
        pad = 0 if i == len(numels) - 1 else -end % alignment
        paddings.append(pad)
        end += pad
    return offsets, paddings, end


@dataclass
class FlatGroup:
    """One param group flattened: ``params`` in order, their ``offsets`` and sizes, and the flat buffer.
    ``numel`` is where the last parameter ends (the gaps of ``paddings`` included), ``padded_numel`` the buffer's
    length."""

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
    paddings: list[int] = field(default_factory=list)  # zeros after each parameter (parameter_alignment)

    @functools.cached_property
    def gaps(self) -> list[tuple[int, int]]:
        """The ranges of the zeros between parameters (none when packed)."""
        return [(off + n, off + n + pad) for off, n, pad in zip(self.offsets, self.numels, self.paddings) if pad]

    @property
    def padding(self) -> int:
        """Every element that is no parameter's: the end's and the gaps between parameters."""
        return self.padded_numel - sum(self.numels)

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
                   alignment: int, world_size: int, process_group: ProcessGroup = None, rank: int = 0,
                   param_alignment: int = 1) -> FlatGroup:
    """Copy ``params`` into a new flat buffer (padded to ``alignment``) and re-point each at its slice, each
    starting at a multiple of ``param_alignment`` elements."""
    numels = [p.numel() for p in params]
    offsets, paddings, total = aligned_offsets(numels, param_alignment)
    padded = aligned(max(total, 1), alignment)
    flat = torch.zeros(padded, dtype=dtype, device=device)
    with torch.no_grad():
        for p, off, n in zip(params, offsets, numels):
            view = flat[off:off + n].view_as(p)
            view.copy_(p.data)
            p.data = view
    return FlatGroup(params=params, offsets=offsets, numels=numels, numel=total, padded_numel=padded,
                     world_size=world_size, flat_param=flat, process_group=process_group, rank=rank,
                     paddings=paddings)


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
