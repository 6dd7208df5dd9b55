"""A decoupled save's snapshot: a copy, in host memory, of everything a checkpoint file would hold, taken while
training waits, so that the background write sees the state of the saved step and none of the in-place updates
of the steps after it.

:func:`host_copy` walks the object ``torch.save`` would be given (dicts, lists, tuples, tensors, plain values).
Each tensor's *storage* is copied once (storages are told apart as ``torch.save`` tells them: by identity), each
tensor met twice stays one object, and every tensor that viewed a storage becomes the same view of the copy:
``torch.save`` then writes exactly the bytes and the sharing it would have written for the live object (the
optimizer files' per-parameter tensors are views of flat buffers; copying them one by one would write each
element twice). Device storages go to host memory, pinned when the accelerator pins (CUDA), with asynchronous
copies and one synchronize at the end; a file then holds host tensors where a synchronous save's held device
ones, which is the same to every loader (dsrun's loads map to the CPU). Other objects (a loss scaler, the
client's own types) are deep-copied.

:class:`HostPool` keeps the host buffers from one snapshot to the next (fresh memory costs a page fault per page,
pinned memory far more), handed back by the writer once their file is written: after the first decoupled save a
rank holds one host copy of its saved state for the rest of the run.
"""
from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from dsrun.accelerator import get_accelerator

_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)


class HostPool:
    """Host storages by size, reused from one snapshot to the next (thread-safe: the writer thread gives them
    back once their file is written). A snapshot into fresh memory pays the kernel's page faults on every byte,
    and pinning (``pinned``: on CUDA) is slower still; the same state has the same storage sizes at every save,
    so from the second save on the copies land in memory already mapped."""

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).untyped_storage()

    def give_back(self, storages: list[torch.UntypedStorage]) -> None:
        """The last snapshot's storages, free again; those it did not take go (the pool holds one snapshot)."""
        with self._lock:
            self._free = {}
            for storage in storages:
                self._free.setdefault(storage.nbytes(), []).append(storage)


class Snapshot:
    """One snapshot's copies: call it on each file's object (:func:`dsrun.checkpoint.atomic.capturing_writes`),
    then :meth:`finish` before the copies are read. ``pool``: where the host storages come from (None: fresh
    memory each time)."""

    def __init__(self, pool: HostPool | None = None) -> None:
        self.pool = pool
        self.copied: dict[int, torch.UntypedStorage] = {}  # by the storage's identity, as torch.save counts them
        self.tensors: dict[int, torch.Tensor] = {}  # a tensor met twice stays one object (tied weights)
        self.taken: list[torch.UntypedStorage] = []  # from the pool, to hand back once written
        self.bytes = 0
        self._asynchronous = False

    def __call__(self, obj: object) -> object:
        """The copy of one file's object. Storages and tensors are told apart within this object only: once it is
        copied the caller may free it, and a later object's storages may then reuse its addresses."""
        self.copied, self.tensors = {}, {}
        return self._copy(obj)

    def finish(self) -> None:
        """Wait for the asynchronous device-to-host copies."""
        if self._asynchronous:
            get_accelerator().synchronize()

    def _storage(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        key = storage._cdata
        host = self.copied.get(key)
        if host is None:
            on_device = storage.device.type != "cpu"
            if self.pool is not None:
                host = self.pool.take(storage.nbytes())
                self.taken.append(host)
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
            if id(obj) not in self.tensors:
                self.tensors[id(obj)] = self._tensor(obj)
            return self.tensors[id(obj)]
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
