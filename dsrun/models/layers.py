"""The pieces of a GPT block: causal self-attention (with optional rotary positions), the MLP, the block.

Module names follow GPT-2 (``c_attn``, ``c_proj``, ``c_fc``, ``ln_1``, ``ln_2``) so checkpoints and
parameter names read the way most people know them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.models.config import GPTConfig
from dsrun.ops.sparse_attention import CausalSparseSelfAttention, sparsity_config_from_dict
from dsrun.sequence import groups as sequence_groups
from dsrun.sequence.layer import DistributedAttention

# The LayerNorms' epsilon (torch's default, and GPT-2's layer_norm_epsilon): the Hugging Face export writes it
LAYER_NORM_EPS = 1e-5


def rotary_cos_sin(seq_len: int, head_size: int, base: float, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles, each ``[seq_len, head_size/2]``.

    Computed on the fly rather than stored as buffers: it is cheap, and a model built on the meta device
    and materialised later then has no buffer that needs re-initialising.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, device=device, dtype=torch.float32) / head_size))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dimension of ``x`` ``[B, H, T, hs]`` by the angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.head_size = config.head_size
        self.rotary = config.positions == "rotary"
        self.rotary_base = config.rotary_base
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.sequence_parallel = config.sequence_parallel  # Ulysses over the engine's sequence group
        # model.attention=sparse: block-sparse attention over the ds.sparse_attention layout (dsrun.ops)
        self.sparse: CausalSparseSelfAttention | None = None
        if config.attention == "sparse":
            layout = sparsity_config_from_dict(config.sparse_attention, config.n_head, "model.sparse_attention")
            self.sparse = CausalSparseSelfAttention(layout, max_seq_length=config.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        width = self.n_head * self.head_size  # the heads this module holds (fewer once pruned, a slice under TP)
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, self.head_size) for t in (q, k, v))  # [B, T, H, hs]
        if self.sequence_parallel and sequence_groups._get_sequence_parallel_world_size() > 1:
            # Ulysses: x is this rank's slice of the sequence; attention sees the whole sequence, 1/S of the heads
            # and the output projection keeps the exchange's input for backward, not a second copy of its output
            group = sequence_groups._get_sequence_parallel_group()
            attention = DistributedAttention(self.local_attention, group, scatter_idx=2, gather_idx=1)
            y = attention.forward_projected(lambda out: self.c_proj(out.reshape(batch, seq, width)), q, k, v)
        else:
            y = self.c_proj(self.local_attention(q, k, v).reshape(batch, seq, width))
        return self.resid_dropout(y)

    def local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over whole sequences: q, k, v and the result ``[B, T, heads, hs]``."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hs]
        if self.rotary:
            cos, sin = rotary_cos_sin(q.shape[2], self.head_size, self.rotary_base, q.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        if self.sparse is not None:
            y = self.sparse(q, k, v, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        # not made contiguous: the reshape or the exchange that follows copies only if it must, so under Ulysses
        # the tensor kept for the output projection can be the one attention saves (DistributedAttention)
        return y.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual_scale: float = 1.0) -> torch.Tensor:
        """``residual_scale`` multiplies both branches (progressive layer drop divides a kept block's branches
        by its keep probability, so the expected output matches the full model's)."""
        if residual_scale != 1.0:
            x = x + self.attn(self.ln_1(x)) * residual_scale
            return x + self.mlp(self.ln_2(x)) * residual_scale
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
