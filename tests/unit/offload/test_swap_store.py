"""SwapStore: exact round trips of odd sizes and dtypes, many requests in flight, private folders, cleanup."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dsrun.offload.swap_store import SWAP_ROOT_NAME, SwapStore, remove_stale_folders
from tests.helpers import REPO

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
SIZES = [0, 1, 3, 1023, 1024, 1025, 262_147]


def _random(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    return torch.randint(0, 120, (n,), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_sizes_and_dtypes_round_trip_exactly(dtype: torch.dtype, tmp_path: Path):
    with SwapStore(tmp_path, {"block_size": 8192, "queue_depth": 4, "thread_count": 2}) as store:
        originals = {}
        for i, n in enumerate(SIZES):
            data = _random(n, dtype, i)
            buf = store.aligned_buffer(n, dtype)
            assert buf.data_ptr() % 4096 == 0 or n == 0
            buf.copy_(data)
            store.async_write(f"t{n}", buf)
            originals[f"t{n}"] = data
        store.wait()
        assert sorted(store.keys()) == sorted(originals)
        for key, data in originals.items():
            assert store.nbytes(key) == data.numel() * data.element_size()
            out = store.aligned_buffer(data.numel(), dtype)
            store.async_read(key, out)
            store.wait_reads()
            assert torch.equal(out, data), key
            # an unaligned (pageable, offset) output works too, through the page cache
            odd = torch.empty(data.numel() + 1, dtype=dtype)[1:]
            assert torch.equal(store.read(key, odd), data)
            assert torch.equal(store.mapped(key), data)


def test_many_reads_and_writes_in_flight(tmp_path: Path):
    store = SwapStore(tmp_path, {"thread_count": 2, "queue_depth": 8})
    n, keys = 100_003, 12
    first = [_random(n, torch.float32, k) for k in range(keys)]
    for k, data in enumerate(first):
        store.async_write(f"a{k}", data.clone())
    store.wait_writes()
    # read every key while writing new versions of other keys, all in flight together
    outs = [store.aligned_buffer(n) for _ in range(keys)]
    second = [_random(n, torch.float32, 100 + k) for k in range(keys)]
    for k in range(keys):
        store.async_read(f"a{k}", outs[k])
        store.async_write(f"b{k}", second[k])
    assert store.wait() == 2 * keys
    for k in range(keys):
        assert torch.equal(outs[k], first[k])
        assert torch.equal(store.read(f"b{k}"), second[k])
    # rewriting a key that is being read waits for the read first: the reader sees the old bytes
    out = store.aligned_buffer(n)
    store.async_read("a0", out)
    store.async_write("a0", second[0])
    store.wait()
    assert torch.equal(out, first[0]) and torch.equal(store.read("a0"), second[0])
    # several Python threads using one store
    errors = []

    def worker(t: int) -> None:
        try:
            for j in range(5):
                data = _random(4097, torch.bfloat16, 1000 * t + j)
                store.write(f"th{t}.{j}", data)
                assert torch.equal(store.read(f"th{t}.{j}"), data)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    store.close()


def test_folders_are_private_and_removed(tmp_path: Path):
    a, b = SwapStore(tmp_path, rank=0), SwapStore(tmp_path, rank=0)
    assert a.folder != b.folder and a.folder.parent == b.folder.parent == tmp_path / SWAP_ROOT_NAME
    assert f"pid{os.getpid()}-rank0-" in a.folder.name
    a.write("x", torch.ones(10))
    b.write("x", torch.zeros(10))
    assert torch.equal(a.read("x"), torch.ones(10))
    a.close()
    assert not a.folder.exists() and b.folder.exists()
    a.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        a.async_write("y", torch.ones(1))
    b.delete("x")
    assert "x" not in b and not b.path("x").exists()
    with pytest.raises(KeyError, match="never written"):
        b.read("x")
    with pytest.raises(ValueError, match="bytes"):
        b.write("z", torch.ones(4))
        b.read("z", torch.empty(5))
    with pytest.raises(ValueError, match="swap key"):
        b.write("../escape", torch.ones(1))
    b.close()


def test_files_removed_at_normal_exit_and_stale_folders_of_dead_processes(tmp_path: Path):
    code = ("import torch, sys; from dsrun.offload import SwapStore; "
            "s = SwapStore(sys.argv[1], rank=3); s.write('k', torch.ones(1000)); print(s.folder)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert folder.parent == tmp_path / SWAP_ROOT_NAME and not folder.exists()
    # a killed process leaves its folder: the next store under the same root removes it
    killed = ("import os, torch, sys; from dsrun.offload import SwapStore; "
              "s = SwapStore(sys.argv[1], rank=1); s.write('k', torch.ones(1000)); print(s.folder, flush=True); "
              "os._exit(0)")
    out = subprocess.run([sys.executable, "-c", killed, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    left = Path(out.stdout.strip().splitlines()[-1])
    assert (left / "k.swp").exists()
    assert left in remove_stale_folders(tmp_path)
    assert not left.exists()
