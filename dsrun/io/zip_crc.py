"""The CRC32 of every record of a ``torch.save`` file: computed off the saving thread while the fast writer
writes, and checked when a checkpoint is loaded.

``torch.save`` writes a zip file whose records are stored uncompressed: for each record a local header (CRC
and sizes 0, general-purpose flag bit 3), its name, an extra field padding the data to 64 bytes, the data in
one ``write()`` call, then a data descriptor (``PK\\x07\\x08``, CRC32, sizes); at the end the central
directory, one entry per record with its CRC32, sizes and local-header offset, and the zip64/end records. torch
computes each record's CRC32 on the saving thread before the bytes reach the file object (zlib's CRC32 runs at
~1.5 GB/s on one core, slower than a fast disk), unless ``torch.utils.serialization.config.save.compute_crc32``
is off, when both CRC fields are written as 0 (``torch.load`` loads such a file: it never checks a CRC).

:class:`RecordCrcFiller` follows that stream as the fast writer passes it on (with torch's CRC32 off): it finds
each record's data, has its CRC32 computed on a thread pool (ISA-L's CRC32 where the ``isal`` package is
installed, a dependency, else zlib's; both release the GIL) from the writer's
own copy in its I/O buffer, combines the pieces (:func:`crc32_combine`) and names the CRC fields to fill (and
the half of torch's ``.data/serialization_id`` that hashes the CRC32s), so the file comes out byte for byte what
``torch.save`` with its CRC32 on writes. Should the stream ever not be what
this expects, the filler says it is lost and the writer fills the fields from the file once written
(:func:`fill_crc32_from_file`).

:func:`crc32_mismatches` reads a zip file's records back and returns those whose bytes do not match their
stored CRC32 (a file whose every CRC is 0 was written with torch's CRC32 off: nothing to check).
"""
from __future__ import annotations

import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Union

try:  # ISA-L's CRC32 (SIMD folding): the same values as zlib's, ~6-8x as fast; releases the GIL as zlib's does
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without isal's wheel
    from zlib import crc32

LOCAL, DESCRIPTOR, CENTRAL = b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02"
ZIP64_END, ZIP64_LOCATOR, END = b"PK\x06\x06", b"PK\x06\x07", b"PK\x05\x06"
INLINE_BYTES = 1 << 20  # a record's data call up to this size is CRC'd on the saving thread, as it passes
JOB_BYTES = 8 << 20  # a larger one in jobs of at most this many bytes, on the pool
_U32 = 0xFFFFFFFF
SERIALIZATION_ID = ".data/serialization_id"
_U64 = (1 << 64) - 1


