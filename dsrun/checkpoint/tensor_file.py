"""Reading only the byte ranges a rank needs from a ``torch.save`` file.

A file in torch's zipfile format stores every tensor storage as one uncompressed record. Loaded with
``map_location="meta"`` (through the same allow-list as every checkpoint file, :func:`.safe_load.load_file`),
``torch.load`` reads only the pickled index: every tensor comes back on the meta device, with its dtype, shape,
strides and storage offset, and its storage carries the record's byte offset in the file
(``untyped_storage()._checkpoint_offset``, which torch sets for exactly this use). :class:`TensorFile` then
reads any element range of such a tensor with ``os.preadv`` straight into the caller's tensor, so a resharded
load holds the rank's own share and no copy of the file (the bytes pass through the page cache, not the
process). A file in torch's legacy format (``checkpoint.checkpoint_serialization: false``) is read the same way:
its pickled index is unpickled through torch's own allow-list unpickler with every storage left on the meta
device, and each storage's byte offset is found by walking the data section that follows the index (each storage
is an 8-byte element count, then its bytes, in the order of the key list pickled after the index), so it has
record offsets too (:func:`legacy_index`). Only a legacy file that does not have that layout (a big-endian
machine's, or a pre-1.0 tar archive, which the allow-list loader refuses anyway) is loaded whole, with one
warning naming it.

Every byte read is counted in :data:`READ_STATS` (the partial-read tests and ``benchmarks/reshard_memory.py``
bound it).
"""
from __future__ import annotations

import logging
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .safe_load import load_file, safe_globals

log = logging.getLogger("dsrun.checkpoint")

# a cast (a bf16 master read into fp32) goes through a buffer of at most this many bytes
CAST_BUFFER_BYTES = 64 << 20


@dataclass
class ReadStats:
    """What this process read from checkpoint files through :class:`TensorFile`."""

    bytes_read: int = 0  # tensor bytes read by offset (partial reads and small tensors read whole)
    range_bytes: int = 0  # of those, the bytes read by element range (:meth:`TensorFile.read`: the state a load cuts)
    module_bytes: int = 0  # of those, the bytes read straight into a live module's tensors (:meth:`TensorFile.read_into`)
    files_opened: int = 0
    whole_files: int = 0  # files loaded whole (a legacy file without record offsets), their bytes in bytes_read


READ_STATS = ReadStats()


def reset_read_stats() -> ReadStats:
    """Zero :data:`READ_STATS` (and return it)."""
    READ_STATS.bytes_read = READ_STATS.range_bytes = READ_STATS.module_bytes = 0
    READ_STATS.files_opened = READ_STATS.whole_files = 0
    return READ_STATS


