"""``deepspeed.inference.v2.ragged``: the ragged batch (``RaggedBatchWrapper``), the state manager with its blocked
KV cache and tracked sequences (``DSStateManager``, ``BlockedKVCache``, ``DSSequenceDescriptor``), the block
allocator and the configs. On a CPU the "device" tensors are host tensors beside their host copies."""
from .blocked_allocator import BlockedAllocator
from .kv_cache import BlockedKVCache, split_kv
from .manager_configs import AllocationMode, DSStateManagerConfig, KVCacheConfig, KVCacheType, MemoryConfig
from .ragged_manager import DSStateManager
from .ragged_wrapper import RaggedBatchWrapper
from .sequence_descriptor import BaseSequenceDescriptor, DSSequenceDescriptor, PlaceholderSequenceDescriptor

__all__ = ["AllocationMode", "BaseSequenceDescriptor", "BlockedAllocator", "BlockedKVCache", "DSSequenceDescriptor",
           "DSStateManager", "DSStateManagerConfig", "KVCacheConfig", "KVCacheType", "MemoryConfig",
           "PlaceholderSequenceDescriptor", "RaggedBatchWrapper", "split_kv"]
