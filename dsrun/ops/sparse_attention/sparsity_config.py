"""Block-sparsity layouts of self-attention, with DeepSpeed's classes, arguments and constructions.

A layout is an int64 tensor ``[num_heads, num_blocks, num_blocks]``: entry ``(h, i, j)`` is 1 when the
queries of block row ``i`` attend to the keys of block column ``j`` in head ``h`` (a block is ``block``
consecutive tokens). Each class builds its layout from the same parts as DeepSpeed's:

* **local** windows (``Fixed``, ``Variable``): consecutive blocks attend to each other inside a window;
  ``unidirectional`` keeps only the lower triangle of each window.
* **global** blocks: every row attends to them (a column of ones); with ``horizontal_global_attention``
  (bidirectional only) they also attend to every block (a row of ones).
* **sliding** windows (``BigBird``, ``BSLongformer``, ``LocalSlidingWindow``): row ``i`` attends to
  ``i - w .. i + w`` with ``w = num_sliding_window_blocks // 2``.
* **random** blocks (``Variable``, ``BigBird``): per block row, ``random.sample`` draws that many columns
  from Python's global ``random`` generator, row by row, as DeepSpeed does (seed ``random`` for a
  reproducible layout; dsrun's runs seed it identically on every rank, and the engine broadcasts rank 0's
  layout buffer anyway).

Without ``different_layout_per_head`` head 0's layout is built and copied to every head.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

from dsrun.utils.errors import ConfigError

ATTENTION_TYPES = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION_TYPES:
        raise NotImplementedError(f"attention {attention!r} is not supported; use 'unidirectional' or 'bidirectional'")


def _check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ConfigError(f"global_block_end_indices has {len(ends)} entries but global_block_indices has "
                          f"{len(starts)}; they must have the same length")
    for start, end in zip(starts, ends):
        if start >= end:
            raise ConfigError(f"global block start index {start} must be smaller than its end index {end}")


def _check_fits(name: str, count: int, num_blocks: int) -> None:
    if num_blocks < count:
        raise ConfigError(f"{name}={count} exceeds the {num_blocks} blocks of a row "
                          "(use a longer sequence or fewer blocks)")


class SparsityConfig:
    """The shared part of every layout: heads, block size, one layout or one per head.

    Subclass it and define ``make_layout(seq_len)`` for a pattern of your own; it must return
    ``setup_layout(seq_len)`` filled with ones where blocks attend.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        if num_heads < 1 or block < 1:
            raise ConfigError(f"num_heads ({num_heads}) and block ({block}) must be positive")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout ``[num_heads, seq_len // block, seq_len // block]`` (int64, on the CPU)."""
        if seq_len % self.block:
            raise ConfigError(f"sequence length {seq_len} is not a multiple of the block size {self.block}")
        num_blocks = seq_len // self.block
        return torch.zeros(self.num_heads, num_blocks, num_blocks, dtype=torch.int64, device="cpu")

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} defines no layout: subclass SparsityConfig and "
                                  "define make_layout(seq_len)")


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block: full attention through the block-sparse path (for tests)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _set_local_window(layout: torch.Tensor, h: int, start: int, end: int, unidirectional: bool) -> None:
    """Blocks ``start..end-1`` attend to each other (only to earlier ones and themselves if unidirectional)."""
    if end <= start:  # a window that starts past the sequence
        return
    window = torch.ones(end - start, end - start, dtype=torch.bool, device=layout.device)
    layout[h, start:end, start:end].masked_fill_(window.tril() if unidirectional else window, 1)


def _set_sliding_window(layout: torch.Tensor, h: int, width: int, future: bool) -> None:
    """Row ``i`` attends to ``i - width//2 .. i + width//2`` (no later blocks when not ``future``)."""
    num_blocks = layout.shape[1]
    half = width // 2
    for row in range(num_blocks):
        end = min(row + half + 1, num_blocks) if future else row + 1
        layout[h, row, max(0, row - half):end] = 1


def _global_ranges(starts: Sequence[int], ends: Sequence[int] | None, num_blocks: int) -> list[tuple[int, int]]:
    """The global block ranges ``[start, end)`` that begin inside the sequence, clipped to it."""
    if ends is None:
        return [(start, start + 1) for start in starts if start < num_blocks]
    return [(start, min(end, num_blocks)) for start, end in zip(starts, ends) if start < num_blocks]


