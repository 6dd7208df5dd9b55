"""``open_writer(path, settings)``: the file object a checkpoint file is written through.

``settings`` (:class:`WriterSettings`, from the ``checkpoint.writer`` and ``aio`` sections) picks the writer:
None (no ``checkpoint.writer`` section) a plain buffered file; ``PYTHON`` DeepSpeed's ``PyFileWriter``;
``FAST`` its ``FastFileWriter`` over a process-wide async I/O handle and I/O buffer (reused from file to file,
as DeepSpeed's writer factory does); ``MOCK`` its ``MockFileWriter`` (the file is left empty). Whatever the
writer, closing the object leaves the file durable (fsynced), which the atomic saves rely on, and with
``show_statistics`` logs the writer's statistics.

:meth:`CheckpointFile.save` is ``torch.save`` into it; through the fast writer with torch's own CRC32 off for that
save (the writer computes every record's CRC32 on other threads and fills it in: the same bytes, see
:mod:`.zip_crc`).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsrun.ops.aio import AsyncIOHandle
from .base_file_writer import BaseFileWriter
from .constants import INVALID_FD
from .fast_file_writer import FastFileWriter, FastFileWriterConfig
from .mock_file_writer import MockFileWriter
from .py_file_writer import PyFileWriter

if TYPE_CHECKING:
    from dsrun.config.recent import CheckpointWriterConfig
    from dsrun.config.zero import AIOConfig

WRITER_TYPES = ("MOCK", "PYTHON", "FAST")


@dataclass(frozen=True)
class WriterSettings:
    """Which writer checkpoint files go through, and the fast writer's buffer and I/O settings."""

    type: str = "FAST"
    io_buffer_size: int = 64 * 1024 ** 2
    io_buffer_double: bool = True
    show_statistics: bool = False
    aio: tuple[tuple[str, Any], ...] = ()  # the ``aio`` section's items (the fast writer's handle)

    def __post_init__(self) -> None:
        if self.type not in WRITER_TYPES:
            raise ValueError(f"checkpoint writer type: got {self.type!r}; expected one of {', '.join(WRITER_TYPES)}")

    @classmethod
    def from_config(cls, writer: "CheckpointWriterConfig | None", aio: "AIOConfig | None" = None
                    ) -> "WriterSettings | None":
        """The settings of a ``checkpoint.writer`` section (None: no section, plain files)."""
        if writer is None:
            return None
        aio_items = tuple(sorted(aio.model_dump().items())) if aio is not None else ()
        return cls(type=writer.type, io_buffer_size=int(writer.io_buffer_size),
                   io_buffer_double=bool(writer.io_buffer_double), show_statistics=bool(writer.show_statistics),
                   aio=aio_items)


class CheckpointFile:
    """The object ``torch.save`` writes to: the chosen writer, made durable at :meth:`close`."""

    def __init__(self, writer: BaseFileWriter, settings: WriterSettings | None,
                 release: "_FastResources | None" = None) -> None:
        self.writer = writer
        self._settings = settings
        self._release = release
        self._closed = False

    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        return self.writer.write(buffer)

    def save(self, obj: object, **torch_save_kwargs: Any) -> None:
        """``torch.save(obj, self, **torch_save_kwargs)``. The fast writer fills in the zip records' CRC32s
        itself: torch's is switched off from here to the first byte written (torch reads the switch when it
        opens its zip writer), under a lock so two saves never see each other's setting."""
        fills = isinstance(self.writer, FastFileWriter) and self.writer.fills_crc32
        if not fills or not torch_save_kwargs.get("_use_new_zipfile_serialization", True):
            torch.save(obj, self, **torch_save_kwargs)
            return
        _crc_switch.acquire()
        previous = torch.serialization.get_crc32_options()
        restored = False

        def restore() -> None:
            nonlocal restored
            if not restored:
                restored = True
                torch.serialization.set_crc32_options(previous)
                _crc_switch.release()

        torch.serialization.set_crc32_options(False)
        self.writer.before_first_write = restore
        try:
            torch.save(obj, self, **torch_save_kwargs)
        finally:
            self.writer.before_first_write = None
            restore()

    def flush(self) -> None:
        self.writer.flush()

    def fileno(self) -> int:
        return INVALID_FD

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """Write what is buffered, fsync, close; log the statistics when ``show_statistics`` asks."""
        if self._closed:
            return
        self._closed = True
        try:
            self.writer.close()
            if not isinstance(self.writer, FastFileWriter):  # the fast writer fsyncs its own descriptor
                _fsync_path(self.writer.file_path())
        finally:
            if self._release is not None:
                self._release.release()
        if self._settings is not None and self._settings.show_statistics:
            self.writer._dump_state()

    def abandon(self) -> None:
        """Close without making the file durable (the save failed; the caller removes it)."""
        if self._closed:
            return
        self._closed = True
        try:
            if isinstance(self.writer, FastFileWriter):
                self.writer.abort()
            else:
                self.writer.close()
        except OSError:
            pass
        finally:
            if self._release is not None:
                self._release.release()

    def __enter__(self) -> "CheckpointFile":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FastResources:
    """An async I/O handle and a page-aligned I/O buffer, lent to one fast writer at a time."""

    def __init__(self, settings: WriterSettings) -> None:
        self.handle = AsyncIOHandle.from_config(dict(settings.aio))
        self.buffer = self.handle.new_cpu_locked_tensor(settings.io_buffer_size, torch.empty(0, dtype=torch.uint8))
        self.busy = False

    def release(self) -> None:
        with _pool_lock:
            self.busy = False


_crc_switch = threading.Lock()  # held while torch's CRC32 switch is off for one fast save
_pool: dict[WriterSettings, list[_FastResources]] = {}
_pool_lock = threading.Lock()


def _borrow(settings: WriterSettings) -> _FastResources:
    """A free handle and buffer for ``settings`` (a new pair when every cached one is writing: another thread)."""
    key = WriterSettings(io_buffer_size=settings.io_buffer_size, aio=settings.aio)
    with _pool_lock:
        for resources in _pool.get(key, []):
            if not resources.busy:
                resources.busy = True
                return resources
    resources = _FastResources(settings)
    resources.busy = True
    with _pool_lock:
        _pool.setdefault(key, []).append(resources)
    return resources


def open_writer(path: str | os.PathLike[str], settings: WriterSettings | None) -> CheckpointFile:
    """``path`` created for writing through the writer ``settings`` name (a plain Python file for None)."""
    if settings is None or settings.type == "PYTHON":
        return CheckpointFile(PyFileWriter(path), settings)
    if settings.type == "MOCK":
        return CheckpointFile(MockFileWriter(path), settings)
    resources = _borrow(settings)
    try:
        config = FastFileWriterConfig(dnvme_handle=resources.handle, pinned_tensor=resources.buffer,
                                      double_buffer=settings.io_buffer_double)
        return CheckpointFile(FastFileWriter(path, config, fill_crc32=True), settings, release=resources)
    except BaseException:
        resources.release()
        raise

