"""``SwapStore``: tensors kept in files (one file per key) under a private folder, moved with async I/O.

    store = SwapStore("/local_nvme", aio_config=ds_config.get("aio"))   # -> /local_nvme/dsrun_swap/<host>-pid<P>-rank<R>-<token>/
    buf = store.aligned_buffer(n, torch.float32)                          # page-aligned (O_DIRECT), pinned with CUDA
    store.async_write("exp_avg.3", buf); ...; store.wait()               # or wait_writes() / wait_reads()
    store.async_read("exp_avg.3", out); store.wait_reads()
    store.close()                                                         # removes the folder (also at normal exit)

Reads and writes go through separate :class:`~dsrun.ops.aio.AsyncIOHandle` s built from the ``aio`` section, so
a pipeline can wait for the reads it needs now while earlier writes keep going (read-ahead and write-behind).
With ``read_lanes=L`` reads go to L handles (lanes, each its own I/O thread and queue): a read names its lane
and ``wait_reads(lane)`` waits for that lane only, so a shard needed now is not held up by reads queued for
later on other lanes, and the lanes keep L requests on the disk at once (a deeper queue reads faster).
Each store owns one folder named after the host, process id and rank plus a random token: ranks and
concurrent runs never share files. Folders left behind by processes of this host that no longer exist (a
killed run) are removed when a new store opens under the same root.

A key's bytes are complete only after a wait that covers its write; reading or rewriting a key whose
request is still in flight first waits for it, so the store never races with itself.

``store.io`` counts the bytes and requests every read and write moved (:class:`SwapIO`); a step's traffic is
the difference of two snapshots (``store.io.snapshot()``). Files mapped for a checkpoint (:meth:`SwapStore.mapped`)
are not counted: they are paged in by whoever reads them, outside the training step.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Union

import torch

from dsrun.config.zero import AIOConfig
from dsrun.ops.aio import AsyncIOHandle

# the ``aio`` section: typed (DeepSpeedConfig.aio) or a raw dict of it; None: the defaults
AioSettings = Union[AIOConfig, Mapping[str, Any], None]

SWAP_ROOT_NAME = "dsrun_swap"
_KEY = re.compile(r"^[A-Za-z0-9_.\-]+$")
_FOLDER = re.compile(r"^(?P<host>.+)-pid(?P<pid>\d+)-rank(?P<rank>\d+)-[0-9a-f]+$")


@dataclass(frozen=True)
class SwapEntry:
    """What the store knows about one key: the bytes in its file and the tensor that was written."""

    nbytes: int
    dtype: torch.dtype
    numel: int


@dataclass
class SwapIO:
    """Bytes and requests a store (or several, added up) moved to and from its files since it opened."""

    read_bytes: int = 0
    written_bytes: int = 0
    reads: int = 0
    writes: int = 0

    def snapshot(self) -> "SwapIO":
        return SwapIO(self.read_bytes, self.written_bytes, self.reads, self.writes)

    def __add__(self, other: "SwapIO") -> "SwapIO":
        return SwapIO(self.read_bytes + other.read_bytes, self.written_bytes + other.written_bytes,
                      self.reads + other.reads, self.writes + other.writes)

    def __sub__(self, other: "SwapIO") -> "SwapIO":
        return SwapIO(self.read_bytes - other.read_bytes, self.written_bytes - other.written_bytes,
                      self.reads - other.reads, self.writes - other.writes)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_folders(root: str | os.PathLike) -> list[Path]:
    """Remove the store folders under ``root/dsrun_swap`` left by processes of this host that have exited
    (a killed run leaves its swap files behind). Returns the folders removed."""
    base = Path(root) / SWAP_ROOT_NAME
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    host = socket.gethostname()
    for entry in base.iterdir():
        match = _FOLDER.match(entry.name)
        if not match or match["host"] != host or not entry.is_dir():
            continue
        if int(match["pid"]) != os.getpid() and not _pid_alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _cleanup(folder: Path, handles: list[AsyncIOHandle]) -> None:
    for handle in handles:
        try:
            handle.wait()
        except Exception:  # the files are being deleted anyway
            pass
    shutil.rmtree(folder, ignore_errors=True)


class SwapStore:
    """Tensors in files under ``folder/dsrun_swap/<this process>/``, read and written asynchronously.

    ``aio_config`` is DeepSpeed's ``aio`` section (a mapping, a pydantic section or None for defaults).
    ``rank`` names the folder (default: the ``RANK`` environment variable, else 0). ``pin_memory`` makes
    :meth:`aligned_buffer` return page-locked memory when a CUDA device exists (pinned allocations are
    page-aligned too); on a CPU-only machine buffers are page-aligned pageable memory.
    """

    def __init__(self, folder: str | os.PathLike, aio_config: AioSettings = None, rank: int | None = None,
                 pin_memory: bool = False, read_lanes: int = 1):
        self.root = Path(folder)
        if rank is None:
            rank = int(os.environ.get("RANK", "0") or 0)
        self.rank = int(rank)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        base = self.root / SWAP_ROOT_NAME
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot create the swap folder under '{self.root}' (nvme_path): {exc.strerror}") from None
        remove_stale_folders(self.root)
        name = f"{socket.gethostname()}-pid{os.getpid()}-rank{self.rank}-{secrets.token_hex(4)}"
        self.folder = base / name
        self.folder.mkdir()
        config = _aio_mapping(aio_config)
        self._read_handles = [AsyncIOHandle.from_config(config) for _ in range(max(1, int(read_lanes)))]
        self._read_handle = self._read_handles[0]
        self._write_handle = AsyncIOHandle.from_config(config)
        self._entries: dict[str, SwapEntry] = {}
        self._reading: dict[str, int] = {}  # key -> the lane reading it
        self._writing: set[str] = set()
        # A handle's wait() returns once the requests it found pending are done; a request another thread
        # is already waiting for is not among them. Submitting and waiting under one lock per handle keeps
        # "after wait_*(), every write/read started before it is complete" true across threads.
        self._read_lock = threading.RLock()
        self._write_lock = threading.RLock()
        self.io = SwapIO()
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self.folder, [*self._read_handles, self._write_handle])

    # ------------------------------------------------------------------ buffers
    def aligned_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A 1-D CPU tensor of ``numel`` elements whose storage starts on a page boundary (O_DIRECT-eligible),
        pinned when the store was opened with ``pin_memory`` and a CUDA device exists. Not zeroed."""
        if self.pin_memory:
            return torch.empty(int(numel), dtype=dtype, pin_memory=True)
        return self._read_handle.new_cpu_locked_tensor(int(numel), torch.empty(0, dtype=dtype))

    # ------------------------------------------------------------------ I/O
    def path(self, key: str) -> Path:
        """The file holding ``key``."""
        if not _KEY.match(key):
            raise ValueError(f"swap key {key!r}: use letters, digits, '_', '.' and '-' only")
        return self.folder / f"{key}.swp"

    def async_write(self, key: str, tensor: torch.Tensor) -> None:
        """Start writing ``tensor`` (contiguous, CPU) as ``key``; it must not change until a wait covers it."""
        self._check_open()
        tensor = _checked(tensor, "async_write")
        path = self.path(key)
        if key in self._reading or key in self._writing:
            self.wait()
        with self._write_lock:
            self._entries[key] = SwapEntry(tensor.numel() * tensor.element_size(), tensor.dtype, tensor.numel())
            self._writing.add(key)
            self._write_handle.async_pwrite(tensor, path)
            self.io.written_bytes += self._entries[key].nbytes
            self.io.writes += 1

    @property
    def read_lanes(self) -> int:
        return len(self._read_handles)

    def async_read(self, key: str, out: torch.Tensor, lane: int = 0) -> None:
        """Start reading ``key`` into ``out`` (contiguous, CPU, exactly as many bytes as were written) on read
        lane ``lane`` (taken modulo the lanes)."""
        self._check_open()
        out = _checked(out, "async_read")
        entry = self._entry(key)
        nbytes = out.numel() * out.element_size()
        if nbytes != entry.nbytes:
            raise ValueError(f"swap key {key!r} holds {entry.nbytes} bytes ({entry.numel} x {entry.dtype}); "
                             f"the output has {nbytes}")
        if key in self._writing:
            self.wait_writes()
        with self._read_lock:
            lane = lane % len(self._read_handles)
            self._reading[key] = lane
            self._read_handles[lane].async_pread(out, self.path(key))
            self.io.read_bytes += nbytes
            self.io.reads += 1

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``key`` and wait for it."""
        self.async_write(key, tensor)
        self.wait_writes()

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``key`` into ``out`` (or a new tensor of the written dtype) and wait for it."""
        entry = self._entry(key)
        if out is None:
            out = torch.empty(entry.numel, dtype=entry.dtype)
        self.async_read(key, out)
        self.wait_reads()
        return out

    def wait_reads(self, lane: int | None = None) -> int:
        """Block until every started read (on ``lane`` only, when given) is done; returns how many completed."""
        with self._read_lock:
            lanes = range(len(self._read_handles)) if lane is None else [lane % len(self._read_handles)]
            done = 0
            try:
                for i in lanes:
                    done += self._read_handles[i].wait()
            finally:
                if lane is None:
                    self._reading.clear()
                else:
                    self._reading = {k: v for k, v in self._reading.items() if v not in lanes}
            return done

    def wait_writes(self) -> int:
        """Block until every started write is done (the keys' files are then complete)."""
        with self._write_lock:
            try:
                return self._write_handle.wait()
            finally:
                self._writing.clear()

    def wait(self) -> int:
        """Block until every started read and write is done; returns how many completed."""
        return self.wait_reads() + self.wait_writes()

    # ------------------------------------------------------------------ bookkeeping
    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def nbytes(self, key: str | None = None) -> int:
        """The bytes stored under ``key``, or under every key when ``key`` is None."""
        if key is None:
            return sum(e.nbytes for e in self._entries.values())
        return self._entry(key).nbytes

    def entry(self, key: str) -> SwapEntry:
        return self._entry(key)

    def mapped(self, key: str) -> torch.Tensor:
        """``key``'s data as a tensor mapped from its file (copy-on-write, paged in on use): for reading a
        whole store, e.g. into a checkpoint, without holding it all in memory. Waits for pending writes."""
        entry = self._entry(key)
        self.wait_writes()
        if entry.numel == 0:
            return torch.empty(0, dtype=entry.dtype)
        return torch.from_file(str(self.path(key)), shared=False, size=entry.numel, dtype=entry.dtype)

    def delete(self, key: str, keep_blocks: bool = False) -> None:
        """Forget ``key`` and remove its file; with ``keep_blocks`` the file stays (holding stale bytes, removed
        with the folder) so that the key's next write of the same size overwrites its blocks in place: on this
        machine's disk an overwrite runs at about twice the speed of a write that allocates a new file's
        blocks (docs/zero_infinity.md)."""
        if key in self._reading or key in self._writing:
            self.wait()
        self._entries.pop(key, None)
        if not keep_blocks:
            self.path(key).unlink(missing_ok=True)

    def close(self) -> None:
        """Wait for pending I/O and remove the store's folder and files. Idempotent."""
        if not self._closed:
            self._closed = True
            self._entries.clear()
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def _entry(self, key: str) -> SwapEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"swap key {key!r} was never written to this store ({self.folder})")
        return entry

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"swap store {self.folder} is closed")

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapStore({str(self.folder)!r}, keys={len(self._entries)}, bytes={self.nbytes()})"


def _aio_mapping(aio_config: AioSettings) -> Mapping[str, Any] | None:
    if aio_config is None:
        return None
    if hasattr(aio_config, "model_dump"):
        return aio_config.model_dump()
    return dict(aio_config)


def _checked(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise ValueError(f"SwapStore.{what}: expected a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"SwapStore.{what}: expected a contiguous tensor")
    return tensor
