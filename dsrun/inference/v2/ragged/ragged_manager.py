"""``deepspeed.inference.v2.ragged.ragged_manager``: ``DSStateManager``, the sequences being served and the KV cache
they hold. Each tracked sequence takes a slot of the block-id tables (one per cache group,
``[max_tracked_sequences, allocation groups, max blocks per group]``, with a host copy); flushing it frees its
blocks and its slot."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from dsrun.utils.logging import logger

from ..allocator import current_device
from .blocked_allocator import BlockedAllocator
from .kv_cache import BlockedKVCache
from .manager_configs import DSStateManagerConfig, KVCacheConfig
from .sequence_descriptor import DSSequenceDescriptor, register_block_ids


def fast_host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped as ``like``, pinned where the accelerator pins (DeepSpeed's
    ``RaggedUtilsBuilder().load().allocate_fast_host_buffer``)."""
    from dsrun.accelerator import get_accelerator
    return get_accelerator().pin_memory(torch.zeros(like.shape, dtype=like.dtype, device="cpu"))


class DSStateManager:

    def __init__(self, config: DSStateManagerConfig, kv_configs: Tuple[KVCacheConfig, ...],
                 base_mp_group: Optional[Any] = None) -> None:
        self._config = config
        self._kv_configs = kv_configs
        self._tracking_allocator = BlockedAllocator(config.max_tracked_sequences)
        tables = [torch.zeros((config.max_tracked_sequences, kv.num_allocation_groups,
                               kv.max_blocks_per_allocation_group), dtype=torch.int32, device=current_device())
                  for kv in kv_configs]
        for table in tables:
            register_block_ids(table)
        self._all_block_ids = tuple(tables)
        self._all_block_ids_shadow = tuple(fast_host_buffer(table) for table in tables)
        self._seqs: Dict[int, DSSequenceDescriptor] = {}
        self._kv_cache = BlockedKVCache(kv_configs, config.memory_config, mp_group=base_mp_group,
                                        offload=config.offload)

    def get_cache(self, cache_id: int, cache_group: int = 0) -> torch.Tensor:
        """Cache ``cache_id`` of ``cache_group``: [blocks, block_size, 2, heads, head_size]."""
        return self._kv_cache.get_cache(cache_id, cache_group=cache_group)

    def flush_sequence(self, uid: int) -> None:
        """Free the blocks and the tracking slot of sequence ``uid``."""
        if uid not in self._seqs:
            logger.warning(f"Attempting to flush sequence {uid} which does not exist.")
            return
        seq = self._seqs.pop(uid)
        for group in range(self.n_kv_cache_groups):
            self._kv_cache.free(seq.all_block_ids(cache_group=group), cache_group=group)
        self._tracking_allocator.free(seq.tracking_id)

    def get_sequence(self, uid: int) -> Optional[DSSequenceDescriptor]:
        return self._seqs.get(uid)

    def get_or_create_sequence(self, uid: int) -> DSSequenceDescriptor:
        """The descriptor of ``uid``, tracking it first if it is new (RuntimeError when every slot is taken)."""
        seq = self.get_sequence(uid)
        return seq if seq is not None else self._create_sequence(uid)

    def _create_sequence(self, uid: int) -> DSSequenceDescriptor:
        if uid in self._seqs:
            raise ValueError(f"Sequence {uid} already exists.")
        try:
            slot = int(self._tracking_allocator.allocate(1)[0])
        except ValueError:
            raise RuntimeError(f"Unable to create tracking slot for sequence {uid} since the metadata buffers are "
                               "full.") from None
        self._seqs[uid] = DSSequenceDescriptor(slot, tuple(table[slot] for table in self._all_block_ids),
                                               tuple(table[slot] for table in self._all_block_ids_shadow),
                                               max_context=self._config.max_context)
        return self._seqs[uid]

    @property
    def tracked_sequences(self) -> Dict[int, DSSequenceDescriptor]:
        return self._seqs

    @property
    def n_tracked_sequences(self) -> int:
        return len(self._seqs)

    @property
    def kv_block_size(self) -> int:
        return self._kv_configs[0].block_size

    @property
    def n_kv_cache_groups(self) -> int:
        return self._kv_cache.num_caches

    @property
    def free_blocks(self) -> list:
        """Free KV blocks of each cache group."""
        return self._kv_cache.free_blocks

    def allocate_blocks(self, n_blocks: int, cache_group: int = 0) -> torch.Tensor:
        """Take ``n_blocks`` free KV blocks of ``cache_group`` (their ids)."""
        return self._kv_cache.reserve(n_blocks, cache_group=cache_group)
