"""This rank's slice of a batch under sequence parallelism, so the rank never keeps whole sequences.

A sequence-parallel group reads the same samples; each of its P ranks trains on the slice
``[i·T/P, (i+1)·T/P)`` of every sequence. :func:`shard_sequence` copies that slice out of the loaded batch, so
the whole batch can be freed before the forward and the rank holds 1/P of the tokens, as it holds 1/P of the
activations (the built-in GPT takes the slices with ``sequence_sharded=True``).
"""
from __future__ import annotations

import torch

from dsrun.sequence import groups
from dsrun.utils.errors import UserError


def sequence_slice(length: int) -> tuple[int, int]:
    """(start, length) of this sequence-parallel rank's slice of a sequence of ``length`` tokens."""
    shards = groups._get_sequence_parallel_world_size()
    if length % shards:
        raise UserError(f"sequence length {length} does not split over sequence_parallel_size={shards} ranks "
                        "(make data.seq_len a multiple of it)")
    piece = length // shards
    return groups._get_sequence_parallel_rank() * piece, piece


def shard_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This sequence-parallel rank's slice of ``tensor`` along ``dim`` (the sequence), in its own storage; the
    tensor itself when sequence parallelism is off."""
    if groups._get_sequence_parallel_world_size() == 1:
        return tensor
    start, piece = sequence_slice(tensor.size(dim))
    return tensor.narrow(dim, start, piece).clone(memory_format=torch.contiguous_format)
