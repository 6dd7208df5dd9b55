"""DeepSpeed's blocked attention (``blocked_flash``, ``atom_builder``): causal attention of a ragged batch's queries
over its sequences' blocked KV cache, split into "atoms".

An atom is up to ``q_block_size`` consecutive query tokens of one sequence, one int32 row of 8:
``[block table address (2 words), first query token in the batch, query tokens, KV blocks, KV tokens (the
attended extent), position of the first query token, unused]``. :class:`AtomBuilder` fills them on the host
from the batch's metadata; :class:`BlockedFlashAttn` runs each: query ``i`` of an atom attends to the KV tokens
``0 .. global_q_idx + i`` of its sequence, GQA query head ``h`` to KV head ``h // (q heads / kv heads)``, scores
scaled by ``softmax_scale``, computed in float32 (the CUDA kernel is FlashAttention-2 on tensor cores)."""
from __future__ import annotations

from typing import Tuple

import torch

from ...inference_utils import DtypeEnum
from ...ragged import RaggedBatchWrapper
from ...ragged.sequence_descriptor import block_ids_at
from .. import DSKernelBase


def _compute_capability() -> Tuple[int, int]:
    """The CUDA device's (major, minor); without one, (8, 0), the A100's, whose block sizes the CPU path takes."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()
    return 8, 0


def get_q_block_size(head_size: int) -> int:
    """Query tokens per atom for ``head_size`` (DeepSpeed's table, by compute capability)."""
    major, minor = _compute_capability()
    if major < 8:
        raise RuntimeError("Blocked attention requires CUDA compute capability >= 8.0")
    if head_size <= 64 or head_size == 192:
        return 128
    if head_size <= 160 or head_size == 224:
        return 64 if minor != 0 else 128
    return 128 if (major, minor) == (8, 0) else 64


def get_kv_block_size(head_size: int) -> int:
    """Tokens per KV-cache block the attention prefers for ``head_size``."""
    major, minor = _compute_capability()
    if major < 8:
        raise RuntimeError("Blocked attention requires CUDA compute capability >= 8.0")
    if head_size <= 64:
        return 128
    return 64 if head_size != 160 or minor != 0 else 32


class AtomBuilder(DSKernelBase):
    """Fill the attention atoms of a ragged batch (a host int32 tensor [max_atoms, 8])."""

    def __init__(self) -> None:
        pass

    def __call__(self, atoms: torch.Tensor, ragged_batch: RaggedBatchWrapper, q_block_size: int,
                 kv_block_size: int) -> Tuple[torch.Tensor, int]:
        """Returns ``atoms`` and how many rows were filled."""
        if atoms.device != torch.device("cpu"):
            raise RuntimeError("AtomBuilder must be called on tensors")
        n_seqs = int(ragged_batch.batch_metadata_buffer(on_device=False)[1])
        rows = ragged_batch.inflight_seq_descriptors(on_device=False)[:n_seqs].tolist()
        ptrs = ragged_batch.kv_ptrs(on_device=False)[:n_seqs].tolist()
        built = []
        for (start, n_tokens, seen, _), ptr in zip(rows, ptrs):
            for first in range(0, n_tokens, q_block_size):
                q_len = min(q_block_size, n_tokens - first)
                end = seen + first + q_len
                built.append((ptr, start + first, q_len, -(-end // kv_block_size), end, seen + first))
        if len(built) > atoms.shape[0]:
            raise ValueError(f"The batch needs {len(built)} attention atoms; the atoms tensor holds {atoms.shape[0]}")
        if built:
            table = torch.tensor(built, dtype=torch.int64)
            filled = atoms[:len(built)]
            filled[:, 2:7] = table[:, 1:].to(torch.int32)
            filled[:, 7] = 0
            filled[:, :2] = table[:, :1].view(torch.int32).view(-1, 2)  # the address, as the CUDA struct holds it
        return atoms, len(built)


class BlockedFlashAttn(DSKernelBase):
    """Causal attention by atoms over a blocked KV cache."""
    supported_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16]

    def __init__(self, head_size: int, dtype: DtypeEnum) -> None:
        dtype = DtypeEnum(dtype)
        if dtype not in BlockedFlashAttn.supported_dtypes:
            raise ValueError(f"Unsupported data type: {dtype}, supported data types are "
                             f"{BlockedFlashAttn.supported_dtypes}")
        if head_size % 16 != 0:
            raise ValueError(f"Head size must be divisible by 16 (configured with {head_size})")
        self.head_size = head_size

    def __call__(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, atoms: torch.Tensor,
                 softmax_scale: float) -> torch.Tensor:
        """``out``/``q`` [tokens, q heads * head_size]; ``k``/``v`` [blocks, block_size, kv heads, head_size];
        ``atoms`` [n_atoms, 8] as :class:`AtomBuilder` fills them."""
        head = self.head_size
        n_q, n_kv, block_size = q.shape[1] // head, k.shape[2], k.shape[1]
        host_atoms = atoms.cpu()
        ptrs = host_atoms[:, :2].contiguous().view(torch.int64).flatten().tolist()
        for ptr, (q_start, q_len, kv_blocks, extent, first_pos) in zip(ptrs, host_atoms[:, 2:7].tolist()):
            if kv_blocks != -(-extent // block_size):
                raise ValueError(f"an atom spans {kv_blocks} KV blocks for {extent} tokens, the cache holds {block_size} "
                                 "tokens a block: build the atoms with the cache's block size (kv_block_size)")
            blocks = block_ids_at(ptr).flatten()[:kv_blocks].long().to(k.device)
            keys = k[blocks].reshape(-1, n_kv, head)[:extent].float().repeat_interleave(n_q // n_kv, dim=1)
            values = v[blocks].reshape(-1, n_kv, head)[:extent].float().repeat_interleave(n_q // n_kv, dim=1)
            query = q[q_start:q_start + q_len].reshape(q_len, n_q, head).float()
            scores = torch.einsum("qhd,khd->hqk", query, keys) * softmax_scale
            positions = first_pos + torch.arange(q_len, device=q.device)
            future = torch.arange(extent, device=q.device).view(1, -1) > positions.view(-1, 1)
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            out[q_start:q_start + q_len] = torch.einsum("hqk,khd->qhd", probs, values).reshape(q_len, -1).to(out.dtype)
        return out
