"""``deepspeed.inference.v2.ragged.ragged_wrapper``: ``RaggedBatchWrapper``, one forward pass's ragged batch.

The sequences' tokens are concatenated (no padding between sequences); the kernels read the batch through its
metadata, each a device tensor with a host copy filled first:

- ``input_ids`` [tokens]: the token ids; ``tokens_to_seq`` [tokens]: each token's sequence in the batch;
- ``batch_metadata_buffer`` [2]: tokens, sequences;
- ``inflight_seq_descriptors`` [sequences, 4]: a sequence's first token in the batch, its tokens in this pass,
  the tokens it had seen before, and an unused column;
- ``kv_ptrs`` [sequences]: the address of each sequence's block-id table (``kv_blocks_ptr``).

``finalize(padding=True)`` pads the token count to a multiple of 64 (128 above 512 tokens), the padded tokens'
ids and sequences -1, for batches whose shape must not change between passes."""
from __future__ import annotations

from typing import Optional

import torch

from ..allocator import current_device
from .manager_configs import DSStateManagerConfig
from .ragged_manager import fast_host_buffer
from .sequence_descriptor import BaseSequenceDescriptor


def to_padded(original_size: int) -> int:
    """``original_size`` tokens rounded up to the padded batch's granularity (64, or 128 above 512)."""
    granularity = 64 if original_size <= 512 else 128
    return -(-original_size // granularity) * granularity


class RaggedBatchWrapper:

    def __init__(self, config: DSStateManagerConfig) -> None:
        self._config = config
        device = current_device()
        self._input_ids = torch.zeros(config.max_ragged_batch_size, dtype=torch.int64, device=device)
        self._batch_metadata_storage = torch.zeros(2, dtype=torch.int32, device=device)
        self._token_to_seq_storage = torch.zeros(config.max_ragged_batch_size, dtype=torch.int32, device=device)
        self._inflight_seq_descriptors = torch.zeros((config.max_ragged_sequence_count, 4), dtype=torch.int32,
                                                     device=device)
        self._kv_ptrs = torch.zeros(config.max_ragged_sequence_count, dtype=torch.int64, device=device)
        self._input_ids_shadow = fast_host_buffer(self._input_ids)
        self._batch_metadata_storage_shadow = fast_host_buffer(self._batch_metadata_storage)
        self._token_to_seq_storage_shadow = fast_host_buffer(self._token_to_seq_storage)
        self._inflight_seq_descriptors_shadow = fast_host_buffer(self._inflight_seq_descriptors)
        self._kv_ptrs_shadow = fast_host_buffer(self._kv_ptrs)
        self._is_padded = False
        self.clear()

    def clear(self) -> None:
        """Empty the batch (no tokens, no sequences)."""
        self._current_tokens = 0
        self._current_sequences = 0
        self._batch_tokens = []
        self._seq_rows = []
        self._kv_blocks_ptr_buf = []
        self._token_to_seq_buf = []

    def insert_sequence(self, seq_descriptor: BaseSequenceDescriptor, tokens: torch.Tensor,
                        do_checks: bool = True) -> None:
        """Append a sequence's ``tokens`` (a host tensor) to the batch; RuntimeError when the batch's sequence or
        token limit (``max_ragged_sequence_count``, ``max_ragged_batch_size``) would be passed."""
        if tokens.device != torch.device("cpu"):
            raise RuntimeError(f"Expected tokens to be on host but found device '{tokens.device}'")
        if do_checks and self._current_sequences == self._config.max_ragged_sequence_count:
            raise RuntimeError(f"Ragged batch is full due to sequence limit: {self._config.max_ragged_sequence_count}")
        seq_tokens = tokens.numel()
        if do_checks and self._current_tokens + seq_tokens > self._config.max_ragged_batch_size:
            raise RuntimeError(f"Ragged batch is full due to capacity limit: {self._config.max_ragged_batch_size})")
        self._batch_tokens.append(tokens.flatten())
        self._seq_rows.append((self._current_tokens, seq_tokens, seq_descriptor.seen_tokens, 0))
        self._token_to_seq_buf.extend([self._current_sequences] * seq_tokens)
        self._kv_blocks_ptr_buf.append(seq_descriptor.kv_blocks_ptr)
        self._current_tokens += seq_tokens
        self._current_sequences += 1

    @property
    def tensor_toks(self) -> int:
        """Tokens of the batch as its tensors hold them (padded when finalized with padding)."""
        return to_padded(self._current_tokens) if self._is_padded else self._current_tokens

    def finalize(self, padding: Optional[bool] = False) -> None:
        """Write the metadata into the host buffers and copy them to the device ones."""
        tokens, sequences = self._current_tokens, self._current_sequences
        if sequences:
            self._inflight_seq_descriptors_shadow[:sequences].copy_(torch.tensor(self._seq_rows, dtype=torch.int32))
            self._input_ids_shadow[:tokens].copy_(torch.cat(self._batch_tokens))
            self._token_to_seq_storage_shadow[:tokens].copy_(torch.tensor(self._token_to_seq_buf, dtype=torch.int32))
            self._kv_ptrs_shadow[:sequences].copy_(torch.tensor(self._kv_blocks_ptr_buf, dtype=torch.int64))
        self._batch_metadata_storage_shadow.copy_(torch.tensor([tokens, sequences], dtype=torch.int32))
        padded = to_padded(tokens) if padding else tokens  # past max_ragged_batch_size the buffers clip it
        self._input_ids_shadow[tokens:padded].fill_(-1)
        self._token_to_seq_storage_shadow[tokens:padded].fill_(-1)
        self._is_padded = bool(padding)
        self._input_ids[:padded].copy_(self._input_ids_shadow[:padded], non_blocking=True)
        self._batch_metadata_storage.copy_(self._batch_metadata_storage_shadow, non_blocking=True)
        self._token_to_seq_storage[:padded].copy_(self._token_to_seq_storage_shadow[:padded], non_blocking=True)
        self._inflight_seq_descriptors[:sequences].copy_(self._inflight_seq_descriptors_shadow[:sequences],
                                                         non_blocking=True)
        self._kv_ptrs[:sequences].copy_(self._kv_ptrs_shadow[:sequences], non_blocking=True)

    def input_ids(self, on_device: bool = True) -> torch.Tensor:
        """The token ids (on the device: the batch's tokens, padding included; on the host: the whole buffer)."""
        return self._input_ids[:self.tensor_toks] if on_device else self._input_ids_shadow

    def batch_metadata_buffer(self, on_device: bool = True) -> torch.Tensor:
        """[tokens, sequences] of the batch."""
        return self._batch_metadata_storage if on_device else self._batch_metadata_storage_shadow

    def tokens_to_seq(self, on_device: bool = True) -> torch.Tensor:
        """Each token's sequence in the batch (-1 for padding)."""
        return self._token_to_seq_storage[:self.tensor_toks] if on_device else self._token_to_seq_storage_shadow

    def inflight_seq_descriptors(self, on_device: bool = True) -> torch.Tensor:
        """Per sequence: [first token in the batch, tokens in this pass, tokens seen before, unused]."""
        if on_device:
            return self._inflight_seq_descriptors[:self._current_sequences]
        return self._inflight_seq_descriptors_shadow

    def kv_ptrs(self, on_device: bool = True) -> torch.Tensor:
        """Per sequence: the address of its block-id table."""
        return self._kv_ptrs[:self._current_sequences] if on_device else self._kv_ptrs_shadow

    def masks(self, on_device: bool = True) -> Optional[torch.Tensor]:
        """Arbitrary attention masks are not supported (DeepSpeed's placeholder): None."""
        return None

    @property
    def current_tokens(self) -> int:
        return self._current_tokens

    @property
    def current_sequences(self) -> int:
        return self._current_sequences
