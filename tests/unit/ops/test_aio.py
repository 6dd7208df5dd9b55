"""AsyncIOHandle: exact round trips of odd sizes, concurrent requests, the aio config keys, clear errors."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsrun.ops.aio import AsyncIOHandle, _PythonHandle

ODD_SIZES = [0, 1, 7, 4095, 4096, 4097, 1_000_003]


def engines() -> list[str]:
    from op_builder import get_builder

    # libaio exists wherever libaio-dev was installed at build time (CI installs it)
    return ["libaio", "threads"] if get_builder("async_io").load().have_libaio() else ["threads"]


@pytest.mark.parametrize("engine", ["libaio", "threads"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_odd_sizes_round_trip_exactly(engine: str, threads: int, aligned: bool, tmp_path: Path):
    if engine not in engines():
        pytest.skip("built without libaio-dev")
    h = AsyncIOHandle(block_size=3 * 4096, queue_depth=4, intra_op_parallelism=threads, engine=engine)
    gen = torch.Generator().manual_seed(0)
    for n in ODD_SIZES:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        # unaligned: a view one byte into an allocation, so O_DIRECT is never possible
        src = h.new_cpu_locked_tensor(n, data) if aligned else torch.empty(n + 1, dtype=torch.uint8)[1:]
        src.copy_(data)
        path = tmp_path / f"t{n}.bin"
        assert h.sync_pwrite(src, path) == 1
        assert path.stat().st_size == n
        dst = h.new_cpu_locked_tensor(n, data) if aligned else torch.empty(n + 1, dtype=torch.uint8)[1:]
        h.sync_pread(dst, path)
        assert torch.equal(dst, data), f"{n} bytes differ after the round trip"
    if aligned and _filesystem_takes_o_direct(tmp_path):
        # the block-aligned bulk of each aligned buffer bypassed the page cache
        assert h.get_direct_bytes() >= 2 * (1_000_003 // 4096 * 4096)
    if not aligned:
        assert h.get_direct_bytes() == 0


def _filesystem_takes_o_direct(directory: Path) -> bool:
    try:
        fd = os.open(directory / ".direct_probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tensors_of_any_dtype_round_trip(dtype: torch.dtype, tmp_path: Path):
    h = AsyncIOHandle()
    src = (torch.randn(12_345) * 100).to(dtype)
    h.sync_pwrite(src, tmp_path / "x")
    dst = torch.empty_like(src)
    h.sync_pread(dst, tmp_path / "x")
    assert torch.equal(src, dst)


def test_concurrent_reads_and_writes_complete(tmp_path: Path):
    h = AsyncIOHandle(block_size=65536, queue_depth=8, intra_op_parallelism=2)
    tensors = [torch.randn(100_001 + 17 * i) for i in range(8)]
    for i, t in enumerate(tensors):
        h.async_pwrite(t, tmp_path / f"c{i}")
    assert h.wait() == 8
    # reads of the first half overlap writes of new files
    outs = [torch.empty_like(t) for t in tensors[:4]]
    for i, t in enumerate(outs):
        h.async_pread(t, tmp_path / f"c{i}")
    for i, t in enumerate(tensors[4:]):
        h.async_pwrite(t * 2, tmp_path / f"d{i}")
    assert h.wait() == 8
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors[:4]))
    for i, t in enumerate(tensors[4:]):
        back = torch.empty_like(t)
        h.sync_pread(back, tmp_path / f"d{i}")
        assert torch.equal(back, t * 2)
    assert h.wait() == 0


def test_config_keys_reach_the_handle():
    h = AsyncIOHandle.from_config({"block_size": 262144, "queue_depth": 16, "thread_count": 2,
                                   "single_submit": True, "overlap_events": False})
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (262144, 16, 2)
    assert h.get_single_submit() is True and h.get_overlap_events() is False
    defaults = AsyncIOHandle.from_config(None)
    assert (defaults.get_block_size(), defaults.get_queue_depth(), defaults.get_intra_op_parallelism(),
            defaults.get_single_submit(), defaults.get_overlap_events()) == (1048576, 8, 1, False, True)


@pytest.mark.parametrize("single_submit", [True, False])
@pytest.mark.parametrize("overlap_events", [True, False])
def test_every_submission_mode_round_trips(single_submit: bool, overlap_events: bool, tmp_path: Path):
    h = AsyncIOHandle(block_size=4096, queue_depth=3, single_submit=single_submit, overlap_events=overlap_events)
    src = h.new_cpu_locked_tensor(50_001, torch.empty(0))
    src.copy_(torch.randn(50_001))
    h.sync_pwrite(src, tmp_path / "m")
    dst = torch.empty_like(src)
    h.sync_pread(dst, tmp_path / "m")
    assert torch.equal(src, dst)


def test_bad_settings_and_io_errors_are_clear(tmp_path: Path):
    with pytest.raises(ValueError, match="aio.queue_depth"):
        AsyncIOHandle(queue_depth=0)
    with pytest.raises(ValueError, match="unknown key.*queue_dept"):
        AsyncIOHandle.from_config({"queue_dept": 4})
    h = AsyncIOHandle()
    with pytest.raises(RuntimeError, match="No such file"):
        h.sync_pread(torch.empty(4), tmp_path / "missing.bin")
    h.sync_pwrite(torch.ones(3), tmp_path / "short.bin")
    with pytest.raises(RuntimeError, match="holds 12 bytes but the buffer needs 40"):
        h.sync_pread(torch.empty(10), tmp_path / "short.bin")
    with pytest.raises(RuntimeError, match="No such file or directory"):
        h.sync_pwrite(torch.ones(3), tmp_path / "no_dir" / "x.bin")


def test_validate_checks_the_file(tmp_path: Path):
    h = AsyncIOHandle()
    t = torch.arange(1000, dtype=torch.float32)
    assert h.pwrite(t, tmp_path / "v", validate=True) == 1
    u = torch.empty(1000)
    h.read(u, tmp_path / "v", validate=True)
    assert torch.equal(t, u)


def test_python_fallback_handle_round_trips(tmp_path: Path):
    h = _PythonHandle(4096, 8, False, True, 2)
    tensors = [torch.randn(n) for n in (1, 1023, 100_003)]
    for i, t in enumerate(tensors):
        h.async_pwrite(t, str(tmp_path / f"p{i}"))
    assert h.wait() == 3
    for i, t in enumerate(tensors):
        back = torch.empty_like(t)
        h.sync_pread(back, str(tmp_path / f"p{i}"))
        assert torch.equal(back, t)
    assert os.path.getsize(tmp_path / "p1") == 1023 * 4


@pytest.mark.parametrize("python_fallback", [False, True], ids=["op", "python"])
def test_writes_to_an_open_descriptor_land_at_their_offsets(python_fallback: bool, tmp_path: Path):
    """DeepSpeed's ``async_pwrite(buffer, fd, file_offset)`` (its FastFileWriter's call): no truncation, each
    buffer at its offset, O_DIRECT descriptors only with aligned lengths."""
    h = AsyncIOHandle(block_size=4096, intra_op_parallelism=2)
    if python_fallback:
        h._impl = _PythonHandle(4096, 8, False, True, 2)
    assert h.get_alignment() == 2 * 4096
    chunks = [h.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8)).fill_(i + 1) for i in range(3)]
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if _filesystem_takes_o_direct(tmp_path) else 0))
    try:
        for i in (2, 0, 1):  # out of order: every write goes where its offset says
            assert h.async_pwrite(chunks[i], fd, i * 8192) == 0
        assert h.wait() == 3
        if not python_fallback and _filesystem_takes_o_direct(tmp_path):
            assert h.get_direct_bytes() == 3 * 8192
            with pytest.raises(RuntimeError, match="get_alignment"):
                h.async_pwrite(chunks[0][:4096], fd, 0)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(bytes([i + 1]) * 8192 for i in range(3))
    with pytest.raises(ValueError, match="descriptor"):
        h.async_pwrite(chunks[0], path, file_offset=4096)
