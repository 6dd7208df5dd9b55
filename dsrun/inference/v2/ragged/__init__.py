"""``deepspeed.inference.v2.ragged``: the KV-cache block allocator, the state manager's configs and the sequence
descriptors. DeepSpeed's state manager, KV cache and ragged batch wrapper keep their tables in GPU memory and
are not provided (docs/inference.md)."""
from .blocked_allocator import BlockedAllocator
from .manager_configs import AllocationMode, DSStateManagerConfig, KVCacheConfig, KVCacheType, MemoryConfig
from .sequence_descriptor import BaseSequenceDescriptor, PlaceholderSequenceDescriptor

__all__ = ["AllocationMode", "BaseSequenceDescriptor", "BlockedAllocator", "DSStateManagerConfig", "KVCacheConfig",
           "KVCacheType", "MemoryConfig", "PlaceholderSequenceDescriptor"]