def _crc_hash(crcs: Iterable[int]) -> int:
    """c10's ``hash_combine`` (boost's) of each value into a 64-bit seed that starts at 0."""
    seed = 0
    for value in crcs:
        seed ^= (value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64
    return seed

# ------------------------------------------------------------------ CRC32 arithmetic (zlib's polynomial)
_POLY = 0xEDB88320  # x^32 + x^26 + ... + 1, bit-reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both bit-reflected (``a`` non-zero)."""
    product, bit = 0, 1 << 31
    while True:
        if a & bit:
            product ^= b
            if not a & (bit - 1):
                return product
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of A + B from A's CRC32 ``crc1``, B's ``crc2`` and B's length: A's CRC times x^(8 len2)."""
    power, k = 1 << 31, 3  # x^0; bit k of the byte count is x^(2^(k+3))
    while len2:
        if len2 & 1:
            power = _multmodp(_X2N[k & 31], power)
        len2 >>= 1
        k += 1
    return _multmodp(power, crc1) ^ crc2


_pool: ThreadPoolExecutor | None = None


def crc_pool() -> ThreadPoolExecutor:
    """The process's CRC32 threads (one per core, at most 4; created at first use)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="dsrun-crc32")
    return _pool


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has none of the parent's threads: it starts its own pool when it needs one


os.register_at_fork(after_in_child=_forget_pool)

Piece = Union[int, "Future[int]"]


@dataclass
class Record:
    """One record of the stream: where its local header and data are, and the CRC32s of its data's pieces."""

    header: int
    name: str = ""
    start: int = -1
    length: int = -1  # -1 until the data has passed
    pieces: list[tuple[int, Piece]] = field(default_factory=list)  # (bytes, crc32 or its job) in order
    unsubmitted: int = 0  # data segments registered and not yet handed to the pool
    _value: tuple[int, int] | None = None  # (pieces combined, their CRC32)

    def final(self) -> bool:
        """Whether every piece's CRC32 is known now (without waiting)."""
        return (self.length >= 0 and not self.unsubmitted
                and all(isinstance(crc, int) or crc.done() for _, crc in self.pieces))

    def crc(self) -> int:
        """The record's CRC32 (waits for its jobs; asked only once the data has passed)."""
        if self._value is None or self._value[0] != len(self.pieces):
            value = 0
            for nbytes, crc in self.pieces:
                value = crc32_combine(value, crc if isinstance(crc, int) else crc.result(), nbytes)
            self._value = (len(self.pieces), value)
        return self._value[1]


class Lost(Exception):
    """The stream is not the zip layout this follows (the writer then fills the CRCs from the file)."""


# states of the follower
_HEADER, _NAME, _DATA, _DATA_CALL, _DESCRIPTOR, _CENTRAL, _CENTRAL_FIXED, _CENTRAL_NAME, _END, _LOST = range(10)


class RecordCrcFiller:
    """Follows a ``torch.save`` zip stream write by write (:meth:`feed`). ``resolve_all`` is called once, when
    the central directory begins: it must hand every segment not yet submitted to the pool and wait for all
    jobs, so the directory's CRCs can be filled as it passes.

    What it gives the writer: ``segments`` (data ranges ``(record, start, stop)`` whose CRC32 the writer has
    computed from its buffer, :meth:`take_segments`), ``targets`` (stream offsets of the 4-byte CRC fields and
    their records, in order) and ``lost`` (why it stopped following, or None)."""

    def __init__(self, resolve_all: Callable[[], None]) -> None:
        self._resolve_all = resolve_all
        self.records: list[Record] = []
        self._by_header: dict[int, Record] = {}
        self.segments: list[tuple[Record, int, int]] = []
        self.targets: list[tuple[int, Record]] = []
        self.replacements: list[tuple[int, bytes]] = []  # (stream offset, bytes to write there instead)
        self.lost: str | None = None
        self.central = False  # the central directory has begun: every record's CRC32 is known
        self.zip = True  # False once the stream is seen to need nothing: torch's legacy format, or its CRC32 on
        self._state = _HEADER
        self._acc = bytearray()
        self._need = 30
        self._record: Record | None = None
        self._remaining = 0  # data bytes left of a record whose size the header gave
        self._flags = 0

    @property
    def following(self) -> bool:
        return self.zip and self.lost is None

    @property
    def complete(self) -> bool:
        """Whether the whole stream was followed to its end records."""
        return self.following and self._state == _END

    def feed(self, view: memoryview, offset: int) -> None:
        """Follow the write of ``view`` (flat bytes) at stream ``offset``."""
        if not self.following or self._state == _END:
            return
        try:
            self._feed(view, offset)
        except Lost as why:
            self.lost = str(why)
            self._state = _LOST

    def take_segments(self, end: int) -> list[tuple[Record, int, int]]:
        """The segments (split at ``end``) before stream offset ``end``, removed from ``segments``."""
        taken: list[tuple[Record, int, int]] = []
        while self.segments and self.segments[0][1] < end:
            record, start, stop = self.segments.pop(0)
            if stop > end:
                self.segments.insert(0, (record, end, stop))
                record.unsubmitted += 1
                stop = end
            record.unsubmitted -= 1
            taken.append((record, start, stop))
        return taken

    # ------------------------------------------------------------------ the state machine
    def _feed(self, view: memoryview, offset: int) -> None:
        at, n = 0, len(view)
        while at < n and self._state not in (_END, _LOST):
            if self._state == _DATA_CALL:
                if at or self._acc:
                    raise Lost("a record's data did not come as one write")
                self._data(view, offset, 0, n, whole=True)
                at = n
                self._state, self._need = _DESCRIPTOR, 16
                continue
            if self._state == _DATA:
                take = min(n - at, self._remaining)
                self._data(view, offset, at, take, whole=take == self._remaining == self._record.length)
                self._remaining -= take
                at += take
                if not self._remaining:
                    self._state, self._need, self._acc = _HEADER, 30, bytearray()
                continue
            take = min(n - at, self._need - len(self._acc))
            self._acc += view[at:at + take]
            at += take
            if len(self._acc) == self._need:
                self._parse(offset + at)

    def _data(self, view: memoryview, offset: int, at: int, nbytes: int, whole: bool) -> None:
        record = self._record
        assert record is not None
        if record.start < 0:
            record.start = offset + at
        if whole and record.name.endswith(SERIALIZATION_ID):
            self._serialization_id(record, bytes(view[at:at + nbytes]), offset + at)
        elif whole and nbytes <= INLINE_BYTES:
            record.pieces.append((nbytes, crc32(view[at:at + nbytes])))
        elif nbytes:
            self.segments.append((record, offset + at, offset + at + nbytes))
            record.unsubmitted += 1
        if self._state == _DATA_CALL:
            record.length = nbytes

    def _serialization_id(self, record: Record, data: bytes, start: int) -> None:
        """torch's ``.data/serialization_id``: 20 digits hashing the record names, then 20 hashing the records'
        CRC32s (``c10::hash_combine`` over each non-empty record's, in order), all 0 here. Those 20 are
        recomputed from the CRC32s (every earlier record's is resolved first) when the digits written are what
        the zeros give; otherwise the id is left as torch wrote it."""
        self._resolve_all()
        earlier = [r for r in self.records if r is not record and r.length]  # torch skips empty records
        if len(data) == 40 and data.isdigit() and int(data[20:]) == _crc_hash([0] * len(earlier)):
            data = data[:20] + str(_crc_hash([r.crc() for r in earlier])).zfill(20).encode()
            self.replacements.append((start, data))
        record.pieces.append((len(data), crc32(data)))

    def _parse(self, end: int) -> None:
        """``self._acc`` holds the ``self._need`` bytes that end at stream offset ``end``."""
        data, start = bytes(self._acc), end - len(self._acc)
        if self._state == _HEADER:
            signature = data[:4]
            if signature == CENTRAL:
                self._resolve_all()
                self.central = True
                self._state, self._need = _CENTRAL_FIXED, 46
                return
            if signature != LOCAL:
                if not self.records and start == 0:
                    self.zip = False
                    self._state = _LOST
                    return
                raise Lost(f"no local header at byte {start}")
            flags, _, _, _, _, csize, _, name_len, extra_len = struct.unpack_from("<HHHHIIIHH", data, 6)
            self._flags, self._header_sizes = flags, csize
            self._record = Record(header=start)
            self._name_len = name_len
            self._state, self._need, self._acc = _NAME, 30 + name_len + extra_len, bytearray(data)
            return
        if self._state == _NAME:
            record = self._record
            assert record is not None
            record.name = data[30:30 + self._name_len].decode("utf-8", "replace")
            self.records.append(record)
            self._by_header[record.header] = record
            self._acc = bytearray()
            if self._flags & 8:  # sizes in the descriptor after the data: the data is the next write
                self._state = _DATA_CALL
                return
            size = self._header_sizes
            if size == _U32:
                size = _zip64_field(data[30 + self._name_len:], 1)
            record.length, self._remaining = size, size
            self.targets.append((record.header + 14, record))  # the CRC field of the local header itself
            if size:
                self._state = _DATA
            else:
                self._state, self._need = _HEADER, 30
            return
        if self._state == _DESCRIPTOR:
            record = self._record
            assert record is not None
            if data[:4] != DESCRIPTOR:
                raise Lost(f"no data descriptor after record {record.name}")
            if struct.unpack_from("<I", data, 4)[0]:  # torch computed its CRC32s: nothing to fill
                self.zip = False
                return
            if len(data) == 16 and struct.unpack_from("<II", data, 8) == (record.length, record.length):
                pass
            elif len(data) == 16:
                self._need = 24  # zip64: 8-byte sizes
                return
            elif struct.unpack_from("<QQ", data, 8) != (record.length, record.length):
                raise Lost(f"record {record.name}'s descriptor gives sizes other than its data's")
            self.targets.append((start + 4, record))
            self._state, self._need, self._acc = _HEADER, 30, bytearray()
            return
        if self._state == _CENTRAL:
            if data[:4] in (ZIP64_END, END):
                self._state = _END
            elif data[:4] == CENTRAL:
                self._state, self._need = _CENTRAL_FIXED, 46
            else:
                raise Lost(f"no central directory entry at byte {start}")
            return
        if self._state == _CENTRAL_FIXED:
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, 28)
            self._state, self._need = _CENTRAL_NAME, 46 + name_len + extra_len + comment_len
            return
        if self._state == _CENTRAL_NAME:
            csize, usize = struct.unpack_from("<II", data, 20)
            name_len, extra_len = struct.unpack_from("<HH", data, 28)
            header = struct.unpack_from("<I", data, 42)[0]
            if _U32 in (csize, usize, header):
                extra = data[46 + name_len:46 + name_len + extra_len]
                values = iter(_zip64_values(extra))
                usize = next(values) if usize == _U32 else usize
                csize = next(values) if csize == _U32 else csize
                header = next(values) if header == _U32 else header
            record = self._by_header.get(header)
            if record is None or record.length != csize:
                raise Lost(f"a central directory entry names no record seen (local header at {header})")
            self.targets.append((start + 16, record))
            self._state, self._need, self._acc = _CENTRAL, 4, bytearray()
            return
        raise Lost(f"unexpected state {self._state}")

    _header_sizes = 0
    _name_len = 0


