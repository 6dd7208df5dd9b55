"""Reading only the byte ranges a rank needs from a ``torch.save`` file.

A file in torch's zipfile format stores every tensor storage as one uncompressed record. Loaded with
``map_location="meta"`` (through the same allow-list as every checkpoint file, :func:`.safe_load.load_file`),
``torch.load`` reads only the pickled index: every tensor comes back on the meta device, with its dtype, shape,
strides and storage offset, and its storage carries the record's byte offset in the file
(``untyped_storage()._checkpoint_offset``, which torch sets for exactly this use). :class:`TensorFile` then
reads any element range of such a tensor with ``os.preadv`` straight into the caller's tensor, so a resharded
load holds the rank's own share and no copy of the file (the bytes pass through the page cache, not the
process). A file in torch's legacy format (``checkpoint.checkpoint_serialization: false``) has no record
offsets and is loaded whole, as before.

Every byte read is counted in :data:`READ_STATS` (the partial-read tests and ``benchmarks/reshard_memory.py``
bound it).
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .safe_load import load_file

# a cast (a bf16 master read into fp32) goes through a buffer of at most this many bytes
CAST_BUFFER_BYTES = 64 << 20


@dataclass
class ReadStats:
    """What this process read from checkpoint files through :class:`TensorFile`."""

    bytes_read: int = 0  # tensor bytes read by offset (partial reads and small tensors read whole)
    range_bytes: int = 0  # of those, the bytes read by element range (:meth:`TensorFile.read`: the state a load cuts)
    files_opened: int = 0
    whole_files: int = 0  # files loaded whole (legacy format), their bytes counted in bytes_read


READ_STATS = ReadStats()


def reset_read_stats() -> ReadStats:
    """Zero :data:`READ_STATS` (and return it)."""
    READ_STATS.bytes_read = READ_STATS.range_bytes = READ_STATS.files_opened = READ_STATS.whole_files = 0
    return READ_STATS


def _flat_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class TensorFile:
    """One checkpoint file opened for partial reads. ``objects`` is what the file holds, every tensor on the
    meta device (or, for a legacy-format file, on the CPU: then reads slice it in memory)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.partial = zipfile.is_zipfile(self.path)
        self.objects: Any = load_file(self.path, map_location="meta" if self.partial else "cpu")
        self._fd: int | None = None
        READ_STATS.files_opened += 1
        if not self.partial:
            READ_STATS.whole_files += 1
            READ_STATS.bytes_read += self.path.stat().st_size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pread(self, offset: int, out: torch.Tensor) -> None:
        """The file's bytes from ``offset`` into the contiguous tensor ``out``."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        view = _flat_bytes(out)
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise EOFError(f"{self.path}: the file ends inside a tensor (at byte {offset + done}); it is truncated")
            done += got
        READ_STATS.bytes_read += done

    def _offset(self, tensor: torch.Tensor, element: int) -> int:
        offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
        if offset is None:
            raise RuntimeError(f"{self.path}: a tensor without its record offset (not read through TensorFile?)")
        return int(offset) + (tensor.storage_offset() + element) * tensor.element_size()

    def read(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of the flattened ``tensor`` (one of ``objects``' tensors)
        into the 1-D tensor ``out``, cast to its dtype as ``out.copy_`` casts."""
        count = out.numel()
        if count == 0:
            return
        if tensor.device.type != "meta":
            out.copy_(tensor.reshape(-1)[start:start + count])
            return
        if not tensor.is_contiguous():
            out.copy_(self.materialise(tensor).reshape(-1)[start:start + count])
            return
        READ_STATS.range_bytes += count * tensor.element_size()
        if out.dtype == tensor.dtype and out.is_contiguous():
            self._pread(self._offset(tensor, start), out)
            return
        chunk = max(1, CAST_BUFFER_BYTES // tensor.element_size())
        buffer = torch.empty(min(chunk, count), dtype=tensor.dtype)
        for first in range(0, count, chunk):
            part = buffer[:min(chunk, count - first)]
            self._pread(self._offset(tensor, start + first), part)
            out[first:first + part.numel()].copy_(part)

    def materialise(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole ``tensor`` read into CPU memory (its own storage, its shape and strides)."""
        if tensor.device.type != "meta":
            return tensor
        if tensor.numel() == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        storage = torch.empty(span, dtype=tensor.dtype)
        self._pread(self._offset(tensor, 0), storage)
        return storage.as_strided(tensor.shape, tensor.stride(), 0)

    def materialise_all(self, obj: Any, keep: set[int]) -> Any:
        """``obj`` (part of ``objects``) with every meta tensor whose ``id`` is not in ``keep`` read whole, in
        place where the container allows it (dicts, lists, pickled objects' attributes; tuples are rebuilt)."""
        if torch.is_tensor(obj):
            return obj if id(obj) in keep else self.materialise(obj)
        if isinstance(obj, dict):
            for key, value in obj.items():
                obj[key] = self.materialise_all(value, keep)
            return obj
        if isinstance(obj, list):
            obj[:] = [self.materialise_all(value, keep) for value in obj]
            return obj
        if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
            items = [self.materialise_all(value, keep) for value in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            for key, value in vars(obj).items():
                setattr(obj, key, self.materialise_all(value, keep))
        return obj


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (dicts, lists, tuples, pickled objects' attributes)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        values: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        values = vars(obj).values()
    else:
        return []
    return [t for value in values for t in tensors_in(value)]


def has_unread(obj: object) -> bool:
    """Whether ``obj`` holds a tensor left unread (on the meta device) by a :class:`TensorFile`."""
    return any(t.device.type == "meta" for t in tensors_in(obj))


def read_unread(path: str | os.PathLike[str], obj: object) -> Any:
    """``obj`` (part of what the file ``path`` holds, opened through a :class:`TensorFile`) with every tensor
    left unread read whole, in place where the container allows it."""
    if not has_unread(obj):
        return obj
    with TensorFile(path) as file:
        return file.materialise_all(obj, set())
