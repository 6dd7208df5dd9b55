"""Asynchronous tensor <-> file I/O for NVMe offload: DeepSpeed's ``aio_handle`` API over the ``async_io`` op.

    from dsrun.ops.aio import AsyncIOHandle
    h = AsyncIOHandle.from_config(ds_config.get("aio"))      # the DeepSpeed "aio" section, or None
    buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.float32))  # page-aligned: O_DIRECT-eligible
    h.async_pwrite(buf, "/nvme/x.bin"); ...; h.wait()        # wait() returns how many requests completed
    h.sync_pread(buf, "/nvme/x.bin")

The ``aio`` keys map to the constructor: ``block_size``, ``queue_depth``, ``thread_count`` (named
``intra_op_parallelism`` here, as in DeepSpeed's handle), ``single_submit`` and ``overlap_events``.
``engine`` picks how I/O is issued: ``"libaio"`` (Linux native AIO, needs libaio-dev at build time),
``"threads"`` (pread/pwrite on the handle's worker threads) or ``"auto"`` (libaio when built with it).
O_DIRECT is used where the buffer and file offsets are 4096-aligned and the filesystem allows it; other
buffers and the unaligned tail of a file go through the page cache, so any size round-trips exactly.

A write may also target a descriptor the caller opened, at an offset, as DeepSpeed's FastFileWriter does:
``h.async_pwrite(buf, fd, file_offset)`` (the file is neither truncated nor reopened; with an O_DIRECT
descriptor the buffer and offset must be 4096-aligned and the length a multiple of ``h.get_alignment()``).

Without a C++ compiler the handle is a pure-Python thread pool (one warning), with the same API.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import torch

from dsrun.ops.loader import load_op
from op_builder import AsyncIOBuilder as _AsyncIOBuilder

AIO_DEFAULTS: dict[str, Any] = {
    "block_size": 1048576,
    "queue_depth": 8,
    "thread_count": 1,
    "single_submit": False,
    "overlap_events": True,
}
AsyncIOBuilder = _AsyncIOBuilder  # DeepSpeed's deepspeed.ops.aio re-exports the builder of this op


class AsyncIOHandle:
    """Issue reads and writes of whole CPU tensors to files, synchronously or asynchronously."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 8, single_submit: bool = False,
                 overlap_events: bool = True, intra_op_parallelism: int = 1, engine: str = "auto",
                 use_o_direct: bool = True):
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("thread_count", intra_op_parallelism)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"aio.{name}: expected a positive integer, got {value!r}")
        if engine not in ("auto", "libaio", "threads"):
            raise ValueError(f"aio engine: expected 'auto', 'libaio' or 'threads', got {engine!r}")
        op = load_op("async_io")
        if op is not None:
            self._impl: Any = op.AioHandle(block_size, queue_depth, bool(single_submit), bool(overlap_events),
                                           intra_op_parallelism, engine, bool(use_o_direct))
            self._aligned = op.aligned_tensor
        else:
            if engine == "libaio":
                raise RuntimeError("aio engine 'libaio' needs the compiled async_io op, which could not be built")
            self._impl = _PythonHandle(block_size, queue_depth, bool(single_submit), bool(overlap_events),
                                       intra_op_parallelism)
            self._aligned = None

    @classmethod
    def from_config(cls, aio: Mapping[str, Any] | None = None, **overrides: int) -> "AsyncIOHandle":
        """A handle from DeepSpeed's ``aio`` config section (missing keys take DeepSpeed's defaults);
        ``overrides``: keys of the section (numbers and flags) that replace its values."""
        cfg = {**AIO_DEFAULTS, **(dict(aio) if aio else {})}
        if "intra_op_parallelism" in cfg:  # DeepSpeed 0.19's name for thread_count
            cfg["thread_count"] = cfg.pop("intra_op_parallelism")
        if cfg.pop("use_gds", False):
            raise ValueError("aio.use_gds: GPUDirect Storage is not implemented in this version of dsrun; "
                             "leave use_gds false")
        unknown = sorted(set(cfg) - set(AIO_DEFAULTS))
        if unknown:
            raise ValueError(f"aio: unknown key(s) {', '.join(unknown)}; expected {', '.join(AIO_DEFAULTS)}")
        return cls(block_size=cfg["block_size"], queue_depth=cfg["queue_depth"],
                   single_submit=cfg["single_submit"], overlap_events=cfg["overlap_events"],
                   intra_op_parallelism=cfg["thread_count"], **overrides)

    # ---------------------------------------------------------------- I/O
    def async_pread(self, buffer: torch.Tensor, filename: str | os.PathLike) -> int:
        """Start reading ``filename`` into ``buffer``; completes at the next :meth:`wait`."""
        return self._impl.async_pread(buffer, os.fspath(filename))

    def async_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike | int, file_offset: int = 0) -> int:
        """Start writing ``buffer`` to ``filename`` (created or sized to the buffer), or to the open descriptor
        ``filename`` (an int) at ``file_offset``; completes at the next :meth:`wait`."""
        if isinstance(filename, int):
            return self._impl.async_pwrite_fd(buffer, filename, int(file_offset))
        _whole_file_only(file_offset)
        return self._impl.async_pwrite(buffer, os.fspath(filename))

    def sync_pread(self, buffer: torch.Tensor, filename: str | os.PathLike) -> int:
        return self._impl.sync_pread(buffer, os.fspath(filename))

    def sync_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike | int, file_offset: int = 0) -> int:
        if isinstance(filename, int):
            return self._impl.sync_pwrite_fd(buffer, filename, int(file_offset))
        _whole_file_only(file_offset)
        return self._impl.sync_pwrite(buffer, os.fspath(filename))

    def pread(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False,
              async_op: bool = False) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async)``; ``validate`` re-reads the file and checks."""
        if async_op:
            _no_async_validate(validate)
            return self.async_pread(buffer, filename)
        result = self.sync_pread(buffer, filename)
        if validate:
            _validate(buffer, filename)
        return result

    def pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False,
               async_op: bool = False) -> int:
        """DeepSpeed's ``pwrite(buffer, filename, validate, async)``."""
        if async_op:
            _no_async_validate(validate)
            return self.async_pwrite(buffer, filename)
        result = self.sync_pwrite(buffer, filename)
        if validate:
            _validate(buffer, filename)
        return result

    def read(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False) -> int:
        return self.pread(buffer, filename, validate)

    def write(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False) -> int:
        return self.pwrite(buffer, filename, validate)

    def wait(self) -> int:
        """Block until every started request is done; returns how many; raises the first I/O error."""
        return self._impl.wait()

    # ---------------------------------------------------------------- buffers
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D, page-aligned CPU tensor of ``example_tensor``'s dtype (O_DIRECT-eligible)."""
        if self._aligned is not None:
            return self._aligned(int(num_elem), example_tensor)
        return torch.empty(int(num_elem), dtype=example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Kept for DeepSpeed compatibility: the memory is released when the tensor is garbage-collected."""
        return True

    # ---------------------------------------------------------------- settings
    def get_block_size(self) -> int:
        return self._impl.get_block_size()

    def get_queue_depth(self) -> int:
        return self._impl.get_queue_depth()

    def get_single_submit(self) -> bool:
        return self._impl.get_single_submit()

    def get_overlap_events(self) -> bool:
        return self._impl.get_overlap_events()

    def get_intra_op_parallelism(self) -> int:
        return self._impl.get_intra_op_parallelism()

    def get_engine(self) -> str:
        """``"libaio"``, ``"threads"`` or ``"python"`` (the no-compiler fallback)."""
        return self._impl.get_engine()

    def get_direct_bytes(self) -> int:
        """How many bytes this handle has moved with O_DIRECT (0 where the filesystem refuses it)."""
        return self._impl.get_direct_bytes()

    def get_alignment(self) -> int:
        """DeepSpeed's: the byte multiple of a write to an O_DIRECT descriptor (4096 per worker thread, so that
        each thread's slice stays aligned)."""
        return self._impl.get_alignment()


aio_handle = AsyncIOHandle  # DeepSpeed's name


def _whole_file_only(file_offset: int) -> None:
    if file_offset:
        raise ValueError("file_offset: a write at an offset goes to an open descriptor (pass the fd, not the name); "
                         "a write by file name replaces the whole file")


def _no_async_validate(validate: bool) -> None:
    if validate:
        raise ValueError("validate=True needs a synchronous call (async_op=False)")


def _validate(buffer: torch.Tensor, filename: str | os.PathLike) -> None:
    expected = buffer.contiguous().view(torch.uint8).numpy().tobytes()
    with open(filename, "rb") as f:
        actual = f.read(len(expected))
    if actual != expected:
        raise RuntimeError(f"aio validation failed: '{os.fspath(filename)}' differs from the buffer")


class _PythonHandle:
    """The no-compiler fallback: os.pread/os.pwrite on a thread pool, same semantics as the C++ handle."""

    def __init__(self, block_size: int, queue_depth: int, single_submit: bool, overlap_events: bool,
                 threads: int):
        self._settings = (block_size, queue_depth, single_submit, overlap_events, threads)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dsrun-aio")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def _io_fd(self, buffer: torch.Tensor, fd: int, file_offset: int) -> None:
        view = memoryview(buffer.view(torch.uint8).numpy()) if buffer.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:done + self._settings[0]], file_offset + done)

    def _io(self, buffer: torch.Tensor, filename: str, read: bool) -> None:
        view = memoryview(buffer.view(torch.uint8).numpy()) if buffer.numel() else memoryview(b"")
        block = self._settings[0]
        flags = os.O_RDONLY if read else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = os.open(filename, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if read and os.fstat(fd).st_size < len(view):
                raise RuntimeError(f"'{filename}' holds {os.fstat(fd).st_size} bytes but the buffer needs {len(view)}")
            done = 0
            while done < len(view):
                chunk = view[done:done + block]
                n = os.preadv(fd, [chunk], done) if read else os.pwrite(fd, chunk, done)
                if n == 0:
                    raise RuntimeError(f"unexpected end of file reading '{filename}'")
                done += n
        finally:
            os.close(fd)

    def _submit(self, buffer: torch.Tensor, filename: str | int, read: bool, file_offset: int = 0) -> Future:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise RuntimeError("aio buffers must be contiguous CPU tensors")
        if isinstance(filename, int):
            future = self._pool.submit(self._io_fd, buffer, filename, file_offset)
        else:
            future = self._pool.submit(self._io, buffer, filename, read)
        with self._lock:
            self._pending.append(future)
        return future

    def async_pread(self, buffer: torch.Tensor, filename: str) -> int:
        self._submit(buffer, filename, True)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: str) -> int:
        self._submit(buffer, filename, False)
        return 0

    def async_pwrite_fd(self, buffer: torch.Tensor, fd: int, file_offset: int) -> int:
        self._submit(buffer, fd, False, file_offset)
        return 0

    def sync_pwrite_fd(self, buffer: torch.Tensor, fd: int, file_offset: int) -> int:
        return self._sync(buffer, fd, False, file_offset)

    def _sync(self, buffer: torch.Tensor, filename: str | int, read: bool, file_offset: int = 0) -> int:
        future = self._submit(buffer, filename, read, file_offset)
        try:
            future.result()
        finally:
            with self._lock:
                self._pending.remove(future)
        return 1

    def sync_pread(self, buffer: torch.Tensor, filename: str) -> int:
        return self._sync(buffer, filename, True)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str) -> int:
        return self._sync(buffer, filename, False)

    def wait(self) -> int:
        with self._lock:
            pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise RuntimeError(str(first)) from first
        return len(pending)

    def get_block_size(self) -> int:
        return self._settings[0]

    def get_queue_depth(self) -> int:
        return self._settings[1]

    def get_single_submit(self) -> bool:
        return self._settings[2]

    def get_overlap_events(self) -> bool:
        return self._settings[3]

    def get_intra_op_parallelism(self) -> int:
        return self._settings[4]

    def get_engine(self) -> str:
        return "python"

    def get_direct_bytes(self) -> int:
        return 0

    def get_alignment(self) -> int:
        return self._settings[4] * 4096
