"""``SparseSelfAttention``: DeepSpeed's block-sparse self-attention module, on :mod:`.block_sparse`.

Same constructor and ``forward`` as DeepSpeed's; it runs on CPU and CUDA in fp32/bf16/fp16 (DeepSpeed's
needed fp16 on a V100/A100 through Triton). The layout of ``max_seq_length`` tokens is built once and kept
as the buffer ``master_layout`` (saved in checkpoints; dsrun's engine broadcasts rank 0's buffers, so a
random layout is the same on every rank); a shorter sequence uses its top-left corner.
"""
from __future__ import annotations

import torch
from torch import nn

from dsrun.ops.sparse_attention.block_sparse import BlockIndex, block_index, block_sparse_attention
from dsrun.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig


def _squeeze_to(mask: torch.Tensor, dims: int) -> torch.Tensor:
    """Drop size-1 dimensions after the first until ``dims`` remain (``[B,1,1,T]`` -> ``[B,T]``)."""
    for dim in range(mask.dim() - 1, 0, -1):
        if mask.dim() > dims and mask.shape[dim] == 1:
            mask = mask.squeeze(dim)
    while mask.dim() > dims and mask.shape[0] == 1:
        mask = mask.squeeze(0)
    return mask


class SparseSelfAttention(nn.Module):
    """Sparse self-attention after Child et al., *Generative Modeling with Sparse Transformers*.

    Args:
        sparsity_config: the layout (any :class:`SparsityConfig` subclass); default
            ``FixedSparsityConfig(num_heads=4)``.
        key_padding_mask_mode: ``"add"`` adds ``key_padding_mask`` to the scores; ``"mul"`` masks where it is 0.
        attn_mask_mode: the same for ``attn_mask`` (default ``"mul"``).
        max_seq_length: the longest sequence; sizes ``master_layout``.
    """

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048):
        super().__init__()
        self.sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in ("add", "mul"):
                raise ValueError(f"{name}: got {mode!r}; allowed: 'add', 'mul'")
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.register_buffer("master_layout", self.sparsity_config.make_layout(max_seq_length))
        self._indexes: dict[tuple, BlockIndex] = {}

    def get_layout(self, L: int) -> torch.Tensor:  # noqa: N803 - DeepSpeed's argument name
        """The layout of a sequence of ``L`` tokens (``L`` a multiple of the block size)."""
        block = self.sparsity_config.block
        if L % block:
            raise ValueError(f"sequence length {L} is not a multiple of the block size {block}")
        num_blocks = L // block
        if num_blocks > self.master_layout.shape[-1]:
            raise ValueError(f"sequence length {L} exceeds max_seq_length "
                             f"{self.master_layout.shape[-1] * block} of this SparseSelfAttention")
        return self.master_layout[..., :num_blocks, :num_blocks].cpu()

    def block_index(self, L: int, device: torch.device, causal: bool = False) -> BlockIndex:  # noqa: N803
        """The non-zero blocks for ``L`` tokens, cached until the layout buffer changes."""
        layout = self.master_layout
        key = (L, str(device), causal, layout.data_ptr(), layout._version)
        if key not in self._indexes:
            self._indexes = {k: v for k, v in self._indexes.items() if k[3:] == key[3:]}
            self._indexes[key] = block_index(self.get_layout(L), self.sparsity_config.block, causal, device)
        return self._indexes[key]

    @staticmethod
    def transpose_key_for_scores(x: torch.Tensor, L: int) -> torch.Tensor:  # noqa: N803
        """Accept keys given as ``[B, H, head_dim, L]`` (already transposed for ``Q Kᵀ``)."""
        return x.transpose(-1, -2) if x.shape[2] != L else x

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention context ``[B, H, L, head_dim]`` of ``query``, ``key``, ``value`` ``[B, H, L, head_dim]``.

        ``rpe``: relative position scores added to the scaled scores (broadcast to ``[B, H, L, L]``);
        ``key_padding_mask``: ``[B, L]`` (or ``[B, 1, 1, L]``); ``attn_mask``: ``[L, L]``.
        """
        return self._attend(query, key, value, rpe, key_padding_mask, attn_mask)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None,
                key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, causal: bool = False,
                dropout_p: float = 0.0) -> torch.Tensor:
        seq = query.shape[2]
        key = self.transpose_key_for_scores(key, seq)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError("only self-attention is supported: query, key and value need one shape, got "
                                      f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if key_padding_mask is not None:
            key_padding_mask = _squeeze_to(key_padding_mask, 2)
        if attn_mask is not None:
            attn_mask = _squeeze_to(attn_mask, 2)
        index = self.block_index(seq, query.device, causal)
        return block_sparse_attention(query, key, value, index, rpe=rpe, key_padding_mask=key_padding_mask,
                                      key_padding_mask_mode=self.key_padding_mask_mode, attn_mask=attn_mask,
                                      attn_mask_mode=self.attn_mask_mode, causal=causal, dropout_p=dropout_p)


class CausalSparseSelfAttention(SparseSelfAttention):
    """dsrun's decoder form: every query sees only itself and earlier keys, whatever the layout says.

    The layout's blocks above the diagonal are dropped and the upper triangle of each diagonal block is
    masked. Any sequence length up to ``max_seq_length`` works: it is padded at the end to whole blocks (the
    padding is in every real token's future, so it changes nothing) and the padding is cut from the output.
    ``dropout_p`` drops attention probabilities, as ``scaled_dot_product_attention`` does.
    """

    def __init__(self, sparsity_config: SparsityConfig, max_seq_length: int):
        block = sparsity_config.block
        super().__init__(sparsity_config, max_seq_length=-(-max_seq_length // block) * block)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                dropout_p: float = 0.0) -> torch.Tensor:
        seq = query.shape[2]
        pad = -seq % self.sparsity_config.block
        if pad:
            query, key, value = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
        out = self._attend(query, key, value, None, None, None, causal=True, dropout_p=dropout_p)
        return out[:, :, :seq] if pad else out
