"""``checkpoint.writer``: every file of an engine's save goes through the writer it names. A checkpoint the fast
writer wrote resumes bit-exactly, and a damaged byte in it is refused at load naming the file and record; the
mock writer leaves empty files; the buffer keys shape the O_DIRECT writes; statistics are logged when asked;
bad values are refused in one line each."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from dsrun.checkpoint.safe_load import CorruptCheckpointError
from dsrun.config import load_ds_config
from dsrun.io import fast_file_writer
from dsrun.io.zip_crc import zip_entries
from dsrun.utils.errors import ConfigError

from .conftest import make_engine, train

pytestmark = pytest.mark.usefixtures("single_rank")
SMALL = 4 * 4096  # a tiny I/O buffer: the checkpoint's files span many of them


def _writer(**keys) -> dict:
    return {"checkpoint": {"writer": keys}}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _save_logging(engine, folder) -> list[str]:
    handler = _Lines()
    fast_file_writer.logger.addHandler(handler)
    try:
        engine.save_checkpoint(str(folder))
    finally:
        fast_file_writer.logger.removeHandler(handler)
    return handler.lines


def test_a_checkpoint_written_by_the_fast_writer_resumes_bit_exactly(tmp_path):
    fast = _writer(type="fast", io_buffer_size=SMALL)
    engine = make_engine(2, "fp32", dropout=0.1, extra=fast)
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    expected = train(engine, 2, start=1)

    fresh = make_engine(2, "fp32", dropout=0.1, extra=fast)
    torch.manual_seed(123)  # a different RNG state that the load must overwrite
    fresh.load_checkpoint(str(tmp_path))
    assert train(fresh, 2, start=1) == expected  # weights, Adam moments, schedule, dropout RNG, bit for bit

    # one flipped byte in a tensor's record: torch.load returns a wrong value without a word (it never checks
    # the CRC32s); the checkpoint's load names the file and the record in one line
    states = next((tmp_path / "global_step1").glob("*model_states.pt"))
    fd = os.open(states, os.O_RDWR)
    try:
        record = max((e for e in zip_entries(fd) if "/data/" in e.name), key=lambda e: e.size)
        byte = os.pread(fd, 1, record.data_start + record.size // 2)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), record.data_start + record.size // 2)
    finally:
        os.close(fd)
    torch.load(states, weights_only=False)
    with pytest.raises(CorruptCheckpointError) as err:
        fresh.load_checkpoint(str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and str(states) in message and f"record {record.name} fails its CRC32" in message


def test_each_writer_type_writes_its_way(tmp_path):
    engine = make_engine(1, "fp32")
    train(engine, 1)
    engine._config = load_ds_config({**engine._config.to_ds_dict(), **_writer(type="mock")})
    engine.save_checkpoint(str(tmp_path / "mock"))  # the serialization only: every file is left empty
    files = list((tmp_path / "mock" / "global_step1").iterdir())
    assert files and all(f.stat().st_size == 0 for f in files)

    engine._config = load_ds_config({**engine._config.to_ds_dict(),
                                     **_writer(type="python", show_statistics=True)})
    lines = _save_logging(engine, tmp_path / "python")
    assert len([line for line in lines if line.startswith("stats = ")]) == len(files)  # one line per file
    assert all((tmp_path / "python" / "global_step1" / f.name).stat().st_size > 0 for f in files)

    engine._config = load_ds_config({**engine._config.to_ds_dict(), **_writer(type="fast", io_buffer_size=SMALL)})
    assert _save_logging(engine, tmp_path / "fast") == []  # show_statistics off: nothing logged


def test_buffer_size_and_double_buffering_shape_the_writes(tmp_path, monkeypatch):
    sizes: list[int] = []
    buffers: list[str] = []
    real_drain = fast_file_writer.FastFileWriter._drain
    real_init = fast_file_writer.FastFileWriter.__init__

    def drain(self, num_bytes):
        sizes.append(num_bytes)
        real_drain(self, num_bytes)

    def init(self, path, config, **options):
        real_init(self, path, config, **options)
        buffers.append(type(self._io_buffer).__name__)

    monkeypatch.setattr(fast_file_writer.FastFileWriter, "_drain", drain)
    monkeypatch.setattr(fast_file_writer.FastFileWriter, "__init__", init)
    engine = make_engine(1, "fp32")
    train(engine, 1)
    for double, size in ((True, SMALL), (False, SMALL), (True, 4 * SMALL)):
        sizes.clear()
        buffers.clear()
        engine._config = load_ds_config({**engine._config.to_ds_dict(),
                                         **_writer(type="fast", io_buffer_size=size, io_buffer_double=double)})
        engine.save_checkpoint(str(tmp_path / f"{double}{size}"))
        half = size // 2 if double else size
        assert max(sizes) == half and sizes.count(half) >= 2  # full buffers (halves) go out whole
        assert set(buffers) == {"Double_IO_Buffer" if double else "Single_IO_Buffer"}


@pytest.mark.parametrize("keys,path,says", [
    ({"type": "fast", "io_buffer_size": 1000}, "checkpoint.writer.io_buffer_size", "multiple of 8192"),
    ({"io_buffer_size": 3 * 4096, "io_buffer_double": True}, "checkpoint.writer.io_buffer_size", "use 8192"),
    ({"type": "bogus"}, "checkpoint.writer.type", "'MOCK', 'PYTHON' or 'FAST'"),
    ({"data_parallel": "replica"}, "checkpoint.writer.data_parallel", "part files no loader reads"),
])
def test_bad_writer_values_are_refused_in_one_line(keys, path, says):
    with pytest.raises(ConfigError) as err:
        load_ds_config({"train_micro_batch_size_per_gpu": 1, **_writer(**keys)})
    assert [p.path for p in err.value.problems] == [path]
    assert says in str(err.value) and len(str(err.value.problems[0]).splitlines()) == 1