def _zip64_values(extra: bytes) -> list[int]:
    """The 8-byte values of a zip64 extended-information field (id 1) in ``extra``."""
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            return [struct.unpack_from("<Q", extra, at + 4 + 8 * i)[0] for i in range(size // 8)]
        at += 4 + size
    raise Lost("a size past 4 GiB without its zip64 field")


def _zip64_field(extra: bytes, index: int) -> int:
    return _zip64_values(extra)[index]


def patch_crc(memory: memoryview, memory_start: int, target: int, value: int) -> None:
    """Write ``value`` (little-endian) at stream offset ``target`` into the bytes of ``memory`` that hold it
    (``memory`` holds the stream from ``memory_start``; bytes of the field outside it are left)."""
    packed = struct.pack("<I", value)
    for i in range(4):
        where = target + i - memory_start
        if 0 <= where < len(memory):
            memory[where] = packed[i]


def submit_crc(memory: memoryview) -> list[tuple[int, "Future[int]"]]:
    """CRC32 jobs over ``memory`` in pieces of at most ``JOB_BYTES``: (bytes, job) in order."""
    pool = crc_pool()
    return [(len(memory[at:at + JOB_BYTES]), pool.submit(crc32, memory[at:at + JOB_BYTES]))
            for at in range(0, len(memory), JOB_BYTES)]


# ------------------------------------------------------------------ reading a written file's records
@dataclass(frozen=True)
class ZipEntry:
    name: str
    crc: int  # as stored in the central directory
    data_start: int
    size: int
    entry_offset: int  # the central directory entry (its CRC field is 16 bytes in)
    descriptor_crc: int | None  # the data descriptor's CRC field offset, if the record has one


def _read_at(fd: int, offset: int, size: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError(f"the file ends at byte {offset + len(data)}, inside its zip structure")
    return data


def zip_entries(fd: int) -> list[ZipEntry]:
    """The records of the zip file open as ``fd``, from its central directory (zip64 aware)."""
    file_size = os.fstat(fd).st_size
    tail = _read_at(fd, max(0, file_size - 65558), min(file_size, 65558))
    end = tail.rfind(END)
    if end < 0:
        raise ValueError("no end-of-central-directory record")
    count, cd_size, cd_offset = struct.unpack_from("<HII", tail, end + 10)
    if _U32 in (cd_size, cd_offset) or count == 0xFFFF:
        locator = tail.rfind(ZIP64_LOCATOR, 0, end)
        zip64_at = struct.unpack_from("<Q", tail, locator + 8)[0]
        record = _read_at(fd, zip64_at, 56)
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", record, 32)
    directory = _read_at(fd, cd_offset, cd_size)
    entries, at = [], 0
    for _ in range(count):
        if directory[at:at + 4] != CENTRAL:
            raise ValueError(f"no central directory entry at byte {cd_offset + at}")
        flags = struct.unpack_from("<H", directory, at + 8)[0]
        crc, csize, usize, name_len, extra_len, comment_len = struct.unpack_from("<IIIHHH", directory, at + 16)
        header = struct.unpack_from("<I", directory, at + 42)[0]
        name = directory[at + 46:at + 46 + name_len].decode("utf-8", "replace")
        if _U32 in (csize, usize, header):
            values = iter(_zip64_values(directory[at + 46 + name_len:at + 46 + name_len + extra_len]))
            usize = next(values) if usize == _U32 else usize
            csize = next(values) if csize == _U32 else csize
            header = next(values) if header == _U32 else header
        local = _read_at(fd, header, 30)
        data_start = header + 30 + sum(struct.unpack_from("<HH", local, 26))
        descriptor = None
        if flags & 8 and csize:
            descriptor = data_start + csize + 4
        entries.append(ZipEntry(name, crc, data_start, csize, cd_offset + at, descriptor))
        at += 46 + name_len + extra_len + comment_len
    return entries


def _file_crc(fd: int, start: int, size: int, chunk: int = 16 << 20) -> int:
    value = 0
    for at in range(start, start + size, chunk):
        data = _read_at(fd, at, min(chunk, start + size - at))
        value = crc32(data, value)
    return value


def record_crcs(fd: int, entries: Iterable[ZipEntry]) -> dict[str, int]:
    """Each record's CRC32 computed from the file's bytes (on the CRC threads)."""
    jobs = {entry.name: crc_pool().submit(_file_crc, fd, entry.data_start, entry.size) for entry in entries}
    return {name: job.result() for name, job in jobs.items()}


def crc32_mismatches(path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """``(record, stored, computed)`` for every record of the zip file ``path`` whose bytes do not match its
    stored CRC32; none when every stored CRC is 0 (torch's CRC32 was off: nothing to check)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        entries = zip_entries(fd)
        if not any(entry.crc for entry in entries):
            return []
        computed = record_crcs(fd, entries)
    finally:
        os.close(fd)
    return [(entry.name, entry.crc, computed[entry.name]) for entry in entries if computed[entry.name] != entry.crc]


def fill_crc32_from_file(fd: int) -> None:
    """Fill every record's CRC32 fields (data descriptor and central directory) and the CRC half of torch's
    serialization id from the file's own bytes (``fd`` readable and writable): the fast writer's way when it
    could not follow the stream."""
    entries = zip_entries(fd)
    crcs = record_crcs(fd, entries)
    for index, entry in enumerate(entries):
        if entry.name.endswith(SERIALIZATION_ID) and entry.size == 40:
            data = _read_at(fd, entry.data_start, 40)
            earlier = [crcs[e.name] for e in entries[:index] if e.size]
            if data.isdigit() and int(data[20:]) == _crc_hash([0] * len(earlier)):
                data = data[:20] + str(_crc_hash(earlier)).zfill(20).encode()
                os.pwrite(fd, data, entry.data_start)
                crcs[entry.name] = crc32(data)
        for where in (entry.entry_offset + 16, entry.descriptor_crc):
            if where is not None:
                os.pwrite(fd, struct.pack("<I", crcs[entry.name]), where)
