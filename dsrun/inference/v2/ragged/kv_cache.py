"""``deepspeed.inference.v2.ragged.kv_cache``: the blocked KV cache's storage and its block allocators.

One 6-D tensor per cache group, ``[caches, blocks, block_size, 2 (key, value), heads, head_size]``; a sequence's
tokens sit in the blocks its block table lists, ``block_size`` tokens a block. The number of blocks is the
memory config's: ``allocate`` takes ``size`` blocks, ``reserve`` fills the accelerator's free memory but ``size``
bytes (on a CPU the host's ``MemAvailable``; torch reserves the pages lazily), the minimum over the model-parallel
group so every rank schedules alike."""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Tuple

import torch

from dsrun.accelerator import get_accelerator
from dsrun.comm import comm as dist

from ..allocator import current_device
from ..inference_utils import DtypeEnum, elem_size
from .blocked_allocator import BlockedAllocator
from .manager_configs import AllocationMode, KVCacheConfig, MemoryConfig


def split_kv(kv_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The key and the value views ([blocks, block_size, heads, head_size]) of one cache
    ([blocks, block_size, 2, heads, head_size])."""
    if kv_cache.ndim != 5:
        raise ValueError(f"KV-cache must have 5 dimensions, got {kv_cache.ndim}.")
    return kv_cache[:, :, 0, :, :], kv_cache[:, :, 1, :, :]


class BlockedKVCache:
    """The caches of every cache group and one :class:`BlockedAllocator` per group."""

    def __init__(self, configs: Tuple[KVCacheConfig, ...], memory_config: MemoryConfig,
                 mp_group: Optional[Any] = None, offload: bool = False) -> None:
        self._configs = configs
        self._memory_config = memory_config
        self._enable_offload = offload
        if offload:
            raise NotImplementedError("Offloading of KV-caches is not yet supported.")
        if AllocationMode(memory_config.mode) is AllocationMode.RESERVE:
            num_blocks = self._blocks_that_fit(mp_group)
        else:
            num_blocks = memory_config.size
        self._caches = tuple(
            torch.empty((config.cache_shape[0], num_blocks, config.block_size, 2, config.cache_shape[1],
                         config.cache_shape[2]), dtype=DtypeEnum(config.cache_dtype).value, device=current_device())
            for config in configs)
        self._allocators = tuple(BlockedAllocator(num_blocks) for _ in configs)

    def _blocks_that_fit(self, mp_group: Optional[Any]) -> int:
        bytes_per_block = sum(
            math.prod(config.cache_shape) * config.block_size * 2 * elem_size(DtypeEnum(config.cache_dtype).value)
            for config in self._configs)
        get_accelerator().empty_cache()
        available = get_accelerator().available_memory() - self._memory_config.size
        if available < bytes_per_block:
            raise ValueError(f"Insufficient memory to allocate KV-caches. Required: {bytes_per_block}, "
                             f"Available: {available}")
        num_blocks = available // bytes_per_block
        if dist.get_world_size(group=mp_group) > 1:
            fewest = torch.tensor(num_blocks, dtype=torch.int64, device=current_device())
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=mp_group)
            num_blocks = int(fewest)
        return num_blocks

    def reserve(self, num_blocks: int, cache_group: int = 0) -> torch.Tensor:
        """Take ``num_blocks`` free blocks of ``cache_group`` (their ids, int32)."""
        return self._allocators[cache_group].allocate(num_blocks)

    def free(self, blocks: Iterable[int], cache_group: int = 0) -> None:
        self._allocators[cache_group].free(blocks)

    def offload(self, blocks: Iterable[int], cache_group: int = 0) -> torch.Tensor:
        raise NotImplementedError("Offloading is not yet supported.")

    def restore(self, blocks: Iterable[int], cache_group: int = 0) -> torch.Tensor:
        raise NotImplementedError("Offloading is not yet supported.")

    def get_cache(self, cache_id: int, cache_group: int = 0) -> torch.Tensor:
        """Cache ``cache_id`` of ``cache_group``: [blocks, block_size, 2, heads, head_size]."""
        return self._caches[cache_group][cache_id]

    @property
    def free_blocks(self) -> list:
        """Free blocks of each cache group."""
        return [allocator.free_blocks for allocator in self._allocators]

    @property
    def num_caches(self) -> int:
        return len(self._caches)