class FixedSparsityConfig(SparsityConfig):
    """The "fixed" pattern of Child et al., *Generative Modeling with Sparse Transformers* (arXiv:1904.10509),
    as DeepSpeed customised it: local windows of ``num_local_blocks`` blocks, and in each window the last
    ``num_global_blocks`` blocks are global (head ``h`` uses the ``h % num_different_global_patterns``-th
    group from the end, when heads have different layouts). A short last window gets its global blocks at
    the same offset, moved left if they would run past the end."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1):
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks % num_global_blocks:
            raise ConfigError(f"num_local_blocks ({num_local_blocks}) must be a multiple of num_global_blocks "
                              f"({num_global_blocks})")
        _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ConfigError("horizontal_global_attention needs attention='bidirectional'")
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ConfigError(f"num_different_global_patterns={num_different_global_patterns} needs "
                              "different_layout_per_head=True")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ConfigError(f"num_different_global_patterns ({num_different_global_patterns}) cannot exceed "
                              f"num_local_blocks // num_global_blocks ({num_local_blocks // num_global_blocks})")
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        for start in range(0, num_blocks, self.num_local_blocks):
            end = min(start + self.num_local_blocks, num_blocks)
            _set_local_window(layout, h, start, end, self.attention == "unidirectional")
        return layout

    def _set_global_columns(self, h: int, layout: torch.Tensor, start: int, end: int) -> None:
        first_row = 0 if self.attention == "bidirectional" else start
        layout[h, first_row:, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        width, count = self.num_local_blocks, self.num_global_blocks
        offset = width - (1 + h % self.num_different_global_patterns) * count  # within each window
        full_windows_end = num_blocks - num_blocks % width
        for start in range(offset, full_windows_end, width):
            self._set_global_columns(h, layout, start, start + count)
        if full_windows_end < num_blocks:  # the short last window
            start = min(full_windows_end + offset, num_blocks - count)
            self._set_global_columns(h, layout, start, start + count)
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """``Fixed`` generalised: random blocks per row, local windows of the sizes in ``local_window_blocks``
    (the last size repeats to the end), and global blocks at ``global_block_indices`` (or the ranges
    ``[global_block_indices[i], global_block_end_indices[i])``). Random blocks are drawn from every column,
    also with ``unidirectional`` attention, as in DeepSpeed."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Sequence[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ConfigError("horizontal_global_attention needs attention='bidirectional'")
        if not local_window_blocks:
            raise ConfigError("local_window_blocks must list at least one window size")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks)
        for row in range(num_blocks):
            layout[h, row, random.sample(range(num_blocks), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        unidirectional = self.attention == "unidirectional"
        start = 0
        for width in self.local_window_blocks:
            _set_local_window(layout, h, start, min(start + width, num_blocks), unidirectional)
            start += width
        width = self.local_window_blocks[-1]
        for start in range(start, num_blocks, width):
            _set_local_window(layout, h, start, min(start + width, num_blocks), unidirectional)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, num_blocks):
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig):
    """Zaheer et al., *Big Bird* (arXiv:2007.14062), block version: ``num_random_blocks`` random blocks per
    row, a sliding window of ``num_sliding_window_blocks``, and the first ``num_global_blocks`` blocks global
    both ways. ``unidirectional`` draws random blocks from earlier columns only (at most ``row + 1`` of
    them) and keeps the lower triangle of the whole layout."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks)
        for row in range(num_blocks):
            population = range(num_blocks) if self.attention == "bidirectional" else range(row + 1)
            layout[h, row, random.sample(population, min(self.num_random_blocks, len(population)))] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, future=True)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _check_fits("num_global_blocks", self.num_global_blocks, layout.shape[1])
        layout[h, :self.num_global_blocks, :] = 1
        layout[h, :, :self.num_global_blocks] = 1
        if self.attention == "unidirectional":
            layout[h] = layout[h].tril()
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Beltagy et al., *Longformer* (arXiv:2004.05150), block version: a sliding window of
    ``num_sliding_window_blocks`` plus global blocks (``global_block_indices``, or ranges up to
    ``global_block_end_indices``) that attend, and are attended, both ways. ``unidirectional`` keeps the
    lower triangle."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Sequence[int] | None = None, attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, future=True)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        num_blocks = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, num_blocks):
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        if self.attention == "unidirectional":
            layout[h] = layout[h].tril()
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Only a sliding window of ``num_sliding_window_blocks`` blocks; ``unidirectional`` (the default) keeps
    the window's past half and the diagonal. One layout for all heads."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, future=self.attention == "bidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)
