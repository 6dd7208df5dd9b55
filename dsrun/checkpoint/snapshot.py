"""A decoupled save's snapshot: a copy, in host memory, of everything a checkpoint file would hold, taken while
training waits, so that the background write sees the state of the saved step and none of the in-place updates
of the steps after it.

:func:`host_copy` walks the object ``torch.save`` would be given (dicts, lists, tuples, tensors, plain values).
Each tensor's *storage* is copied once, and every tensor that viewed it becomes the same view of the copy:
``torch.save`` then writes exactly the bytes and the sharing it would have written for the live object (the
optimizer files' per-parameter tensors are views of flat buffers; copying them one by one would write each
element twice). Device storages go to host memory, pinned when the accelerator pins (CUDA), with asynchronous
copies and one synchronize at the end; a file then holds host tensors where a synchronous save's held device
ones, which is the same to every loader (dsrun's loads map to the CPU). Other objects (a loss scaler, the
client's own types) are deep-copied.

:class:`PinnedPool` keeps pinned buffers from one snapshot to the next (pinning host memory is slow: what a
snapshot must avoid), handed back by the writer once their file is written.
"""
from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from dsrun.accelerator import get_accelerator

_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)


class PinnedPool:
    """Pinned host storages by size, reused across snapshots (CUDA only; thread-safe: the writer thread gives
    them back)."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()

    def give_back(self, storages: list[torch.UntypedStorage]) -> None:
        with self._lock:
            for storage in storages:
                self._free.setdefault(storage.nbytes(), []).append(storage)


class Snapshot:
    """One snapshot's copies: call it on each file's object (:func:`dsrun.checkpoint.atomic.capturing_writes`),
    then :meth:`finish` before the copies are read. ``pool``: where pinned storages come from (None: plain host
    memory, as on CPU)."""

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self.pool = pool
        self.copied: dict[tuple[str, int, int], torch.UntypedStorage] = {}
        self.pinned: list[torch.UntypedStorage] = []  # to hand back to the pool once written
        self.bytes = 0
        self._asynchronous = False

    def __call__(self, obj: object) -> object:
        return self._copy(obj)

    def finish(self) -> None:
        """Wait for the asynchronous device-to-host copies."""
        if self._asynchronous:
            get_accelerator().synchronize()

    def _storage(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        host = self.copied.get(key)
        if host is None:
            on_device = storage.device.type != "cpu"
            if on_device and self.pool is not None:
                host = self.pool.take(storage.nbytes())
                self.pinned.append(host)
            else:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8).untyped_storage()
            host.copy_(storage, non_blocking=on_device)
            self._asynchronous |= on_device
            self.copied[key] = host
            self.bytes += storage.nbytes()
        return host

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.is_quantized:
            out = tensor.detach().to("cpu", copy=True)
        else:
            host = self._storage(tensor.untyped_storage())
            out = torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(),
                                                          tensor.stride())
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
        return out.requires_grad_(tensor.requires_grad) if tensor.is_leaf else out

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, _PLAIN):
            return obj
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict's factory)
            out.clear()
            for key, value in obj.items():
                out[key] = self._copy(value)
            return out
        if isinstance(obj, list) and type(obj) is list:
            return [self._copy(v) for v in obj]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return tuple(self._copy(v) for v in obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*(self._copy(v) for v in obj))
        return copy.deepcopy(obj)


def host_copy(obj: object) -> object:
    """A host-memory copy of ``obj`` for ``torch.save`` (see the module docstring), synchronized."""
    snap = Snapshot()
    out = snap(obj)
    snap.finish()
    return out
