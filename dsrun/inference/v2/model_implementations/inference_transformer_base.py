"""DeepSpeed's inference-v2 model bases (``deepspeed.inference.v2.model_implementations.inference_model_base`` and
``inference_transformer_base``): what a ragged-batching model tells the engine (its KV-cache needs per sequence,
its cache shape, its local heads under tensor parallelism).

A model's layers are DeepSpeed's CUDA modules (blocked attention, norms, embedding), so building one is refused
here, as it fails on DeepSpeed's own CPU side; the KV-cache arithmetic and the head split run anywhere (the
sharding of its parameters is :mod:`.sharding`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import TYPE_CHECKING, Optional

import torch

from dsrun import comm as dist

from ..config_v2 import RaggedInferenceEngineConfig
from ..inference_utils import ActivationType, DtypeEnum, ceil_div, is_gated
from ..kernels import not_on_cpu
from ..modules.configs import NormTypeEnum, PositionalEmbeddingType, RotateHalfConfig
from ..ragged import BaseSequenceDescriptor, KVCacheConfig
from .sharding import get_local_heads

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig


class DSInferenceModelBase(torch.nn.Module, ABC):
    """A model the ragged engine runs: its config, the engine's config, its tensor-parallel group."""

    def __init__(self, config: "PretrainedConfig", engine_config: RaggedInferenceEngineConfig,
                 base_mp_group: Optional["ProcessGroup"]) -> None:
        super().__init__()
        self._config = config
        self._engine_config = engine_config
        self._base_mp_group = base_mp_group
        self._non_transformer = None
        self._transformer = None
        self._flattened_param_buffer = None
        self._flattened_param_metadata = None

    @property
    def config(self) -> "PretrainedConfig":
        return self._config

    def set_parameters(self, transformer, non_transformer, flattened_param_buffer=None,
                       flattened_param_metadata=None) -> None:
        self._transformer = transformer
        self._non_transformer = non_transformer
        self._flattened_param_buffer = flattened_param_buffer
        self._flattened_param_metadata = flattened_param_metadata

    def set_state_manager(self, state_manager: object) -> None:
        self.state_manager = state_manager

    @cached_property
    def tp_rank(self) -> int:
        return dist.get_rank(group=self._base_mp_group) if dist.is_initialized() else 0

    @cached_property
    def tp_size(self) -> int:
        return dist.get_world_size(group=self._base_mp_group) if dist.is_initialized() else 1

    @property
    @abstractmethod
    def max_sequence_length(self) -> int:
        ...

    def maybe_free_kv(self, sequence: BaseSequenceDescriptor) -> None:
        """Free the blocks no future token attends to (none for dense attention)."""


class DSTransformerModelBase(DSInferenceModelBase):
    """A dense Transformer. Subclasses give the shapes (``num_layers``, ``model_dim``, ``n_heads``...) as
    properties; the local head counts, the parameter transforms and the KV-cache arithmetic follow."""

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def model_dim(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def head_size(self) -> int: ...

    @property
    @abstractmethod
    def n_heads(self) -> int: ...

    @property
    def n_heads_q(self) -> int:
        return self.n_heads

    @property
    def n_heads_kv(self) -> int:
        return self.n_heads

    @property
    @abstractmethod
    def intermediate_dim(self) -> int: ...

    @property
    @abstractmethod
    def positional_embedding_type(self) -> PositionalEmbeddingType: ...

    @property
    @abstractmethod
    def activation_dtype(self) -> DtypeEnum: ...

    @property
    @abstractmethod
    def mlp_activation_fn(self) -> ActivationType: ...

    @property
    @abstractmethod
    def norm_type(self) -> NormTypeEnum: ...

    @property
    @abstractmethod
    def positional_embedding_config(self) -> Optional[RotateHalfConfig]: ...

    @cached_property
    def n_heads_q_local(self) -> int:
        return get_local_heads(self.tp_rank, self.tp_size, self.n_heads_q, self.n_heads_kv)[0]

    @cached_property
    def n_heads_kv_local(self) -> int:
        return get_local_heads(self.tp_rank, self.tp_size, self.n_heads_q, self.n_heads_kv)[1]

    @property
    def gated_mlp(self) -> bool:
        return is_gated(self.mlp_activation_fn)

    def __init__(self, config: "PretrainedConfig", engine_config: RaggedInferenceEngineConfig,
                 base_mp_group: Optional["ProcessGroup"]) -> None:
        super().__init__(config, engine_config, base_mp_group)
        raise not_on_cpu(f"inference.v2.model_implementations.{type(self).__name__}",
                         "its layers include DeepSpeed's embedding and unembedding modules")

    # the KV cache, for an autoregressive dense attention pattern
    def get_kv_requirements(self, sequence: BaseSequenceDescriptor, max_new_tokens: int,
                            max_new_blocks: int) -> tuple[int, int]:
        """``(tokens, blocks)``: how many of ``max_new_tokens`` the sequence can take with at most
        ``max_new_blocks`` more KV blocks, and how many blocks that needs."""
        block_size = self.attn.kv_block_size
        needed = ceil_div(sequence.seen_tokens + max_new_tokens, block_size) - sequence.cur_allocated_blocks
        if needed <= max_new_blocks:
            return max_new_tokens, needed
        capacity = (max_new_blocks + sequence.cur_allocated_blocks) * block_size - sequence.seen_tokens
        return capacity, max_new_blocks

    def get_remaining_block_capacity(self, sequence: BaseSequenceDescriptor) -> int:
        return sequence.seen_tokens % self.attn.kv_block_size

    def maybe_allocate_kv(self, sequence: BaseSequenceDescriptor, n_new_tokens: int) -> None:
        """Give ``sequence`` the blocks ``n_new_tokens`` more tokens need, from the state manager."""
        _, needed = self.get_kv_requirements(sequence, n_new_tokens, self.state_manager.free_blocks[0])
        if needed > 0:
            sequence.extend_kv_cache(self.state_manager.allocate_blocks(needed))

    def kv_cache_config(self) -> tuple[KVCacheConfig, ...]:
        if self._kv_cache_config is None:
            self._kv_cache_config = KVCacheConfig(
                block_size=self.attn.kv_block_size, cache_shape=(self.num_layers, self.n_heads_kv_local,
                                                                 self.head_size),
                cache_dtype=self.activation_dtype,
                max_blocks_per_allocation_group=ceil_div(self.max_sequence_length, self.attn.kv_block_size))
        return (self._kv_cache_config, )

    def prepare_batch(self, wrapped_batch: object) -> None:
        self.attn.build_atoms(wrapped_batch)


__all__ = ["DSInferenceModelBase", "DSTransformerModelBase"]
