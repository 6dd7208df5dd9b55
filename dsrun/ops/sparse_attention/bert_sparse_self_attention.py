"""``BertSparseSelfAttention``: a BERT self-attention block (query/key/value projections) whose attention is
:class:`SparseSelfAttention`; a drop-in for ``layer.attention.self`` of a Hugging Face-style BERT."""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dsrun.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from dsrun.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig


class BertShape(Protocol):
    """What the sparse BERT attention reads of a model config (``max_position_embeddings`` too, if it has one)."""

    hidden_size: int
    num_attention_heads: int


class BertSparseSelfAttention(nn.Module):
    """``config`` needs ``hidden_size`` and ``num_attention_heads`` (a BERT config); ``sparsity_config``
    defaults to ``FixedSparsityConfig(num_heads=4)``. ``forward(hidden_states, attention_mask)`` takes
    BERT's additive mask (``[B, L]`` or ``[B, 1, 1, L]``, 0 where attended) as the key padding mask and
    returns the context ``[B, L, hidden_size]``."""

    def __init__(self, config: BertShape, sparsity_config: SparsityConfig | None = None):
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"hidden_size ({config.hidden_size}) is not a multiple of num_attention_heads "
                             f"({config.num_attention_heads})")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        # DeepSpeed's layout covers 2048 tokens; a longer max_position_embeddings gets a layout that long
        max_positions = max(2048, getattr(config, "max_position_embeddings", None) or 0)
        max_positions = -(-max_positions // sparsity_config.block) * sparsity_config.block
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_positions)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, hidden]`` -> ``[B, heads, L, head_size]``."""
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        query, key, value = (self.transpose_for_scores(proj(hidden_states))
                             for proj in (self.query, self.key, self.value))
        context = self.sparse_self_attention(query, key, value, key_padding_mask=attention_mask)
        return context.permute(0, 2, 1, 3).reshape(*hidden_states.shape[:-1], self.all_head_size)
