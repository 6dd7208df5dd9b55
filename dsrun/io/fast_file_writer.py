"""DeepSpeed's ``FastFileWriter`` (FastPersist): large aligned writes with O_DIRECT through the async I/O op.

``torch.save(obj, FastFileWriter(path, config))`` copies the bytes torch hands ``write`` into the I/O buffer
(``config.pinned_tensor``, page-aligned) and, each time a half fills, hands it to the async I/O handle
(``config.dnvme_handle``) as one write at the file's next offset through a descriptor opened with O_DIRECT;
with ``double_buffer`` the next bytes fill the other half while it is written. Every O_DIRECT write is a
multiple of the handle's alignment; at ``close()`` the last aligned part goes the same way and the unaligned
tail is written through the page cache, then the file is fsynced. The file is sized ahead of the writes
(``ftruncate`` in steps of a few buffers, cut to the exact size at close): a direct write that extends a file
completes synchronously on ext4/XFS, so without it libaio's queue holds one write at a time. Where the filesystem refuses O_DIRECT
(tmpfs) the descriptor is opened without it and one line says so; the bytes are the same.

``num_parallel_writers`` / ``writer_rank`` split ``save_torch_storage_object_list`` (DeepSpeed's entry for its
own serializer) across writers as DeepSpeed does; ``torch.save`` itself only calls ``write``.
"""
from __future__ import annotations

import errno
import os
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from .base_file_writer import BaseFileWriter, logger
from .constants import (AIO_FILL_BUFFER_COUNT_KEY, AIO_FILL_BUFFER_SEC_KEY, AIO_FILL_BUFFER_SPEED_KEY,
                        AIO_SPEED_KEY, AIO_WRITE_BYTES_KEY, AIO_WRITE_SEC_KEY, CLOSE_COUNT_KEY, CRC_LATE_BLOCKS_KEY,
                        FILENO_COUNT_KEY,
                        FLUSH_COUNT_KEY, INVALID_FD, SAVE_STORAGE_BYTES_KEY, SAVE_STORAGE_KEY, SLOW_WRITE_BYTES_KEY,
                        SLOW_WRITE_SEC_KEY, WRITE_BYTES_KEY, WRITE_COUNT_KEY, WRITE_SEC_KEY)
from .io_buffer import Double_IO_Buffer, DrainHandle, Single_IO_Buffer
from .storage import StorageObject, storage_bytes
from .zip_crc import Record, RecordCrcFiller, fill_crc32_from_file, patch_crc, submit_crc

FASTIO_STAT_KEYS = [AIO_WRITE_SEC_KEY, AIO_WRITE_BYTES_KEY, AIO_SPEED_KEY, SLOW_WRITE_BYTES_KEY, SLOW_WRITE_SEC_KEY,
                    AIO_FILL_BUFFER_COUNT_KEY, AIO_FILL_BUFFER_SEC_KEY, AIO_FILL_BUFFER_SPEED_KEY, SAVE_STORAGE_KEY,
                    SAVE_STORAGE_BYTES_KEY, CRC_LATE_BLOCKS_KEY]
_refused_direct: set[str] = set()  # folders whose filesystem refused O_DIRECT (said once per folder)


@dataclass
class FastFileWriterConfig:
    """DeepSpeed's fields: the async I/O handle, the I/O buffer, double buffering, and the parallel split."""

    dnvme_handle: DrainHandle
    pinned_tensor: torch.Tensor
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0