def _flat_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class TensorFile:
    """One checkpoint file opened for partial reads. ``objects`` is what the file holds, every tensor on the
    meta device, its storage carrying the record's offset and the file's path (``_checkpoint_path``); a legacy
    file that cannot be ranged is loaded whole (on the CPU: then reads slice it in memory). ``index=False``:
    a reader of the tensors an earlier ``TensorFile(path)`` gave, without reading the index again."""

    def __init__(self, path: str | os.PathLike[str], index: bool = True) -> None:
        self.path = Path(path)
        self.partial = True
        self._fd: int | None = None
        if not index:  # a reader of tensors an earlier TensorFile of this path left unread
            self.objects = None
            return
        if zipfile.is_zipfile(self.path):
            self.objects: Any = load_file(self.path, map_location="meta")
        else:
            self.objects = legacy_index(self.path)
            if self.objects is _NOT_RANGED:
                self.partial = False
                self.objects = load_file(self.path)
        READ_STATS.files_opened += 1
        for tensor in tensors_in(self.objects) if self.partial else []:  # each unread storage knows its file
            tensor.untyped_storage()._checkpoint_path = self.path
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

    def read_into(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """The whole ``tensor`` (one of ``objects``' tensors) into ``out``, a tensor of its shape on any device, as
        ``out.copy_`` casts: straight into ``out``'s memory where it is a contiguous CPU tensor of the same dtype,
        else through one buffer of the tensor's size."""
        before = READ_STATS.bytes_read
        with torch.no_grad():
            if (tensor.device.type == "meta" and tensor.is_contiguous() and out.device.type == "cpu"
                    and out.is_contiguous() and out.dtype == tensor.dtype and tensor.numel()):
                self._pread(self._offset(tensor, 0), out.detach())
            else:
                out.copy_(self.materialise(tensor))
        READ_STATS.module_bytes += READ_STATS.bytes_read - before

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


# --- torch's legacy (non-zip) format ----------------------------------------------------------------------
_LEGACY_MAGIC, _LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001  # torch.serialization's MAGIC_NUMBER, PROTOCOL_VERSION
_NOT_RANGED = object()
_warned: set[str] = set()


def _whole(path: Path, why: str) -> object:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning("%s: %s; this legacy-format file is read whole", path, why)
    return _NOT_RANGED


def legacy_index(path: Path) -> Any:
    """What the legacy-format (``_use_new_zipfile_serialization=False``) file ``path`` holds, every tensor on the
    meta device with its storage's byte offset in the file (``_checkpoint_offset``, as torch sets it for a zip
    file), read without any tensor's bytes; :data:`_NOT_RANGED` (after one warning naming the file) where the
    file is not laid out as that format's little-endian writer lays it out.

    The format (``torch.serialization._legacy_save``): four pickles (the magic number, the protocol version, the
    system info, the object whose storages are persistent ids ``("storage", type, key, location, numel,
    view)``), the sorted list of storage keys pickled, then every storage in that order as its element count
    (8 bytes, little-endian) followed by its bytes. Unpickled by torch's own ``weights_only`` unpickler (the
    allow-list of :func:`.safe_load.load_file`); the walk over the data section reads 8 bytes per storage and
    checks each count against the index's."""
    unpickler_module = getattr(torch, "_weights_only_unpickler", None)
    if unpickler_module is None or not hasattr(unpickler_module, "Unpickler"):
        return _whole(path, "this torch has no weights-only unpickler to read its index with")
    storages: dict[str, tuple[torch.UntypedStorage, torch.dtype, int]] = {}  # key -> (meta storage, dtype, numel)

    def persistent_load(saved_id: Any) -> Any:
        typename, storage_type, key, _location, numel, view = saved_id
        if torch.serialization._maybe_decode_ascii(typename) != "storage":
            raise ValueError(f"a persistent id of type {typename!r}")
        dtype, key = storage_type.dtype, str(torch.serialization._maybe_decode_ascii(key))
        if key not in storages:
            storages[key] = (torch.UntypedStorage(numel * torch._utils._element_size(dtype), device="meta"),
                             dtype, int(numel))
        if view is not None:  # a view of another storage: only torch before 1.x wrote these
            raise ValueError("a storage view (written by a torch older than 1.x)")
        return torch.storage.TypedStorage(wrap_storage=storages[key][0], dtype=dtype, _internal=True)

    try:
        with open(path, "rb") as handle, torch.serialization.safe_globals(safe_globals()):
            def unpickle() -> Any:
                unpickler = unpickler_module.Unpickler(handle, encoding="utf-8")
                unpickler.persistent_load = persistent_load
                return unpickler.load()

            if unpickle() != _LEGACY_MAGIC or unpickle() != _LEGACY_PROTOCOL:
                return _whole(path, "its header is not torch's legacy format's (a pre-1.0 tar archive?)")
            sys_info = unpickle()
            if not (isinstance(sys_info, dict) and sys_info.get("little_endian", True)):
                return _whole(path, "it was written on a big-endian machine (its bytes need swapping)")
            result = unpickle()
            keys = [str(torch.serialization._maybe_decode_ascii(k)) for k in unpickle()]
            position, size = handle.tell(), path.stat().st_size
            header = bytearray(8)
            for key in keys:
                storage, dtype, numel = storages[key]
                handle.seek(position)
                if handle.readinto(header) != 8 or struct.unpack("<q", header)[0] != numel:
                    return _whole(path, f"storage {key}'s element count in the data section is not the index's")
                storage._checkpoint_offset = position + 8
                position += 8 + numel * torch._utils._element_size(dtype)
            if position > size:
                return _whole(path, f"it is {size} bytes, shorter than its storages ({position} bytes): truncated?")
    except Exception as exc:  # noqa: BLE001 - anything unexpected: the whole load says what is wrong, or works
        if "Unsupported global" in str(exc) or "weights_only" in str(exc):
            load_file(path)  # the allow-list refusal, in load_file's one line
        return _whole(path, f"its index could not be read by range ({type(exc).__name__}: {exc})")
    return result
