"""Next-token windows over a flat token array.

Window ``i`` starts at token ``i * seq_len``: ``inputs`` are ``seq_len`` tokens from there and ``targets`` the
same span shifted by one, so windows never overlap and the last target of one window is the first input of
the next. The array may be a memory map of any integer dtype; windows come out as int64 tensors.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from dsrun.utils.errors import Problem, UserError


class TokenWindows(Dataset):
    """``dataset[i] == (inputs, targets)``, each an int64 tensor of shape ``[seq_len]``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "data"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise UserError(Problem("data.seq_len", f"must be a positive integer, got {seq_len!r}"))
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def window_span(self, index: int) -> tuple[int, int]:
        """The token positions ``[start, stop)`` that window ``index`` reads (inputs and targets)."""
        start = index * self.seq_len
        return start, start + self.seq_len + 1

    def _window(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows of {self.name}")
        start, stop = self.window_span(index)
        return np.asarray(self.tokens[start:stop], dtype=np.int64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self._window(index))
        return window[:-1], window[1:]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``indices`` stacked into ``(inputs, targets)`` of shape ``[len(indices), seq_len]``."""
        index = np.asarray(indices, dtype=np.int64)
        if len(index) and (index.min() < 0 or index.max() >= len(self)):
            bad = index[(index < 0) | (index >= len(self))][0]
            raise IndexError(f"window {bad} out of range for {len(self)} windows of {self.name}")
        positions = index[:, None] * self.seq_len + np.arange(self.seq_len + 1)  # one gather for all windows
        windows = torch.from_numpy(np.asarray(self.tokens[positions], dtype=np.int64))
        return windows[:, :-1], windows[:, 1:]
