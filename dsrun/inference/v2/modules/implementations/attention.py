"""DeepSpeed's ``dense_blocked_attention``: causal self attention over the blocked KV cache, on the torch ragged
kernels. ``forward`` writes the batch's keys and values into the cache (after rotary embeddings when the config
asks for ``rotate_half``: synthesized from ``theta_base``/``rotate_dim``, or the model's ``inv_freqs`` when
``use_trained_freqs``), then runs the attention atoms ``build_atoms`` prepared for the batch."""
from __future__ import annotations

from functools import cached_property
from typing import Any, Dict, Optional

import torch

from ...allocator import current_device, empty_from
from ...inference_utils import DtypeEnum
from ...kernels.ragged_ops import (AtomBuilder, BlockedFlashAttn, BlockedRotaryEmbeddings,
                                    BlockedTrainedRotaryEmbeddings, LinearBlockedKVCopy, get_kv_block_size,
                                    get_q_block_size)
from ...ragged import RaggedBatchWrapper, split_kv
from ...ragged.ragged_manager import fast_host_buffer
from ..configs import DSSelfAttentionConfig, MaskingType, PositionalEmbeddingType
from ..interfaces import DSSelfAttentionBase, DSSelfAttentionRegistry


@DSSelfAttentionRegistry.register_module
class DSDenseBlockedAttention(DSSelfAttentionBase):

    @staticmethod
    def name() -> str:
        return 'dense_blocked_attention'

    @staticmethod
    def supports_config(config: DSSelfAttentionConfig) -> bool:
        if config.input_dtype != config.output_dtype:
            return False
        if DtypeEnum(config.input_dtype) not in (DtypeEnum.fp16, DtypeEnum.bf16):
            return False
        if PositionalEmbeddingType(config.positional_embedding_type) not in (PositionalEmbeddingType.none,
                                                                              PositionalEmbeddingType.rotate_half):
            return False
        return MaskingType(config.masking_type) == MaskingType.causal

    def __init__(self, config: DSSelfAttentionConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)
        head, n_q, n_kv = config.head_size, config.n_heads_q, config.n_heads_kv
        embed_type = PositionalEmbeddingType(config.positional_embedding_type)
        rotary = config.positional_embedding_config
        if embed_type == PositionalEmbeddingType.none:
            self._kv_copy = LinearBlockedKVCopy(head, n_q, n_kv, config.input_dtype)
        elif rotary is None:
            raise ValueError("Rotary config must be provided if using rotate_half as Positional Embedding Type.")
        elif rotary.use_trained_freqs:
            self._kv_copy = BlockedTrainedRotaryEmbeddings(head, n_q, n_kv, config.input_dtype)
        else:
            rotary_dim = rotary.rotate_dim if rotary.rotate_dim is not None else head
            self._kv_copy = BlockedRotaryEmbeddings(head, n_q, n_kv, config.input_dtype, rotary_dim,
                                                    rotary.theta_base)
        self._softmax_scale = config.scale_factor
        self._attn_kernel = BlockedFlashAttn(head, config.input_dtype)
        self._atom_builder = AtomBuilder()
        self.model_dim = head * n_q
        self._output = torch.empty((config.max_tokens, head * n_q), dtype=config.output_dtype,
                                   device=current_device())
        # DeepSpeed sizes the atoms by max_sequences, one per sequence: enough while every sequence of a batch has
        # at most q_block_size tokens; a longer prompt needs more (ValueError from AtomBuilder, as DeepSpeed's
        # kernel would write past the buffer)
        self._atoms = torch.empty((config.max_sequences, 8), dtype=torch.int32, device=current_device())
        self._atoms_shadow = fast_host_buffer(self._atoms)
        self._cur_atoms = 0

    @cached_property
    def kv_block_size(self) -> int:
        return get_kv_block_size(self._config.head_size)

    @cached_property
    def q_block_size(self) -> int:
        return get_q_block_size(self._config.head_size)

    def build_atoms(self, ragged_batch: RaggedBatchWrapper) -> None:
        """Split the batch's queries into attention atoms (before ``forward``)."""
        host_atoms, n_atoms = self._atom_builder(self._atoms_shadow, ragged_batch, self.q_block_size,
                                                 self.kv_block_size)
        self._cur_atoms = n_atoms
        self._atoms[:n_atoms].copy_(host_atoms[:n_atoms], non_blocking=True)

    def forward(self, q_k_v: torch.Tensor, kv_cache: torch.Tensor, batch: RaggedBatchWrapper,
                inv_freqs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q_k_v`` [tokens, (q heads + 2 kv heads) * head_size]; ``kv_cache`` [blocks, block_size, 2, kv heads,
        head_size]; returns the attention output [tokens, q heads * head_size] (a view of the module's buffer)."""
        if inv_freqs is not None:
            self._kv_copy(kv_cache, q_k_v, batch, inv_freqs)
        else:
            self._kv_copy(kv_cache, q_k_v, batch)
        q = q_k_v[:, :self._config.head_size * self._config.n_heads_q]
        output = empty_from(self._output, q.shape)
        k_cache, v_cache = split_kv(kv_cache)
        self._attn_kernel(output, q, k_cache, v_cache, self._atoms[:self._cur_atoms], self._softmax_scale)
        return output
