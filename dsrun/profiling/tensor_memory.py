"""Exact tensor-memory accounting on any device: the peak bytes of tensor storage alive at once.

``torch.cuda.max_memory_allocated`` has no CPU counterpart, and a process's resident size mixes in the
allocator's caching and everything else. :class:`TensorMemoryTracker` counts instead: while it is active,
every storage an operator creates (forward, backward, optimizer) is added when it appears and subtracted
when it is freed, so ``peak`` is the largest number of bytes those storages held at one time. Tensors that
existed before the tracker started are not counted. The figure is exact and the same on every machine,
which makes it usable in tests (memory asserted as bytes, never as a measured time). :class:`SavedTensorBytes`
counts the activation memory alone: the bytes autograd keeps between forward and backward::

    with TensorMemoryTracker() as memory:
        loss = model(batch); loss.backward()
    print(memory.peak)
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemoryTracker(TorchDispatchMode):
    """Peak and current bytes of the tensor storages created while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: dict[int, int] = {}  # id(storage) -> bytes, for storages still alive

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple[type, ...], args: tuple = (),
                          kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._track(leaf.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0 or id(storage) in self._seen:
            return
        self._seen[id(storage)] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, id(storage))

    def _free(self, key: int) -> None:
        self.current -= self._seen.pop(key, 0)


class SavedTensorBytes:
    """The bytes autograd keeps for backward while active: the distinct storages saved by the operators run
    under it, leaving out those of ``exclude`` (a module's parameters, which exist anyway). The activation
    memory of a forward, counted exactly::

        with SavedTensorBytes(exclude=model.parameters()) as saved:
            loss = model(batch)
        print(saved.bytes)
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._seen: dict[int, tuple[int, str]] = {}  # storage address -> (bytes, device type)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._seen[storage.data_ptr()] = (storage.nbytes(), t.device.type)
        return t

    @property
    def bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self._seen.values())

    @property
    def sizes(self) -> list[int]:
        """The size (bytes) of each distinct saved storage, ascending."""
        return sorted(nbytes for nbytes, _ in self._seen.values())

    @property
    def bytes_by_device(self) -> dict[str, int]:
        """The same bytes split by device type (``{"cpu": ..., "cuda": ...}``), e.g. with CPU-offloaded
        checkpoints."""
        split: dict[str, int] = {}
        for nbytes, device in self._seen.values():
            split[device] = split.get(device, 0) + nbytes
        return split

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
