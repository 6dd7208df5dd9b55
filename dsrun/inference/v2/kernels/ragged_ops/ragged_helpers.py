"""How DeepSpeed's ragged kernels read a ragged batch, in torch: from its metadata tensors only (the token count,
each token's sequence, each sequence's [start, tokens, seen, -] row and block-table address), as the CUDA kernels
do, so a kernel here and there see the same batch."""
from __future__ import annotations

from typing import Tuple

import torch

from ...ragged import RaggedBatchWrapper
from ...ragged.sequence_descriptor import block_ids_at


def batch_tokens(batch: RaggedBatchWrapper) -> int:
    """Real tokens of the batch (its padding excluded)."""
    return int(batch.batch_metadata_buffer()[0])


def token_positions(batch: RaggedBatchWrapper) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each real token: its sequence in the batch and its position in that sequence (tokens seen before the
    pass plus its offset in the pass), both int64."""
    n_tokens = batch_tokens(batch)
    seqs = batch.tokens_to_seq()[:n_tokens].long()
    rows = batch.inflight_seq_descriptors().long()[seqs]
    positions = rows[:, 2] + torch.arange(n_tokens, device=seqs.device) - rows[:, 0]
    return seqs, positions


def block_tables(kv_ptrs: torch.Tensor) -> torch.Tensor:
    """The block ids each address in ``kv_ptrs`` points at (a sequence's table row, allocation groups one after
    the other), one row per sequence, padded with -1 to the longest: [sequences, blocks] int64."""
    rows = [block_ids_at(int(ptr)).flatten().long() for ptr in kv_ptrs.cpu().tolist()]
    width = max((row.numel() for row in rows), default=0)
    tables = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        tables[i, :row.numel()] = row
    return tables.to(kv_ptrs.device)


def token_kv_slots(batch: RaggedBatchWrapper, block_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each real token: its position (as :func:`token_positions`), the KV-cache block and the row in that
    block it is written to."""
    seqs, positions = token_positions(batch)
    tables = block_tables(batch.kv_ptrs())
    block_index = positions // block_size
    if bool((block_index >= tables.shape[1]).any()) or bool((tables[seqs, block_index.clamp(
            max=tables.shape[1] - 1)] < 0).any()):
        raise ValueError("a token of the batch lies past the blocks its sequence's block table can hold "
                         "(KVCacheConfig.max_blocks_per_allocation_group)")
    blocks = tables[seqs, block_index]
    return positions, blocks, positions % block_size
