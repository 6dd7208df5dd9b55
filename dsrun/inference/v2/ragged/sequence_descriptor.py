"""``deepspeed.inference.v2.ragged.sequence_descriptor``: what the scheduler asks of a sequence (tokens seen,
KV blocks held). ``PlaceholderSequenceDescriptor`` checks whether a new sequence is schedulable before it is
tracked; DeepSpeed's tracked ``DSSequenceDescriptor`` holds its block table on the GPU and is not provided."""
from __future__ import annotations


class BaseSequenceDescriptor:

    @property
    def seen_tokens(self) -> int:
        """Tokens of the sequence that have completed a forward pass."""
        raise NotImplementedError()

    @property
    def cur_allocated_blocks(self) -> int:
        """KV-cache blocks held by the sequence."""
        raise NotImplementedError()

    @property
    def kv_blocks_ptr(self) -> int:
        """Address of the sequence's block table."""
        raise NotImplementedError()


class PlaceholderSequenceDescriptor(BaseSequenceDescriptor):

    def __init__(self, seen_tokens: int = 0, cur_allocated_blocks: int = 0, kv_blocks_ptr: int = 0) -> None:
        self._seen_tokens = seen_tokens
        self._cur_allocated_blocks = cur_allocated_blocks
        self._kv_blocks_ptr = kv_blocks_ptr

    @property
    def seen_tokens(self) -> int:
        return self._seen_tokens

    @property
    def cur_allocated_blocks(self) -> int:
        return self._cur_allocated_blocks

    @property
    def kv_blocks_ptr(self) -> int:
        return self._kv_blocks_ptr

