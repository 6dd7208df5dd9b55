"""deepspeed.io's writers: torch.save through each one gives the same bytes as an in-memory save, for sizes
around and past the I/O buffer; the fast writer writes with O_DIRECT where the filesystem allows it and falls
back with one logged line where it does not, and (through ``CheckpointFile.save``) fills in the records' CRC32s
torch did not compute; the mock writer counts and writes nothing."""
from __future__ import annotations

import errno
import io
import logging
import os
import random
import threading
import zlib

import pytest
import torch

from dsrun.io import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter, WriterSettings, open_writer
from dsrun.io import fast_file_writer, zip_crc
from dsrun.io.zip_crc import crc32_combine, crc32_mismatches
from dsrun.ops.aio import AsyncIOHandle

BUFFER = 4 * 4096  # two 8 KiB halves: the larger objects below span many buffers
SIZES = [0, 1, 4095, 8192, 3 * BUFFER + 77]  # empty, tiny, unaligned tails, larger than the buffer


def _object(nbytes: int) -> dict:
    return {"bytes": torch.arange(nbytes, dtype=torch.int64).to(torch.uint8), "meta": [nbytes, "x"]}


def _in_memory(obj: object) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def handle():
    return AsyncIOHandle(block_size=4096, queue_depth=4)


def _fast(path, handle, double: bool = True) -> FastFileWriter:
    buffer = handle.new_cpu_locked_tensor(BUFFER, torch.empty(0, dtype=torch.uint8))
    return FastFileWriter(path, FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=buffer, double_buffer=double))


@pytest.mark.parametrize("nbytes", SIZES)
def test_every_writer_round_trips_torch_save_bit_exactly(tmp_path, handle, nbytes):
    obj = _object(nbytes)
    writers = {"python": PyFileWriter(tmp_path / "python"), "fast": _fast(tmp_path / "fast", handle),
               "fast_single": _fast(tmp_path / "fast_single", handle, double=False)}
    for name, writer in writers.items():
        torch.save(obj, writer)
        writer.close()
        assert (tmp_path / name).read_bytes() == _in_memory(obj), name
        back = torch.load(tmp_path / name)
        assert torch.equal(back["bytes"], obj["bytes"]) and back["meta"] == obj["meta"]
    stats = writers["fast"].statistics()
    assert stats["bytes"] == stats["aio_bytes"] + stats["slow_bytes"] == len(_in_memory(obj))
    assert stats["slow_bytes"] < 4096  # only the unaligned tail goes through the page cache


def test_the_fast_writer_uses_o_direct_where_the_filesystem_allows_it(tmp_path, handle):
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as err:
        pytest.skip(f"this filesystem refuses O_DIRECT ({err.strerror}); the fallback test covers it")
    before = handle.get_direct_bytes()
    writer = _fast(tmp_path / "f", handle)
    torch.save(_object(3 * BUFFER), writer)
    writer.close()
    assert writer.direct and handle.get_direct_bytes() - before == writer.statistics()["aio_bytes"] >= 2 * BUFFER


def test_where_o_direct_is_refused_the_fast_writer_says_so_once_and_writes_the_same_bytes(tmp_path, handle,
                                                                                           monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):  # what tmpfs on older kernels answers
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    fast_file_writer.logger.addHandler(handler)
    try:
        before = handle.get_direct_bytes()
        for name in ("a", "b"):
            writer = _fast(tmp_path / name, handle)
            torch.save(_object(BUFFER + 5), writer)
            writer.close()
            assert not writer.direct and (tmp_path / name).read_bytes() == _in_memory(_object(BUFFER + 5))
    finally:
        fast_file_writer.logger.removeHandler(handler)
    assert handle.get_direct_bytes() == before
    assert len([line for line in lines if "refuses O_DIRECT" in line]) == 1, lines


def test_the_mock_writer_counts_bytes_and_writes_nothing(tmp_path):
    obj = _object(10_000)
    writer = MockFileWriter(tmp_path / "m")
    torch.save(obj, writer)
    writer.close()
    assert (tmp_path / "m").read_bytes() == b""
    assert writer.statistics()["bytes"] == len(_in_memory(obj)) and writer.statistics()["write"] > 1
    storage = (obj["bytes"].untyped_storage(), torch.uint8)
    assert writer.save_torch_storage_object_list([storage], save_size=True) == 8 + 10_000


