"""The I/O buffers of the fast writer (DeepSpeed's ``Single_IO_Buffer`` / ``Double_IO_Buffer``).

A buffer is filled from the bytes ``torch.save`` hands the writer and drained into the file by the async I/O
handle, always in whole multiples of the handle's alignment so the descriptor can use O_DIRECT. The double
buffer splits the memory in two halves: while one half is being written (asynchronously), the next bytes fill
the other; a drain first waits for the previous one. The single buffer drains synchronously.
"""
from __future__ import annotations

import errno
import os
from typing import Protocol

import torch


class DrainHandle(Protocol):
    """What a buffer needs of DeepSpeed's ``aio_handle`` (``dsrun.ops.aio.AsyncIOHandle``)."""

    def async_pwrite(self, buffer: torch.Tensor, filename: int, file_offset: int = 0) -> int: ...

    def wait(self) -> int: ...

    def get_alignment(self) -> int: ...


class IOBuffer:
    """One or two fill/drain halves of ``pinned_tensor`` (a 1-D uint8, page-aligned CPU tensor)."""

    def __init__(self, pinned_tensor: torch.Tensor, dnvme_handle: DrainHandle, halves: int) -> None:
        alignment = dnvme_handle.get_alignment()
        if pinned_tensor.dtype != torch.uint8 or pinned_tensor.dim() != 1:
            raise ValueError(f"the I/O buffer must be a 1-D uint8 tensor, got {pinned_tensor.dtype} "
                             f"with shape {tuple(pinned_tensor.shape)}")
        if pinned_tensor.numel() == 0 or pinned_tensor.numel() % (halves * alignment):
            raise ValueError(f"the I/O buffer holds {pinned_tensor.numel()} bytes; it must be a positive multiple of "
                             f"{halves * alignment} ({halves} x the I/O alignment {alignment})")
        self._handle = dnvme_handle
        self._alignment = alignment
        size = pinned_tensor.numel() // halves
        self._halves = [pinned_tensor.narrow(0, i * size, size) for i in range(halves)]
        self._views = [memoryview(h.numpy()) for h in self._halves]
        self._fill_index = 0
        self._offset = 0
        self._draining = False

    def fill(self, src: memoryview, src_offset: int) -> int:
        """Copy bytes of ``src`` from ``src_offset`` into the current half; returns how many fitted."""
        dst = self._views[self._fill_index]
        n = min(len(src) - src_offset, len(dst) - self._offset)
        if n > 0:
            dst[self._offset:self._offset + n] = src[src_offset:src_offset + n]
            self._offset += n
        return n

    def drain(self, num_bytes: int, fd: int, file_offset: int) -> None:
        """Write the current half's first ``num_bytes`` (a multiple of the alignment) at ``file_offset``."""
        assert num_bytes % self._alignment == 0 and num_bytes <= self._offset
        self.complete_ongoing_drain()
        self._handle.async_pwrite(self._halves[self._fill_index].narrow(0, 0, num_bytes), fd, file_offset)
        self._draining = True
        if len(self._halves) == 1:
            self.complete_ongoing_drain()
        self._fill_index = (self._fill_index + 1) % len(self._halves)
        self._offset = 0

    def complete_ongoing_drain(self) -> None:
        if self._draining:
            self._draining = False
            try:
                self._handle.wait()
            except RuntimeError as err:
                raise as_os_error(err) from err

    def get_buffer(self) -> torch.Tensor:
        return self._halves[self._fill_index]

    def get_offset(self) -> int:
        return self._offset

    def get_aligned_num_bytes(self) -> int:
        return self._offset // self._alignment * self._alignment

    def get_unaligned_num_bytes(self) -> int:
        return self._offset % self._alignment

    def is_full(self) -> bool:
        return self._offset == self._halves[self._fill_index].numel()

    def is_empty(self) -> bool:
        return self._offset == 0 and not self._draining

    def reset(self) -> None:
        self._offset = 0


class Single_IO_Buffer(IOBuffer):
    """DeepSpeed's name: the whole tensor, drained synchronously."""

    def __init__(self, pinned_tensor: torch.Tensor, dnvme_handle: DrainHandle) -> None:
        super().__init__(pinned_tensor, dnvme_handle, halves=1)


class Double_IO_Buffer(IOBuffer):
    """DeepSpeed's name: two halves, one filled while the other is written."""

    def __init__(self, pinned_tensor: torch.Tensor, dnvme_handle: DrainHandle) -> None:
        super().__init__(pinned_tensor, dnvme_handle, halves=2)


def as_os_error(err: RuntimeError) -> Exception:
    """The async I/O op reports a failed write as a RuntimeError carrying strerror's text; a full disk or quota
    becomes the OSError it was, so a save's full-disk handling (``dsrun.checkpoint.atomic.disk_full``) sees it."""
    for code in (errno.ENOSPC, errno.EDQUOT):
        if os.strerror(code) in str(err):
            return OSError(code, str(err))
    return err
