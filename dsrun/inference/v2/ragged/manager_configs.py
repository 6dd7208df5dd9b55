"""``deepspeed.inference.v2.ragged.manager_configs``: the KV cache's and the state manager's configs, validated as
DeepSpeed validates them (pydantic ``ValidationError`` on a bad value)."""
from __future__ import annotations

from enum import Enum
from typing import Tuple

from pydantic import PositiveInt, model_validator

from dsrun.config.config_utils import DeepSpeedConfigModel

from ..inference_utils import DtypeEnum


class KVCacheType(Enum):
    DENSE = "dense"  # the default
    LOCAL = "local"  # attends only to a trailing window of tokens


class KVCacheConfig(DeepSpeedConfigModel):
    type: KVCacheType = KVCacheType.DENSE
    block_size: int = 128
    """Tokens per cache block."""
    num_allocation_groups: PositiveInt = 1
    """Groups of layers that allocate blocks separately (alternating local and global attention)."""
    cache_shape: Tuple[PositiveInt, PositiveInt, PositiveInt]
    """Per token: (caches in the group, heads, head size)."""
    cache_dtype: DtypeEnum = DtypeEnum.fp16
    max_blocks_per_allocation_group: PositiveInt = 64


class AllocationMode(Enum):
    RESERVE = "reserve"  # keep ``size`` bytes free after the KV cache
    ALLOCATE = "allocate"  # allocate ``size`` KV blocks


class MemoryConfig(DeepSpeedConfigModel):
    mode: AllocationMode = AllocationMode.RESERVE
    size: PositiveInt = 1_000_000_000


class DSStateManagerConfig(DeepSpeedConfigModel):
    max_tracked_sequences: PositiveInt = 2048
    """Sequences tracked at once; at least ``max_ragged_sequence_count``."""
    max_ragged_batch_size: PositiveInt = 768
    """Tokens in one ragged batch."""
    max_ragged_sequence_count: PositiveInt = 512
    """Sequences in one ragged batch; at most ``max_tracked_sequences`` and ``max_ragged_batch_size``."""
    max_context: PositiveInt = 8192
    """Tokens (prompt and generation) in one sequence."""
    memory_config: MemoryConfig = MemoryConfig()
    offload: bool = False

    @model_validator(mode="after")
    def _sequence_count_fits(self) -> "DSStateManagerConfig":
        if self.max_ragged_sequence_count > self.max_tracked_sequences:
            raise ValueError(f"max_ragged_sequence_count ({self.max_ragged_sequence_count}) must not exceed "
                             f"max_tracked_sequences ({self.max_tracked_sequences})")
        if self.max_ragged_sequence_count > self.max_ragged_batch_size:
            raise ValueError(f"max_ragged_sequence_count ({self.max_ragged_sequence_count}) must not exceed "
                             f"max_ragged_batch_size ({self.max_ragged_batch_size})")
        return self
