"""Moving a ZeRO strategy's states to host memory and back: DeepSpeed's ``engine.offload_states()`` /
``reload_states()`` (``deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum`` names the states).

A strategy says which tensors each state names (:class:`StateTensor`: a tensor and the views that share its
storage, such as the model's parameters inside a flat buffer); :class:`HostCopies` moves them. Each tensor keeps
its identity: only its storage changes (``tensor.data``), and every listed view is re-pointed at the same place
in the new storage, so the optimizer's state keys, the model's parameters and every reference a strategy holds
stay valid, and training after :meth:`HostCopies.reload` continues exactly as without the round trip.

Only tensors on an accelerator move. A tensor already in host memory (every state on a CPU training device; the
masters, optimizer states and gradients an ``offload_optimizer`` store keeps on the host) stays where it is: a
copy would only double its memory. Buffers that hold no state between steps (the gradient buckets kept for
reuse, ``contiguous_grad_buffer``) are released rather than moved, on any device, and reallocated empty by the
reload, as DeepSpeed does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

HOST = torch.device("cpu")


class OffloadDeviceEnum(str, Enum):
    """The ``offload_param.device`` / ``offload_optimizer.device`` values, and where ``offload_states`` moves to."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The states ``engine.offload_states(include=...)`` names (DeepSpeed's values)."""

    optim_states = "optim_states"  # the optimizer's state (Adam's exp_avg, exp_avg_sq ...)
    hp_params = "hp_params"  # the fp32 master weights (this rank's partition)
    lp_params = "lp_params"  # the model's parameters (stages 1-2: whole; stage 3: this rank's shards)
    lp_grads = "lp_grads"  # the gradient buffers the reduction fills and the step reads
    contiguous_grad_buffer = "contiguous_grad_buffer"  # gradient buckets kept for reuse (released, not moved)


@dataclass
class StateTensor:
    """One tensor a state names, and the tensors that are views of its storage (re-pointed with it)."""

    tensor: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Moved:
    tensor: torch.Tensor
    home: torch.device
    # (view, size, stride, offset from the tensor's first element) for each view of its storage
    views: list[tuple[torch.Tensor, torch.Size, tuple[int, ...], int]]


def _views_of(item: StateTensor) -> list[tuple[torch.Tensor, torch.Size, tuple[int, ...], int]]:
    base = item.tensor
    storage, first = base.untyped_storage().data_ptr(), base.storage_offset()
    found, seen = [], {id(base)}
    for view in item.views:
        if id(view) in seen or view.untyped_storage().data_ptr() != storage:
            continue  # listed but not (or no longer) a view of this storage: nothing to follow
        seen.add(id(view))
        found.append((view, view.size(), view.stride(), view.storage_offset() - first))
    return found


def _repoint(moved: _Moved, storage: torch.Tensor) -> None:
    """Give the moved tensor ``storage`` and put each of its views at the same place in it."""
    moved.tensor.data = storage
    for view, size, stride, offset in moved.views:
        view.data = storage.as_strided(size, stride, storage.storage_offset() + offset)


def move_storage(item: StateTensor, storage: torch.Tensor) -> None:
    """Copy ``item.tensor`` into ``storage`` (same size and layout) and re-point it and its views there: what
    held the old storage lets it go (DeepCompile's optimizer-state offload moves a master this way)."""
    record = _Moved(item.tensor, item.tensor.device, _views_of(item))
    storage.copy_(item.tensor.detach())
    _repoint(record, storage)


class HostCopies:
    """The tensors of a strategy's states that ``offload_states`` moved to host memory, until ``reload``."""

    def __init__(self) -> None:
        self.moved: dict[int, _Moved] = {}  # id(tensor) -> what it was
        self.offloaded: set[OffloadStateTypeEnum] = set()  # the states named since the last reload
        self.already_host: set[OffloadStateTypeEnum] = set()  # named, but nothing of them was on an accelerator
        self.released: list[tuple[torch.Size, torch.dtype, torch.device]] = []  # buffers to reallocate
        self._pinned: dict[int, torch.Tensor] = {}  # page-locked host buffers, reused by the next offload

    @staticmethod
    def on_accelerator(tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in accelerator memory (what moving to the host frees); a meta placeholder
        (an NVMe store's master) has no memory to move."""
        return tensor.device.type not in ("cpu", "meta")

    def _host_buffer(self, tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        pinned = pin_memory and torch.cuda.is_available()  # page-locking needs a device driver to register with
        if pinned:
            kept = self._pinned.get(id(tensor))
            if kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype:
                return kept
        buffer = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=HOST,
                                     pin_memory=pinned)
        if pinned:
            self._pinned[id(tensor)] = buffer
        return buffer

    def offload(self, state: OffloadStateTypeEnum, items: list[StateTensor], pin_memory: bool,
                non_blocking: bool) -> None:
        """Move the accelerator-resident tensors of ``state`` (and their views) to host memory; those already
        on the host (or moved for another state: a shared storage) stay."""
        moved_any = False
        for item in items:
            tensor = item.tensor
            if id(tensor) in self.moved:
                moved_any = True
                continue
            if not self.on_accelerator(tensor):
                continue
            record = _Moved(tensor, tensor.device, _views_of(item))
            buffer = self._host_buffer(tensor, pin_memory)
            buffer.copy_(tensor.detach(), non_blocking=non_blocking)
            _repoint(record, buffer)
            self.moved[id(tensor)] = record
            moved_any = True
        self.offloaded.add(state)
        if not moved_any:
            self.already_host.add(state)

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Buffers dropped by their owner (``contiguous_grad_buffer``): remembered to be reallocated empty."""
        self.released.extend((b.size(), b.dtype, b.device) for b in buffers)
        self.offloaded.add(OffloadStateTypeEnum.contiguous_grad_buffer)

    def reload(self, non_blocking: bool) -> list[torch.Tensor]:
        """Move every moved tensor back to its device, re-pointing its views; returns the released buffers,
        reallocated (uninitialised) for their owner to keep."""
        for record in self.moved.values():
            storage = torch.empty_strided(record.tensor.size(), record.tensor.stride(), dtype=record.tensor.dtype,
                                          device=record.home)
            storage.copy_(record.tensor.detach(), non_blocking=non_blocking)
            _repoint(record, storage)
        if non_blocking and any(r.home.type == "cuda" for r in self.moved.values()):
            torch.cuda.current_stream().synchronize()  # the states are back before the caller trains on them
        buffers = [torch.empty(size, dtype=dtype, device=device) for size, dtype, device in self.released]
        self.moved, self.released = {}, []
        self.offloaded, self.already_host = set(), set()
        return buffers

    def close(self) -> None:
        """Drop the page-locked buffers kept for the next offload."""
        self._pinned = {}


__all__ = ["HOST", "HostCopies", "OffloadDeviceEnum", "OffloadStateTypeEnum", "StateTensor", "move_storage"]