def test_open_writer_makes_the_file_durable_and_lends_one_buffer_at_a_time(tmp_path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    settings = WriterSettings(type="FAST", io_buffer_size=BUFFER)
    for settings_ in (None, WriterSettings(type="PYTHON"), settings):
        synced.clear()
        with open_writer(tmp_path / "f", settings_) as fh:
            torch.save(_object(100), fh)
        assert synced and (tmp_path / "f").read_bytes() == _in_memory(_object(100))
    first = open_writer(tmp_path / "a", settings)
    second = open_writer(tmp_path / "b", settings)  # the first still writes: the second gets its own buffer
    assert first.writer._io_buffer.get_buffer().data_ptr() != second.writer._io_buffer.get_buffer().data_ptr()
    first.close()
    second.close()
    third = open_writer(tmp_path / "c", settings)
    assert third.writer._handle in (first.writer._handle, second.writer._handle)  # reused, not rebuilt
    third.close()


def test_the_fast_writer_splits_the_storage_list_as_deepspeed_does(tmp_path, handle):
    storages = [(torch.arange(n, dtype=torch.uint8).untyped_storage(), torch.uint8) for n in (5, 6)]
    parts = []
    for rank in range(3):
        writer = _fast(tmp_path / f"part{rank}", handle)
        writer._num_parallel_writers, writer._writer_rank = 3, rank
        writer.save_torch_storage_object_list(storages, save_size=False)
        writer.close()
        parts.append((tmp_path / f"part{rank}").read_bytes())
    assert [len(p) for p in parts] == [4, 4, 3]  # 11 bytes: the first 11 % 3 ranks take one more
    assert b"".join(parts) == bytes(range(5)) + bytes(range(6))


def test_a_full_disk_reaches_the_save_as_the_os_error_it_is(tmp_path, monkeypatch):
    """The aio op's failed write is a RuntimeError with strerror's text: the writer re-raises ENOSPC as
    OSError, which the atomic save turns into its full-disk user error; the file is then abandoned."""
    from dsrun.checkpoint.atomic import disk_full

    handle = AsyncIOHandle()
    monkeypatch.setattr(handle, "wait", lambda: (_ for _ in ()).throw(
        RuntimeError(f"write to 'fd 9': {os.strerror(errno.ENOSPC)}")))
    writer = _fast(tmp_path / "g", handle)
    with pytest.raises(Exception) as err:  # torch's zip writer wraps it: a RuntimeError whose context it is
        torch.save(_object(3 * BUFFER), writer)
    assert disk_full(err.value)
    writer.abort()
    assert writer._aio_fd == fast_file_writer.INVALID_FD


def _records_object() -> dict:
    """Records past the inline size (CRC'd on the pool, across many halves), tiny, empty, and many small ones."""
    generator = torch.Generator().manual_seed(0)
    return {"big": torch.randn(300_000, generator=generator), "small": torch.arange(5.0), "empty": torch.empty(0),
            "many": [torch.randn(i * 7 + 1, generator=generator) for i in range(40)], "tail": torch.randn(3)}


@pytest.mark.parametrize("double", [True, False])
def test_the_fast_writer_fills_in_the_crc32s_torch_left_out_giving_torchs_own_bytes(tmp_path, double, monkeypatch):
    real_crc32, real_before_drain = zip_crc.crc32, FastFileWriter._crc_before_drain
    draining = threading.Event()  # set while no half is being prepared for its drain
    draining.set()

    def before_drain(self, half, start):
        draining.clear()
        try:
            return real_before_drain(self, half, start)
        finally:
            draining.set()

    def held_on_the_pool(data, value=0):  # a job handed out for a half never ends before that half's CRC fields
        if threading.current_thread().name.startswith("dsrun-crc32"):  # are looked at: late blocks happen,
            assert draining.wait(timeout=60)  # whatever the load (a timed sleep did not hold at load 15)
        return real_crc32(data, value)

    monkeypatch.setattr(zip_crc, "crc32", held_on_the_pool)
    monkeypatch.setattr(FastFileWriter, "_crc_before_drain", before_drain)
    obj = _records_object()
    with open_writer(tmp_path / "f", WriterSettings(type="FAST", io_buffer_size=BUFFER, io_buffer_double=double)) as fh:
        fh.save(obj)
    assert fh.writer.fills_crc32 and torch.serialization.get_crc32_options()  # torch's switch is back on
    # every CRC field and the serialization id's CRC half as torch.save with its CRC32 on writes them
    assert (tmp_path / "f").read_bytes() == _in_memory(obj)
    assert fh.writer.statistics()["crc32_late_blocks"] >= 1  # a field already on disk when its CRC was known
    assert crc32_mismatches(tmp_path / "f") == []
    with open_writer(tmp_path / "legacy", WriterSettings(type="FAST", io_buffer_size=BUFFER)) as fh:
        fh.save(obj, _use_new_zipfile_serialization=False)  # no zip records, nothing to fill
    assert (tmp_path / "legacy").read_bytes()[:2] == b"\x80\x02"


def test_a_stream_the_fast_writer_cannot_follow_gets_its_crc32s_from_the_file_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(zip_crc, "DESCRIPTOR", b"PK\x07\x09")  # no descriptor is where it is expected any more
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    fast_file_writer.logger.addHandler(handler)
    try:
        obj = _records_object()
        with open_writer(tmp_path / "f", WriterSettings(type="FAST", io_buffer_size=BUFFER)) as fh:
            fh.save(obj)
    finally:
        fast_file_writer.logger.removeHandler(handler)
    assert (tmp_path / "f").read_bytes() == _in_memory(obj)
    assert len([line for line in lines if "could not follow" in line and "no data descriptor" in line]) == 1, lines


def test_a_fast_written_file_is_read_by_range(tmp_path):
    from dsrun.checkpoint.tensor_file import TensorFile

    obj = _records_object()
    with open_writer(tmp_path / "f", WriterSettings(type="FAST", io_buffer_size=BUFFER)) as fh:
        fh.save(obj)
    with TensorFile(tmp_path / "f") as saved:
        out = torch.empty(1000)
        saved.read(saved.objects["big"], 123_456, out)
    assert saved.partial and torch.equal(out, obj["big"][123_456:124_456])


def test_crc32_combine_is_the_crc32_of_the_concatenation():
    rng = random.Random(0)
    for size_a, size_b in ((0, 0), (0, 7), (9, 0), (1, 1), (4096, 3), (1000, 123_457)):
        a, b = rng.randbytes(size_a), rng.randbytes(size_b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
