"""``PartitionedTensor``: a tensor cut into contiguous flat pieces over a process group, one piece per rank
(DeepSpeed's ``runtime.utils.PartitionedTensor``, which its pipeline engine sends activations with).

The cut is :func:`dsrun.zero.tiling.partition_uniform` over the flat elements; ``to_meta()`` encodes the shape
and the cut as one long tensor (``[ndim, *shape, num_parts, rank, *boundaries]``) so a receiver can rebuild
the object with ``from_meta(meta, local_part, group)``; ``full()`` gathers the pieces back into the tensor.
"""
from __future__ import annotations

import math

import torch

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.zero.tiling import partition_uniform


class PartitionedTensor:
    """This rank's piece of ``tensor`` (``local_data``) and the cut (``partition``: ``num_parts + 1``
    boundaries in flat elements)."""

    def __init__(self, tensor: torch.Tensor, group: ProcessGroup, partition_meta: torch.Tensor | None = None):
        self.group = group
        self.num_parts = comm.get_world_size(group=group)
        self.rank = comm.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(num_items=tensor.numel(), num_parts=self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:stop].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: ProcessGroup,
                  device: torch.device | str | None = None) -> "PartitionedTensor":
        """The object ``to_meta()`` described, holding ``local_part`` as this rank's piece."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor meta must be a long tensor, got {meta.dtype}")
        obj = cls(tensor=torch.ones(comm.get_world_size(group=group)), group=group)
        values = meta.tolist()
        ndim = values[0]
        obj.orig_size = values[1:1 + ndim]
        num_parts, rank, *boundaries = values[1 + ndim:]
        if (num_parts, rank) != (obj.num_parts, obj.rank):
            raise ValueError(f"meta was made for rank {rank} of {num_parts}; this is rank {obj.rank} of "
                             f"{obj.num_parts}")
        obj.partition = boundaries
        obj.orig_device = torch.device(device) if device is not None else local_part.device
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(obj.orig_size) % obj.num_parts == 0
        return obj

    def full(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's piece (collective over the group)."""
        device = self.orig_device if device is None else device
        largest = max(b - a for a, b in zip(self.partition, self.partition[1:]))
        padded = torch.zeros(largest, dtype=self.local_data.dtype, device=self.local_data.device)
        padded[:self.local_data.numel()] = self.local_data  # uneven cuts: gather equal pieces, then trim
        gathered = torch.empty(largest * self.num_parts, dtype=padded.dtype, device=padded.device)
        comm.all_gather_into_tensor(gathered, padded, group=self.group)
        pieces = [gathered[i * largest:i * largest + (b - a)]
                  for i, (a, b) in enumerate(zip(self.partition, self.partition[1:]))]
        return torch.cat(pieces).view(self.orig_size).to(device).clone()

    def to_meta(self) -> torch.Tensor:
        """The shape and the cut as one long tensor, to send along with ``data()``."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
