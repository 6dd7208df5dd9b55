"""DeepSpeed's ragged token kernels at the two ends of the model (``embed``, ``logits_gather``): the embedding
lookup of a ragged batch's real tokens (padding rows are left untouched), with an optional learned positional
embedding read at ``position_embed_offset`` + the token's position in its sequence; and the gather of each
sequence's last token's hidden state, the only one the unembedding needs."""
from __future__ import annotations

from typing import Optional

import torch

from ...inference_utils import elem_size
from ...ragged import RaggedBatchWrapper
from .. import DSKernelBase
from .ragged_helpers import batch_tokens, token_positions


class RaggedEmbeddingKernel(DSKernelBase):
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_token_dtypes = [torch.int32, torch.int64]

    def __init__(self, embed_dtype: torch.dtype, token_dtype: torch.dtype, embed_dim: int) -> None:
        if embed_dtype not in RaggedEmbeddingKernel.supported_dtypes:
            raise ValueError(f"Unsupported embedding data type: {embed_dtype}, supported_dtypes are "
                             f"{RaggedEmbeddingKernel.supported_dtypes}")
        if token_dtype not in RaggedEmbeddingKernel.supported_token_dtypes:
            raise ValueError(f"Unsupported token data type: {token_dtype}, supported_dtypes are "
                             f"{RaggedEmbeddingKernel.supported_token_dtypes}")
        if elem_size(embed_dtype) * embed_dim % 16 != 0:
            raise ValueError(f"Embedding dimension must be aligned to 16 bytes, got {embed_dim}")
        self.embed_dim = embed_dim

    def __call__(self, embedded_tokens: torch.Tensor, ragged_wrapper: RaggedBatchWrapper,
                 embedding_weight: torch.Tensor, position_embed_weight: Optional[torch.Tensor] = None,
                 position_embed_offset: int = 0) -> torch.Tensor:
        """``embedded_tokens`` [tokens (padded), embed_dim] gets row ``t`` = ``embedding_weight[id_t]`` (+ the
        positional row) for each real token ``t``."""
        n_tokens = batch_tokens(ragged_wrapper)
        ids = ragged_wrapper.input_ids()[:n_tokens].long()
        rows = embedding_weight[ids].float()
        if position_embed_weight is not None:
            _, positions = token_positions(ragged_wrapper)
            rows = rows + position_embed_weight[positions + position_embed_offset].float()
        embedded_tokens[:n_tokens] = rows.to(embedded_tokens.dtype)
        return embedded_tokens


class RaggedLogitsGather(DSKernelBase):
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]

    def __init__(self, model_dim: int, fp_dtype: torch.dtype) -> None:
        if fp_dtype not in RaggedLogitsGather.supported_dtypes:
            raise ValueError(f"Unsupported data type: {fp_dtype}, supported_dtypes are "
                             f"{RaggedLogitsGather.supported_dtypes}")
        if elem_size(fp_dtype) * model_dim % 16 != 0:
            raise ValueError(f"Embedding dimension must be aligned to 16 bytes, got {model_dim}")

    def __call__(self, final_token_activations: torch.Tensor, all_activations: torch.Tensor,
                 ragged_wrapper: RaggedBatchWrapper) -> torch.Tensor:
        """Row ``s`` of ``final_token_activations`` [sequences, model_dim] = the last token of sequence ``s``."""
        n_seqs = int(ragged_wrapper.batch_metadata_buffer()[1])
        rows = ragged_wrapper.inflight_seq_descriptors()[:n_seqs].long()
        final_token_activations[:n_seqs] = all_activations[rows[:, 0] + rows[:, 1] - 1]
        return final_token_activations
