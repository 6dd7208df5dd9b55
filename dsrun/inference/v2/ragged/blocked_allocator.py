"""``deepspeed.inference.v2.ragged.blocked_allocator``: which blocks of the blocked KV cache are free."""
from __future__ import annotations

from typing import Iterable, Union

import torch


class BlockedAllocator:
    """The free blocks of a blocked KV cache as a linked list in one int32 tensor: ``_blocks[i]`` is the free block
    after ``i`` (``-1`` marks a used block), ``_head`` the first free one. Allocating or freeing N blocks costs O(N).

    DeepSpeed puts the list in pinned memory, which a CPU-only torch refuses; here it is pinned only where the
    accelerator pins (``pin_memory``), so the allocator works on a CPU too."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f'Blocked KV-cache must have at least 1 block, provided {num_blocks}')
        from dsrun.accelerator import get_accelerator
        self._num_blocks = num_blocks
        self._blocks = get_accelerator().pin_memory(torch.arange(1, num_blocks + 1, dtype=torch.int32))
        self._head = 0
        self._free_blocks = num_blocks

    def allocate(self, num_blocks: int) -> torch.Tensor:
        """``num_blocks`` free blocks (an int32 tensor of their indices); ValueError when fewer are free."""
        if num_blocks > self._free_blocks:
            raise ValueError(f'Not enough free blocks in the KV-cache to allocate {num_blocks} blocks')
        allocated = torch.empty(num_blocks, dtype=torch.int32)
        for i in range(num_blocks):
            block = self._head
            allocated[i] = block
            self._head = int(self._blocks[block])
            self._blocks[block] = -1
        self._free_blocks -= num_blocks
        return allocated

    def free(self, blocks: Union[Iterable[int], int]) -> None:
        """Return ``blocks`` to the free list. All are checked first: one out of range or already free raises
        ValueError and none is freed."""
        blocks = [blocks] if isinstance(blocks, int) else [int(block) for block in blocks]
        for block in blocks:
            if block < 0 or block >= self._num_blocks:
                raise ValueError(f'Invalid block {block} provided to free')
            if self._blocks[block] != -1:
                raise ValueError(f'Block {block} is already free')
        for block in blocks:
            self._blocks[block] = self._head
            self._head = block
            self._free_blocks += 1

    @property
    def free_blocks(self) -> int:
        return self._free_blocks
