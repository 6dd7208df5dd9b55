"""``deepspeed.inference.v2.ragged.sequence_descriptor``: what the scheduler asks of a sequence (tokens seen,
KV blocks held). ``PlaceholderSequenceDescriptor`` checks whether a new sequence is schedulable before it is
tracked; ``DSSequenceDescriptor`` is a tracked one, its block ids a row of the state manager's table."""
from __future__ import annotations

import weakref
from typing import List, Tuple, Union

import torch


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



class DSSequenceDescriptor(BaseSequenceDescriptor):
    """A tracked sequence: tokens seen and in flight, and the KV-cache blocks it holds, per cache group. Its block
    ids live in one row of the state manager's block-id table (``kv_cache_ids``, shape [allocation groups,
    max blocks per group]) with a host copy (``kv_cache_ids_shadow``); ``kv_blocks_ptr`` is that row's address,
    which the ragged batch hands to the kernels (:func:`block_ids_at` reads it back)."""

    def __init__(self, tracking_id: int, kv_cache_ids: Tuple[torch.Tensor, ...],
                 kv_cache_ids_shadow: Tuple[torch.Tensor, ...], max_context: int = -1) -> None:
        self._tracking_id = tracking_id
        self._kv_cache_ids = kv_cache_ids
        self._kv_cache_ids_shadow = kv_cache_ids_shadow
        self._max_context = max_context
        self._n_cache_groups = len(kv_cache_ids)
        self._seen_tokens = 0
        self._in_flight_tokens = 0
        for ids in kv_cache_ids:
            if ids.dim() != 2:
                raise ValueError(f"kv_cache_ids must be [allocation groups, blocks per group], got {tuple(ids.shape)}")
        self._num_allocation_groups = tuple(ids.shape[0] for ids in kv_cache_ids_shadow)
        self._blocks_per_allocation_group = tuple(
            torch.zeros(groups, dtype=torch.int32) for groups in self._num_allocation_groups)

    @property
    def seen_tokens(self) -> int:
        return self._seen_tokens

    @property
    def in_flight_tokens(self) -> int:
        """Tokens that began a forward pass that has not completed."""
        return self._in_flight_tokens

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def tracking_id(self) -> int:
        """The sequence's slot in the state manager's tracking tables."""
        return self._tracking_id

    @property
    def cur_allocated_blocks(self, cache_group: int = 0) -> int:
        return int(self._blocks_per_allocation_group[cache_group].sum())

    def kv_cache_ids(self, cache_group: int = 0, on_device: bool = False) -> torch.Tensor:
        """The block ids of ``cache_group`` ([allocation groups, max blocks]), the device table or its host copy."""
        return self._kv_cache_ids[cache_group] if on_device else self._kv_cache_ids_shadow[cache_group]

    @property
    def kv_blocks_ptr(self, cache_group: int = 0) -> int:
        return self._kv_cache_ids[cache_group].data_ptr()

    def all_block_ids(self, cache_group: int = 0) -> torch.Tensor:
        """Every block the sequence holds in ``cache_group``, allocation group after allocation group."""
        return torch.cat([ids[:count] for ids, count in zip(self._kv_cache_ids[cache_group],
                                                             self._blocks_per_allocation_group[cache_group].tolist())])

    def pre_forward(self, num_tokens: int) -> None:
        """``num_tokens`` of the sequence enter the next forward pass."""
        self._in_flight_tokens = num_tokens

    def post_forward(self) -> None:
        """The forward pass completed: the tokens in flight are seen."""
        self._seen_tokens += self._in_flight_tokens
        self._in_flight_tokens = 0

    def extend_kv_cache(self, new_ids: Union[List[torch.Tensor], torch.Tensor], cache_group: int = 0) -> None:
        """Append blocks (one tensor per allocation group, or one tensor for a single group) to the sequence."""
        if isinstance(new_ids, torch.Tensor):
            new_ids = [new_ids]
        if len(new_ids) != self._num_allocation_groups[cache_group]:
            raise ValueError(f"Only {len(new_ids)} allocation groups provided, expected "
                             f"{self._num_allocation_groups[cache_group]}")
        counts = self._blocks_per_allocation_group[cache_group]
        for group, ids in enumerate(new_ids):
            start, added = int(counts[group]), ids.numel()
            if added == 0:
                continue
            shadow = self._kv_cache_ids_shadow[cache_group][group]
            if start + added > shadow.numel():
                raise ValueError(f"A sequence holds at most {shadow.numel()} blocks per allocation group "
                                 f"(KVCacheConfig.max_blocks_per_allocation_group); {start + added} asked")
            shadow[start:start + added].copy_(ids.flatten())
            self._kv_cache_ids[cache_group][group][start:start + added].copy_(shadow[start:start + added])
            counts[group] += added

    def free_kv_cache(self, free_ids: Union[List[torch.Tensor], torch.Tensor], cache_group: int = 0) -> None:
        raise NotImplementedError("Partial KV-cache freeing is not yet supported.")


_BLOCK_ID_TABLES: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()


def register_block_ids(table: torch.Tensor) -> None:
    """Make the rows of ``table`` (a state manager's [sequences, allocation groups, max blocks] int32 block-id
    table) findable by address: DeepSpeed's kernels dereference ``kv_blocks_ptr``, the torch kernels here read the
    row back with :func:`block_ids_at`."""
    _BLOCK_ID_TABLES.add(table)


def block_ids_at(ptr: int) -> torch.Tensor:
    """The [allocation groups, max blocks] block-id row whose address is ``ptr`` (a ``kv_blocks_ptr``)."""
    for table in list(_BLOCK_ID_TABLES):
        row_bytes = table[0].numel() * table.element_size()
        offset = ptr - table.data_ptr()
        if 0 <= offset < table.numel() * table.element_size() and offset % row_bytes == 0:
            return table[offset // row_bytes]
    raise ValueError(f"kv_blocks_ptr {ptr:#x} is not a tracked sequence's block table: a sequence whose KV cache a "
                     "kernel reads must come from a DSStateManager (PlaceholderSequenceDescriptor only schedules)")