def open_direct(path: str) -> tuple[int, bool]:
    """``path`` created (truncated) for writing with O_DIRECT; without it where the filesystem refuses it.
    Returns the descriptor and whether it has O_DIRECT."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in _refused_direct:
            _refused_direct.add(folder)
            logger.warning("dsrun.io: the filesystem of %s refuses O_DIRECT; the fast writer writes through the "
                           "page cache there", folder)
    return os.open(path, flags, 0o644), False


class FastFileWriter(BaseFileWriter):
    """``fill_crc32``: the stream is a ``torch.save`` written with torch's own CRC32 off
    (:meth:`dsrun.io.CheckpointFile.save` arranges it); the writer computes every record's CRC32 from its I/O
    buffer on the CRC threads while the halves are written, and fills the CRC fields, so the file is byte for
    byte torch's default (:mod:`.zip_crc`)."""

    def __init__(self, file_path: str | os.PathLike[str], config: FastFileWriterConfig,
                 fill_crc32: bool = False) -> None:
        super().__init__(file_path)
        self._crc = RecordCrcFiller(self._resolve_crcs) if fill_crc32 else None
        self._received = 0  # bytes handed to write() so far (the stream offset of the next byte)
        self._crc_batches: deque[list[Future[int]]] = deque()  # the CRC jobs of each half drained, in order
        self._next_target = 0  # targets before it lie wholly in drained halves
        # 4 KiB blocks already on disk holding a CRC field not known when they went: their bytes and fields
        self._late_blocks: dict[int, tuple[bytearray, list[tuple[int, Record]]]] = {}
        self.before_first_write: Callable[[], None] | None = None
        self._handle = config.dnvme_handle
        self._alignment = self._handle.get_alignment()
        buffer_type = Double_IO_Buffer if config.double_buffer else Single_IO_Buffer
        self._io_buffer = buffer_type(config.pinned_tensor, self._handle)
        self._num_parallel_writers = config.num_parallel_writers
        self._writer_rank = config.writer_rank
        self._global_rank = config.global_rank
        self._aio_fd, self.direct = open_direct(self._file_path)
        self._file_offset = 0
        self._sized = 0  # the file's size as set ahead of the writes
        self._size_step = 4 * config.pinned_tensor.numel()
        for key in FASTIO_STAT_KEYS:
            self._stats[key] = 0

    @property
    def fills_crc32(self) -> bool:
        return self._crc is not None

    # ------------------------------------------------------------------ the file object torch.save writes to
    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        if self.before_first_write is not None:
            self.before_first_write()
            self.before_first_write = None
        view = memoryview(buffer).cast("B")
        start = time.perf_counter()
        if self._crc is not None and self._crc.following:
            self._crc.feed(view, self._received)
            view = self._with_known_crcs(view)
        self._received += len(view)
        written = self._write_view(view)
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, written)
        self._incr_stats(WRITE_SEC_KEY, time.perf_counter() - start)
        return written

    def flush(self) -> None:
        self._incr_stats(FLUSH_COUNT_KEY)  # the bytes stay buffered until a half fills or close()

    def fileno(self) -> int:
        self._incr_stats(FILENO_COUNT_KEY)
        return INVALID_FD

    def close(self) -> None:
        """Write what is buffered (the aligned part with O_DIRECT, the tail through the page cache), fsync,
        close. A second call does nothing."""
        if self._aio_fd == INVALID_FD:
            return
        self._fini()
        self._incr_stats(CLOSE_COUNT_KEY)

    def abort(self) -> None:
        """Close without writing what is buffered (a save that failed; the caller removes the file)."""
        if self._aio_fd == INVALID_FD:
            return
        try:
            self._io_buffer.complete_ongoing_drain()
            self._wait_crc_batches(0)  # the CRC jobs read the buffer the pool lends to the next writer
        except Exception:  # the write in flight failed too; the save is failing anyway
            pass
        finally:
            self._io_buffer.reset()
            fd, self._aio_fd = self._aio_fd, INVALID_FD
            os.close(fd)

    def __enter__(self) -> "FastFileWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_aio_fd", INVALID_FD) != INVALID_FD:
            try:
                self._io_buffer.complete_ongoing_drain()  # never free a buffer the kernel still reads
            finally:
                os.close(self._aio_fd)

    # ------------------------------------------------------------------ DeepSpeed's storage-list entry
    def save_torch_storage_object_list(self, storage_obj_list: list[StorageObject], save_size: bool) -> int:
        """Write each ``(storage, dtype)``'s bytes (after an int64 element count when ``save_size``); with
        ``num_parallel_writers`` > 1 only this writer's contiguous share of those bytes. Returns the bytes
        written."""
        pieces: list[torch.Tensor] = []
        for obj in storage_obj_list:
            data = storage_bytes(obj)
            if save_size:
                count = data.numel() // torch.empty(0, dtype=obj[1]).element_size()
                pieces.append(torch.tensor([count], dtype=torch.int64).view(torch.uint8))
            pieces.append(data)
        if self._num_parallel_writers > 1:
            pieces = partition_bytes(pieces, self._num_parallel_writers, self._writer_rank)
        written = sum(self.write(memoryview(p.contiguous().numpy())) for p in pieces if p.numel())
        self._incr_stats(SAVE_STORAGE_KEY, len(storage_obj_list))
        self._incr_stats(SAVE_STORAGE_BYTES_KEY, written)
        return written

    # ------------------------------------------------------------------ internals
    def _write_view(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            start = time.perf_counter()
            done += self._io_buffer.fill(view, done)
            self._incr_stats(AIO_FILL_BUFFER_SEC_KEY, time.perf_counter() - start)
            self._incr_stats(AIO_FILL_BUFFER_COUNT_KEY)
            if self._io_buffer.is_full():
                self._drain(self._io_buffer.get_offset())
        return done

    def _drain(self, num_bytes: int) -> None:
        start = time.perf_counter()
        if self._file_offset + num_bytes > self._sized:
            self._sized = self._file_offset + num_bytes + self._size_step
            os.ftruncate(self._aio_fd, self._sized)
        following = self._crc is not None and self._crc.following
        if following:
            self._crc_before_drain(self._half_view(num_bytes), self._file_offset)
        self._io_buffer.drain(num_bytes, self._aio_fd, self._file_offset)
        self._file_offset += num_bytes
        if following:  # the half filled next must not be read by CRC jobs any more
            self._wait_crc_batches(1 if isinstance(self._io_buffer, Double_IO_Buffer) else 0)
        self._incr_stats(AIO_WRITE_SEC_KEY, time.perf_counter() - start)
        self._incr_stats(AIO_WRITE_BYTES_KEY, num_bytes)

    def _fini(self) -> None:
        start = time.perf_counter()
        filling = self._crc is not None and self._crc.zip
        if filling and self._crc.complete:  # every CRC is known: fill those still in the buffer
            self._crc_before_drain(self._half_view(self._io_buffer.get_offset()), self._file_offset)
        aligned = self._io_buffer.get_aligned_num_bytes()
        tail = bytes(self._io_buffer.get_buffer()[aligned:self._io_buffer.get_offset()].numpy())
        try:
            if aligned:
                self._drain(aligned)
            self._io_buffer.complete_ongoing_drain()
            if filling and self._crc.complete:
                self._write_late_blocks()
            self._incr_stats(AIO_WRITE_SEC_KEY, time.perf_counter() - start)
            if self._sized != self._file_offset + len(tail):
                os.ftruncate(self._aio_fd, self._file_offset + len(tail))
            if tail:
                self._write_tail(tail)
            if filling and self._received and not self._crc.complete:
                self._fill_crc32_from_file()
            os.fsync(self._aio_fd)
        finally:
            self._io_buffer.reset()
            fd, self._aio_fd = self._aio_fd, INVALID_FD
            os.close(fd)
        self._incr_stats(WRITE_SEC_KEY, time.perf_counter() - start)

    # ------------------------------------------------------------------ the records' CRC32 (fill_crc32)
    def _half_view(self, num_bytes: int) -> memoryview:
        return memoryview(self._io_buffer.get_buffer().numpy())[:num_bytes]

    def _with_known_crcs(self, view: memoryview) -> memoryview:
        """``view``, copied with the CRC fields it holds filled where their records' CRC32 is known now (and the
        serialization id's replaced digits)."""
        assert self._crc is not None
        start, end, copy = self._received, self._received + len(view), None
        while self._crc.replacements and self._crc.replacements[0][0] < end:
            where, data = self._crc.replacements.pop(0)
            copy = copy if copy is not None else memoryview(bytearray(view))
            copy[where - start:where - start + len(data)] = data
        for target, record in reversed(self._crc.targets):
            if target + 4 <= start:
                break
            if target < end and record.final():
                if copy is None:
                    copy = memoryview(bytearray(view))
                patch_crc(copy, start, target, record.crc())
        return view if copy is None else copy

    def _crc_before_drain(self, half: memoryview, start: int) -> None:
        """Before the bytes ``half`` (stream offset ``start``) go to disk: hand their data segments to the CRC
        threads, fill the CRC fields in them whose value is known, keep a copy of the 4 KiB blocks holding
        the others (filled and rewritten at close)."""
        assert self._crc is not None
        end = start + len(half)
        self._crc_batches.append(self._submit_segments(half, start))
        targets = self._crc.targets
        index = self._next_target
        while index < len(targets) and targets[index][0] < end:
            target, record = targets[index]
            if target + 4 <= start:  # a field found only after its bytes went to disk (not torch's stream)
                self._crc.lost = f"the CRC field at byte {target} was found after it was written"
                return
            if record.final():
                patch_crc(half, start, target, record.crc())
            else:
                for block in range(max(target, start) // 4096 * 4096, min(target + 4, end), 4096):
                    if block not in self._late_blocks:
                        self._late_blocks[block] = (bytearray(half[block - start:block - start + 4096]), [])
                    self._late_blocks[block][1].append((target, record))
            if target + 4 > end:
                break  # the field goes on in the next half: seen again at its drain
            index += 1
        self._next_target = index

    def _submit_segments(self, half: memoryview, start: int) -> list[Future[int]]:
        """CRC jobs for the data segments in ``half`` (stream offset ``start``) not yet handed out."""
        assert self._crc is not None
        batch: list[Future[int]] = []
        for record, first, stop in self._crc.take_segments(start + len(half)):
            pieces = submit_crc(half[first - start:stop - start])
            record.pieces.extend(pieces)
            batch.extend(job for _, job in pieces)
        return batch

    def _wait_crc_batches(self, keep: int) -> None:
        while len(self._crc_batches) > keep:
            for job in self._crc_batches.popleft():
                job.result()

    def _resolve_crcs(self) -> None:
        """The central directory begins: every record's data has passed. CRC the data still in the buffer and
        wait for every job, so each record's CRC32 is known."""
        assert self._crc is not None
        self._crc_batches.append(self._submit_segments(self._half_view(self._io_buffer.get_offset()),
                                                       self._file_offset))
        self._wait_crc_batches(0)

    def _write_late_blocks(self) -> None:
        """Fill the CRC fields of blocks already written and write those blocks again (O_DIRECT, from the I/O
        buffer, aligned)."""
        if not self._late_blocks:
            return
        staging = memoryview(self._io_buffer.get_buffer().numpy())[:4096]
        self._incr_stats(CRC_LATE_BLOCKS_KEY, len(self._late_blocks))
        for block, (data, fields) in sorted(self._late_blocks.items()):
            view = memoryview(data)
            for target, record in fields:
                patch_crc(view, block, target, record.crc())
            staging[:] = view
            done = 0
            while done < 4096:
                done += os.pwrite(self._aio_fd, staging[done:], block + done)
        self._late_blocks.clear()

    def _fill_crc32_from_file(self) -> None:
        """The stream was not followed to its end: fill the CRC fields from the file's own bytes."""
        assert self._crc is not None
        logger.warning("the fast writer could not follow torch.save's stream of %s (%s); its records' CRC32s were "
                       "computed by reading the file back", self._file_path, self._crc.lost or "it ended early")
        os.fsync(self._aio_fd)
        fd = os.open(self._file_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            fill_crc32_from_file(fd)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_tail(self, tail: bytes) -> None:
        """The last bytes (less than the alignment) through the page cache, at their offset, durably."""
        start = time.perf_counter()
        fd = os.open(self._file_path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            while done < len(tail):
                done += os.pwrite(fd, tail[done:], self._file_offset + done)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._file_offset += len(tail)
        self._incr_stats(SLOW_WRITE_SEC_KEY, time.perf_counter() - start)
        self._incr_stats(SLOW_WRITE_BYTES_KEY, len(tail))

    def _derive_speeds(self) -> None:
        super()._derive_speeds()
        if self._stats[AIO_WRITE_SEC_KEY] > 0:  # type: ignore[operator]
            self._stats[AIO_SPEED_KEY] = self._stats[AIO_WRITE_BYTES_KEY] / self._stats[AIO_WRITE_SEC_KEY] / 1024 ** 3  # type: ignore[operator]
        if self._stats[AIO_FILL_BUFFER_SEC_KEY] > 0:  # type: ignore[operator]
            self._stats[AIO_FILL_BUFFER_SPEED_KEY] = (self._stats[AIO_WRITE_BYTES_KEY]  # type: ignore[operator]
                                                      / self._stats[AIO_FILL_BUFFER_SEC_KEY] / 1024 ** 3)


def partition_bytes(pieces: list[torch.Tensor], num_ranks: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s contiguous share of the concatenation of ``pieces`` (flat uint8 tensors): the first
    ``total % num_ranks`` ranks hold one byte more, as DeepSpeed splits them."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"writer rank {rank} is not in [0, {num_ranks})")
    total = sum(p.numel() for p in pieces)
    size, extra = divmod(total, num_ranks)
    start = rank * size + min(rank, extra)
    end = start + size + (1 if rank < extra else 0)
    share, offset = [], 0
    for piece in pieces:
        lo, hi = max(start, offset), min(end, offset + piece.numel())
        if lo < hi:
            share.append(piece.narrow(0, lo - offset, hi - lo))
        offset += piece.numel()
    return share
