"""Reading the per-rank optimizer state a checkpoint holds (``optimizer_rank_states_<r>.pt``: the 1-bit
optimizers' error buffers, 0/1 Adam's local weights, Muon's momentum) by element range.

A load at another world size hands an optimizer every saved rank's state with its large tensors left unread
(on the meta device) and a :data:`RangeRead` that reads any element range of one of them from its file
(``dsrun.checkpoint.partial_state.PartialRankStates``), so the optimizer reads only the elements it keeps, into
the tensors it keeps, plus one bounded buffer for a mean over the saved ranks. States already in memory are read
by :func:`read_in_memory` (the default).
"""
from __future__ import annotations

from typing import Callable

import torch

# (saved tensor, first element of its flattened elements, 1-D out): out.numel() elements into out, cast as copy_
RangeRead = Callable[[torch.Tensor, int, torch.Tensor], None]
MEAN_CHUNK_ELEMENTS = 4 << 20  # a mean over saved ranks reads at most this many elements of each rank at a time


def read_in_memory(tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
    """:data:`RangeRead` of a tensor in memory."""
    out.copy_(tensor.reshape(-1)[start:start + out.numel()])


def read_whole(read: RangeRead, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (its shape and dtype) read whole through ``read``, on the CPU."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    read(tensor, 0, out.view(-1))
    return out


def mean_into(out: torch.Tensor, sources: list[tuple[torch.Tensor, int] | None], read: RangeRead) -> None:
    """``out`` (1-D) = the mean over ``sources`` of each one's ``out.numel()`` elements from its start (None: a
    source of zeros), in fp32, as ``torch.stack(rows).mean(dim=0)`` of the whole rows gives it element by
    element; read in chunks of :data:`MEAN_CHUNK_ELEMENTS` per source."""
    total = out.numel()
    chunk = min(MEAN_CHUNK_ELEMENTS, total)
    buffer = torch.zeros(len(sources), chunk)
    for first in range(0, total, chunk):
        count = min(chunk, total - first)
        rows = buffer if count == chunk else torch.zeros(len(sources), count)
        for row, source in zip(rows, sources):
            if source is not None:
                read(source[0], source[1] + first, row)
        out[first:first + count] = rows.mean(dim=0)
