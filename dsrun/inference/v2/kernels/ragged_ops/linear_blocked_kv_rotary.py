"""DeepSpeed's KV-cache copy kernels (``linear_blocked_kv_rotary``): each real token's key and value are written
into its sequence's blocked KV cache (block ``table[pos // block_size]``, row ``pos % block_size``), after a
rotary position embedding of its query (in place, in ``qkv``) and key for the two rotary kernels.

The rotation is "rotate half" on the first ``rotary_dim`` channels of each head: channel ``j`` and ``j + d/2``
turn by the angle ``pos * inv_freq[j]``, computed in float32. ``BlockedRotaryEmbeddings`` synthesizes
``inv_freq[j] = theta_base ** (-2j / rotary_dim)``; as DeepSpeed's CUDA kernel, the keys and the first query head
of each GQA group take that frequency rounded to the activation dtype, the other query heads the float32 one.
``BlockedTrainedRotaryEmbeddings`` takes the model's float32 ``inverse_freqs``."""
from __future__ import annotations

from typing import Optional

import torch

from ...inference_utils import DtypeEnum
from ...ragged import RaggedBatchWrapper
from .. import DSKernelBase
from .ragged_helpers import token_kv_slots


def _check(kernel: type, head_size: int, n_q_heads: int, n_kv_heads: int, dtype) -> DtypeEnum:
    if head_size not in kernel.supported_head_sizes:
        raise ValueError(f"Unsupported head size: {head_size}, supported_head_sizes are "
                         f"{kernel.supported_head_sizes}")
    q_ratio = n_q_heads // n_kv_heads
    if q_ratio not in kernel.supported_q_ratios:
        raise ValueError(f"Unsupported q_ratio: {q_ratio}, supported_q_ratios are {kernel.supported_q_ratios}")
    dtype = DtypeEnum(dtype)
    if dtype not in kernel.supported_dtypes:
        raise ValueError(f"Unsupported data type: {dtype}, supported_dtypes are {kernel.supported_dtypes}")
    return dtype


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``x`` [tokens, heads, head_size] (float32) with its first ``rotary_dim`` channels rotated ("rotate half");
    ``inv_freq`` [rotary_dim // 2] or [heads, rotary_dim // 2]."""
    half = rotary_dim // 2
    angles = positions.float().view(-1, 1, 1) * inv_freq.view(1, -1, half)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:rotary_dim]
    out = x.clone()
    out[..., :half] = first * cos - second * sin
    out[..., half:rotary_dim] = second * cos + first * sin
    return out


class _BlockedKVWrite(DSKernelBase):
    """The shared write of keys and values into the blocked cache, with the rotation a subclass asks for."""
    supported_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16]
    supported_head_sizes = [64, 80, 96, 128]
    supported_q_ratios = [1, 2, 4, 5, 8]

    def __init__(self, head_size: int, n_q_heads: int, n_kv_heads: int, dtype: torch.dtype) -> None:
        self.dtype = _check(type(self), head_size, n_q_heads, n_kv_heads, dtype)
        self.head_size = head_size
        self.n_q_heads = n_q_heads
        self.n_kv_heads = n_kv_heads

    def _write(self, kv_cache: torch.Tensor, qkv: torch.Tensor, ragged_batch: RaggedBatchWrapper,
               q_freq: Optional[torch.Tensor], kv_freq: Optional[torch.Tensor], rotary_dim: int) -> None:
        head, n_q, n_kv = self.head_size, self.n_q_heads, self.n_kv_heads
        positions, blocks, rows = token_kv_slots(ragged_batch, kv_cache.shape[1])
        n_tokens = positions.numel()
        k = qkv[:n_tokens, head * n_q:head * (n_q + n_kv)].reshape(n_tokens, n_kv, head)
        v = qkv[:n_tokens, head * (n_q + n_kv):head * (n_q + 2 * n_kv)].reshape(n_tokens, n_kv, head)
        if kv_freq is not None:
            q = qkv[:n_tokens, :head * n_q].view(n_tokens, n_q, head)
            q.copy_(_rotate(q.float(), positions, q_freq, rotary_dim))
            k = _rotate(k.float(), positions, kv_freq, rotary_dim)
        kv_cache[blocks, rows, 0] = k.to(kv_cache.dtype)
        kv_cache[blocks, rows, 1] = v.to(kv_cache.dtype)


class LinearBlockedKVCopy(_BlockedKVWrite):
    """Copy each token's key and value into the blocked KV cache ([blocks, block_size, 2, kv heads, head_size])."""

    def __call__(self, kv_cache: torch.Tensor, qkv: torch.Tensor, ragged_batch: RaggedBatchWrapper) -> None:
        self._write(kv_cache, qkv, ragged_batch, None, None, 0)


class BlockedRotaryEmbeddings(_BlockedKVWrite):
    """Rotate queries (in place) and keys with synthesized frequencies, then copy keys and values into the cache."""
    supported_q_ratios = [1, 2, 4, 5, 6, 7, 8, 16, 29, 35, 36, 71]

    def __init__(self, head_size: int, n_q_heads: int, n_kv_heads: int, dtype: torch.dtype, rotary_dim: int,
                 theta_base: float) -> None:
        super().__init__(head_size, n_q_heads, n_kv_heads, dtype)
        if rotary_dim % 2 != 0 or not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary_dim must be even and within the head size ({head_size}), got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.theta_base = theta_base

    def __call__(self, kv_cache: torch.Tensor, qkv: torch.Tensor, ragged_batch: RaggedBatchWrapper) -> None:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=qkv.device) / self.rotary_dim
        inv_freq = 1.0 / torch.pow(torch.tensor(self.theta_base, dtype=torch.float32), exponents)
        rounded = inv_freq.to(self.dtype.value).float()
        group_leader = (torch.arange(self.n_q_heads, device=qkv.device) % (self.n_q_heads // self.n_kv_heads)) == 0
        q_freq = torch.where(group_leader.view(-1, 1), rounded.view(1, -1), inv_freq.view(1, -1))
        self._write(kv_cache, qkv, ragged_batch, q_freq, rounded, self.rotary_dim)


class BlockedTrainedRotaryEmbeddings(_BlockedKVWrite):
    """Rotate queries (in place) and keys with the model's float32 ``inverse_freqs``, then copy keys and values."""

    def __call__(self, kv_cache: torch.Tensor, qkv: torch.Tensor, ragged_batch: RaggedBatchWrapper,
                 inverse_freqs: torch.Tensor) -> None:
        if inverse_freqs.dtype != torch.float32:
            raise ValueError(f"BlockedTrainedRotaryEmbeddings requires FP32 inverse frequencies, got "
                             f"{inverse_freqs.dtype}")
        rotary_dim = 2 * inverse_freqs.numel()
        if rotary_dim > self.head_size:
            raise ValueError(f"{inverse_freqs.numel()} inverse frequencies rotate more channels than the head size "
                             f"({self.head_size})")
        self._write(kv_cache, qkv, ragged_batch, inverse_freqs, inverse_freqs, rotary_dim)
