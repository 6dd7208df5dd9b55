"""ZeRO-Infinity parameter offload: where a ZeRO-3 parameter's shard lives between its uses.

A partitioned parameter (:mod:`dsrun.zero.partition_params`) keeps this rank's shard in
``param.ds_tensor``. With ``zero_optimization.offload_param`` the shard moves off the training device and
``param.ds_offload`` names the object below that owns it; ZeRO-3 asks that object for the shard only when it
all-gathers the parameter (:meth:`ParamOffload.gather_input`) and hands it the updated values after each
optimizer step (:meth:`ParamOffload.write_shard`).

* ``device: cpu`` (:class:`CpuParamOffload`): the shard stays in host memory (pinned when the accelerator
  benefits from it) and is copied to the training device for the all-gather. On a CPU-only machine host and
  device are the same memory, so this changes nothing but the code path.
* ``device: nvme`` (:class:`NvmeParamOffload`): the shard lives in a file of a
  :class:`~dsrun.offload.swap_store.SwapStore` under ``nvme_path`` and ``param.ds_tensor`` is an
  empty placeholder. Reads go into a bounded pool of ``buffer_count`` aligned buffers of ``buffer_size``
  elements each; after each module's fetch the shards that the recorded module order (the ZeRO-3 trace)
  needs next are read ahead into free buffers, so the I/O overlaps compute. A buffer goes back to the pool
  as soon as its all-gather has completed, unless the shard may stay cached in host memory
  (``max_in_cpu`` elements in all). Updated shards are written back (write-behind through the same buffers)
  after the optimizer step.

Parameters below ``stage3_param_persistence_threshold`` stay gathered anyway and are never swapped, as in
DeepSpeed. See ``docs/zero_infinity.md``.
"""
from __future__ import annotations

import atexit
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable

import torch

from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from dsrun.config.zero import OffloadParamConfig
    from dsrun.offload.swap_store import AioSettings

OFFLOAD_ATTR = "ds_offload"


def offload_of(param: torch.nn.Parameter) -> "ParamOffload | None":
    return getattr(param, OFFLOAD_ATTR, None)


def is_swapped(param: torch.nn.Parameter) -> bool:
    """True when ``param``'s shard is not in ``param.ds_tensor`` but in an NVMe store."""
    owner = offload_of(param)
    return owner is not None and owner.swapped(param)


def shard_value(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard of a partitioned parameter, wherever it lives (a host copy for a swapped one)."""
    owner = offload_of(param)
    if owner is not None and owner.swapped(param):
        return owner.read_copy(param)
    return param.ds_tensor


class ParamOffload:
    """``offload_param.device: cpu``: shards in (pinned) host memory, copied to the device for the gather."""

    device = "cpu"

    def __init__(self, compute_device: torch.device, pin_memory: bool = False):
        self.compute_device = torch.device(compute_device)
        from dsrun.accelerator import get_accelerator

        self.pin = bool(pin_memory) and get_accelerator().pin_memory_enabled()
        self.params: "OrderedDict[int, torch.nn.Parameter]" = OrderedDict()

    # --- membership ---------------------------------------------------------------------------------------
    def adopt(self, param: torch.nn.Parameter) -> None:
        """Take ownership of ``param``'s shard (already partitioned)."""
        shard = param.ds_tensor
        if shard.device.type != "cpu":
            shard = shard.to("cpu")
        if self.pin and not shard.is_pinned():
            shard = shard.pin_memory()
        param.ds_tensor = shard
        setattr(param, OFFLOAD_ATTR, self)
        self.params[id(param)] = param

    def release(self, param: torch.nn.Parameter) -> None:
        """Give ``param``'s shard back to ``param.ds_tensor`` (in host memory) and stop owning it."""
        self.params.pop(id(param), None)
        if offload_of(param) is self:
            delattr(param, OFFLOAD_ATTR)

    def swapped(self, param: torch.nn.Parameter) -> bool:
        return False

    def can_alias(self, param: torch.nn.Parameter, master: torch.Tensor) -> bool:
        """May an fp32 run make ``param``'s shard a view of the optimizer's fp32 master (same memory)?"""
        return not self.swapped(param) and master.device == param.ds_tensor.device

    # --- the ZeRO-3 gather --------------------------------------------------------------------------------
    def gather_input(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The shard on the training device, ready to be all-gathered; the all-gather reads it."""
        shard = param.ds_tensor
        if shard.device != self.compute_device:
            shard = shard.to(self.compute_device, non_blocking=self.pin)
        return shard

    def after_fetch(self, upcoming: Iterable[torch.nn.Parameter]) -> None:
        """A module's parameters were fetched; ``upcoming`` are the next ones whose shards the recorded order
        reads (:meth:`~dsrun.zero.hooks.ParameterCoordinator.upcoming_reads`)."""

    def in_memory(self, param: torch.nn.Parameter) -> bool:
        """Is ``param``'s shard in host memory (or being read into it), so a gather needs no read of its own?"""
        return True

    # --- values -------------------------------------------------------------------------------------------
    def read_copy(self, param: torch.nn.Parameter) -> torch.Tensor:
        return param.ds_tensor

    def write_shard(self, param: torch.nn.Parameter, values: torch.Tensor) -> None:
        """Replace ``param``'s shard by ``values`` (``ds_partition_numel`` elements, any dtype)."""
        with torch.no_grad():
            param.ds_tensor.copy_(values)

    def write_borrowed(self, param: torch.nn.Parameter, values: torch.Tensor) -> bool:
        """As :meth:`write_shard`, but a file write may read ``values`` itself until :meth:`settle_borrowed`;
        True when one does."""
        self.write_shard(param, values)
        return False

    def settle_borrowed(self) -> None:
        """Wait for the writes :meth:`write_borrowed` left reading their callers' buffers."""

    def flush(self) -> None:
        """Wait until every write started by :meth:`write_shard` has landed."""

    # --- accounting ---------------------------------------------------------------------------------------
    def offloaded_bytes(self) -> int:
        """Bytes of shards this object keeps away from the training device."""
        if self.compute_device.type == "cpu":
            return 0  # host and device are the same memory
        return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self.params.values())

    def buffer_bytes(self) -> int:
        """Host memory for I/O buffers and cached shards (NVMe only)."""
        return 0

    def close(self) -> None:
        for p in list(self.params.values()):
            self.release(p)


class _Slot:
    """Where one swapped shard is in host memory right now."""

    __slots__ = ("key", "numel", "buffer", "reading", "cached", "ahead", "lane")

    def __init__(self, key: str, numel: int):
        self.key = key
        self.numel = numel
        self.buffer: torch.Tensor | None = None  # a pool buffer holding the shard (read or being read)
        self.reading = False  # an asynchronous read into ``buffer`` has not been waited for yet
        self.cached: torch.Tensor | None = None  # a private host copy (counts towards max_in_cpu)
        self.ahead = False  # the buffer was filled by read-ahead, before anything asked for it
        self.lane = 0  # the store's read lane its read went to


class NvmeParamOffload(ParamOffload):
    """``offload_param.device: nvme``: shards in files under ``nvme_path``, read through a bounded pool."""

    device = "nvme"

    def __init__(self, nvme_path: str, compute_device: torch.device, *, buffer_count: int, buffer_size: int,
                 max_in_cpu: int, pin_memory: bool = False, aio_config: AioSettings = None, rank: int = 0,
                 dtype: torch.dtype | None = None):
        super().__init__(compute_device, pin_memory)
        from dsrun.offload.swap_store import SwapStore

        if buffer_count < 1:
            raise ConfigError(Problem("zero_optimization.offload_param.buffer_count",
                                      f"got {buffer_count}; NVMe parameter offload needs at least 1 buffer",
                                      "use the default, 5"))
        try:  # one private folder per process under nvme_path, removed when the store closes
            # one read lane per buffer: a shard needed now waits for its own read, not for the read-ahead
            # queued behind it, and the reads ahead are on the disk together
            self.store = SwapStore(nvme_path, aio_config=aio_config, rank=rank, pin_memory=pin_memory,
                                   read_lanes=buffer_count)
        except OSError as exc:
            raise ConfigError(Problem("zero_optimization.offload_param.nvme_path", str(exc),
                                      "point it at a writable directory on a local drive")) from None
        self.folder = self.store.folder
        self.buffer_count = int(buffer_count)
        self.buffer_size = int(buffer_size)
        self.max_in_cpu = int(max_in_cpu)
        self.dtype = dtype
        self.slots: dict[int, _Slot] = {}
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._writing: list[torch.Tensor] = []  # buffers of writes not yet waited for
        self._borrowed = False  # writes in flight from callers' buffers (write_borrowed)
        self._staging: dict[int, list[Any]] = {}  # param id -> [buffer, elements filled] of a shard written in parts
        self._next_lane = 0
        self.cached_numel = 0
        self.read_bytes = 0
        self.written_bytes = 0
        self.read_ahead_hits = 0
        self._closed = False
        atexit.register(self.close)

    # --- membership ---------------------------------------------------------------------------------------
    def swappable(self, param: torch.nn.Parameter) -> bool:
        """Parameters of the model's dtype are swapped; others (rare integer ones) stay in host memory."""
        return self.dtype is None or param.ds_tensor.dtype == self.dtype

    def adopt(self, param: torch.nn.Parameter) -> None:
        if not self.swappable(param):
            return super().adopt(param)
        if self.dtype is None:
            self.dtype = param.ds_tensor.dtype
        if param.ds_partition_numel > self.buffer_size:
            raise ConfigError(Problem("zero_optimization.offload_param.buffer_size",
                                      f"{self.buffer_size} elements is smaller than a parameter shard of "
                                      f"{param.ds_partition_numel} elements (shape {tuple(param.ds_shape)})",
                                      f"set buffer_size to at least {param.ds_partition_numel}"))
        slot = _Slot(f"param{param.ds_id}", param.ds_partition_numel)
        shard = param.ds_tensor.detach().to("cpu")
        self.slots[id(param)] = slot
        self.params[id(param)] = param
        setattr(param, OFFLOAD_ATTR, self)
        param.ds_tensor = torch.empty(0, dtype=shard.dtype, device=shard.device)
        self._write(slot, shard)

    def release(self, param: torch.nn.Parameter) -> None:
        slot = self.slots.get(id(param))
        if slot is not None:
            param.ds_tensor = self.read_copy(param)
            self._drop(slot)
            del self.slots[id(param)]
        super().release(param)

    def swapped(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.slots

    # --- the pool -----------------------------------------------------------------------------------------
    def _view(self, buffer: torch.Tensor, numel: int) -> torch.Tensor:
        return buffer[:numel]

    def _take_buffer(self, protect: set[int]) -> torch.Tensor:
        """A free pool buffer; frees one if needed (finished writes, read-ahead shards not in ``protect``),
        never more than ``buffer_count`` buffers in all."""
        while True:
            if self._free:
                return self._free.pop()
            if self._allocated < self.buffer_count:
                self._allocated += 1
                return self.store.aligned_buffer(self.buffer_size, self.dtype or torch.float32)
            if self._writing:
                self._wait_writes()
                continue
            victim = self._read_ahead_victim(protect)
            if victim is not None:
                if victim.reading:
                    self._wait_reads()
                self._drop(victim)
                continue
            raise RuntimeError(
                f"NVMe parameter offload: all {self.buffer_count} buffers hold shards being written at once; "
                "raise zero_optimization.offload_param.buffer_count")

    def _read_ahead_victim(self, protect: set[int]) -> _Slot | None:
        """The read-ahead shard needed furthest in the future (the last one read ahead)."""
        candidates = [(pid, s) for pid, s in self.slots.items() if s.buffer is not None and pid not in protect]
        return candidates[-1][1] if candidates else None

    def _drop(self, slot: _Slot) -> None:
        """Give ``slot``'s pool buffer back (its shard is still on disk) and forget any cached copy."""
        if slot.buffer is not None:
            self._free.append(slot.buffer)
            slot.buffer = None
            slot.reading = False
            slot.ahead = False
        if slot.cached is not None:
            self.cached_numel -= slot.numel
            slot.cached = None

    def _wait_reads(self, lane: int | None = None) -> None:
        """Wait for every read in flight, or for those of read lane ``lane`` only."""
        self.store.wait_reads(lane)
        for slot in self.slots.values():
            if lane is None or slot.lane == lane:
                slot.reading = False

    def _wait_writes(self) -> None:
        self.store.wait_writes()
        self._free.extend(self._writing)
        self._writing = []

    # --- reading ------------------------------------------------------------------------------------------
    def _start_read(self, param: torch.nn.Parameter, protect: set[int]) -> _Slot:
        slot = self.slots[id(param)]
        if slot.cached is None and slot.buffer is None:
            slot.buffer = self._take_buffer(protect | {id(param)})
            slot.lane, self._next_lane = self._next_lane, (self._next_lane + 1) % self.store.read_lanes
            self.store.async_read(slot.key, self._view(slot.buffer, slot.numel), lane=slot.lane)
            slot.reading = True
            self.read_bytes += slot.numel * slot.buffer.element_size()
            # keep the order of read-ahead: the most recently read shard is the first to be given up
            self.slots[id(param)] = self.slots.pop(id(param))
        return slot

    def _host_shard(self, param: torch.nn.Parameter) -> torch.Tensor:
        slot = self._start_read(param, set())
        if slot.cached is not None:
            return slot.cached
        if slot.ahead:
            self.read_ahead_hits += 1
            slot.ahead = False
        if slot.reading:
            self._wait_reads(slot.lane)
        return self._view(slot.buffer, slot.numel)

    def read_copy(self, param: torch.nn.Parameter) -> torch.Tensor:
        if id(param) not in self.slots:
            return param.ds_tensor
        slot = self.slots[id(param)]
        value = self._host_shard(param).clone()
        if slot.cached is None:
            self._drop(slot)
        return value

    def gather_input(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A private copy of the shard on the training device: the pool buffer is free again at once, so
        asynchronous (prefetched) all-gathers never hold the pool and read-ahead keeps its buffers. Over a
        group of one the copy *is* the gathered parameter: it comes from ZeRO-3's gather-buffer pool
        (``param.ds_buffer_pool``, which takes it back at release) when one of its size is free there, so a
        host step does not fault in a fresh copy of every shard twice per step."""
        if id(param) not in self.slots:
            return super().gather_input(param)
        shard = self._host_shard(param)
        slot = self.slots[id(param)]
        pool = getattr(param, "ds_buffer_pool", None)
        private = pool.take(slot.numel) if pool is not None and param.ds_world_size == 1 else None
        if private is None or private.dtype != shard.dtype or private.device != self.compute_device:
            private = shard.to(self.compute_device, copy=True)
        else:
            private.copy_(shard)
        self._finish_use(param, slot)
        return private

    def _finish_use(self, param: torch.nn.Parameter, slot: _Slot) -> None:
        """The gather has its data: keep the shard cached if ``max_in_cpu`` allows, and free the buffer."""
        if slot.buffer is None:
            return
        if slot.cached is None and self.cached_numel + slot.numel <= self.max_in_cpu:
            slot.cached = self._view(slot.buffer, slot.numel).clone()
            self.cached_numel += slot.numel
        self._free.append(slot.buffer)
        slot.buffer = None

    def in_memory(self, param: torch.nn.Parameter) -> bool:
        slot = self.slots.get(id(param))
        return slot is None or slot.cached is not None or slot.buffer is not None

    def after_fetch(self, upcoming: Iterable[torch.nn.Parameter]) -> None:
        """Read ahead the next shards the recorded order reads into the free buffers (never evicting)."""
        for param in upcoming:
            slot = self.slots.get(id(param))
            if slot is None or slot.cached is not None or slot.buffer is not None:
                continue
            if not self._free and self._allocated >= self.buffer_count:
                return
            self._start_read(param, set()).ahead = True

    # --- writing ------------------------------------------------------------------------------------------
    def _write(self, slot: _Slot, values: torch.Tensor) -> None:
        buffer = self._take_buffer(set())
        view = self._view(buffer, slot.numel)
        view.copy_(values.reshape(-1))
        self.store.async_write(slot.key, view)
        self._writing.append(buffer)
        self.written_bytes += slot.numel * view.element_size()

    def _forget_old_value(self, slot: _Slot) -> None:
        if slot.buffer is not None:  # a read-ahead copy of the old value: give it up
            if slot.reading:
                self._wait_reads()
            self._free.append(slot.buffer)
            slot.buffer = None
            slot.ahead = False

    def write_shard(self, param: torch.nn.Parameter, values: torch.Tensor) -> None:
        slot = self.slots.get(id(param))
        if slot is None:
            return super().write_shard(param, values)
        with torch.no_grad():
            self._forget_old_value(slot)
            if slot.cached is not None:
                slot.cached.copy_(values.reshape(-1))
            self._write(slot, values)

    def write_borrowed(self, param: torch.nn.Parameter, values: torch.Tensor) -> bool:
        """Write the whole shard straight from ``values`` (the optimizer's staging buffer during backward, when
        this pool's buffers hold backward's read-ahead: taking one would evict a shard backward reads next)."""
        slot = self.slots.get(id(param))
        if slot is None or values.numel() != slot.numel or values.dtype != self.dtype:  # copied, as ever
            self.write_shard(param, values)
            return False
        with torch.no_grad():
            self._forget_old_value(slot)
            if slot.cached is not None:
                slot.cached.copy_(values.reshape(-1))
            self.store.async_write(slot.key, values.reshape(-1))
        self.written_bytes += slot.numel * values.element_size()
        self._borrowed = True
        return True

    def settle_borrowed(self) -> None:
        if self._borrowed:
            self._wait_writes()
            self._borrowed = False

    def write_range(self, param: torch.nn.Parameter, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set elements ``[lo, hi)`` of ``param``'s shard (an optimizer that steps in tiles): the parts
        are staged in a pool buffer and the file is written once the whole shard has arrived."""
        slot = self.slots[id(param)]
        if lo == 0 and hi == slot.numel:
            return self.write_shard(param, values)
        with torch.no_grad():
            staged = self._staging.get(id(param))
            if staged is None:
                self._forget_old_value(slot)
                staged = self._staging[id(param)] = [self._take_buffer({id(param)}), 0]
            view = self._view(staged[0], slot.numel)
            view[lo:hi].copy_(values.reshape(-1))
            if slot.cached is not None:
                slot.cached[lo:hi].copy_(values.reshape(-1))
            staged[1] += hi - lo
            if staged[1] >= slot.numel:
                del self._staging[id(param)]
                self.store.async_write(slot.key, view)
                self._writing.append(staged[0])
                self.written_bytes += slot.numel * view.element_size()

    def flush(self) -> None:
        if self._staging:
            raise RuntimeError(f"NVMe parameter offload: {len(self._staging)} shard(s) were only partly written")
        if self._writing or self._borrowed:
            self._wait_writes()
            self._borrowed = False

    # --- accounting ---------------------------------------------------------------------------------------
    def offloaded_bytes(self) -> int:
        """Bytes of shards in the store (not in memory), by the model's dtype."""
        size = torch.empty(0, dtype=self.dtype or torch.float32).element_size()
        return sum(s.numel for s in self.slots.values()) * size

    def buffer_bytes(self) -> int:
        size = torch.empty(0, dtype=self.dtype or torch.float32).element_size()
        return (self._allocated * self.buffer_size + self.cached_numel) * size

    def check_modules(self, gathered_together: Iterable[tuple[str, list[torch.nn.Parameter]]]) -> None:
        """Every module's swapped parameters (``(name, parameters it gathers at once)`` pairs) must fit in the
        pool at once."""
        for name, params in gathered_together:
            count = sum(1 for p in params if id(p) in self.slots)
            if count > self.buffer_count:
                raise ConfigError(Problem("zero_optimization.offload_param.buffer_count",
                                          f"{self.buffer_count} buffers cannot hold the {count} swapped "
                                          f"parameters that module '{name or 'root'}' gathers at once",
                                          f"set buffer_count to at least {count}"))

    def stats(self) -> dict[str, int]:
        return {"read_bytes": self.read_bytes, "written_bytes": self.written_bytes,
                "read_ahead_hits": self.read_ahead_hits, "buffers": self._allocated,
                "cached_numel": self.cached_numel, "swapped_params": len(self.slots)}

    def close(self) -> None:
        """Stop: wait for I/O, forget the buffers and delete this rank's swap folder."""
        if self._closed:
            return
        self._closed = True
        self.store.close()  # waits for pending I/O, then removes the folder
        self._free, self._writing = [], []


def attach_param_offload(params: Iterable[torch.nn.Parameter], section: OffloadParamConfig,
                         compute_device: torch.device, dtype: torch.dtype | None,
                         aio_config: AioSettings = None, rank: int = 0,
                         gathered_together: Iterable[tuple[str, list[torch.nn.Parameter]]] = ()
                         ) -> ParamOffload | None:
    """Offload the shards of partitioned ``params`` as ``section`` (``offload_param``) says; returns the owner.

    Parameters that stay gathered (``ds_persist``) and non-floating ones keep their shard where it is. A
    model built under ``zero.Init(remote_device=...)`` arrives already offloaded: the same owner is kept
    when the devices agree; otherwise its shards come back first."""
    params = list(params)
    device = getattr(section, "device", None) or "none"
    owners = {id(o): o for p in params if (o := offload_of(p)) is not None}
    offload = next((o for o in owners.values() if o.device == device), None)
    for p in params:
        owner = offload_of(p)
        if owner is not None and owner is not offload:
            owner.release(p)
    for owner in owners.values():
        if owner is not offload:
            owner.close()
    if device == "none":
        return None
    if offload is None:
        offload = build_param_offload(section, compute_device, aio_config=aio_config, rank=rank, dtype=dtype)
    for p in params:
        owned = offload_of(p) is offload
        if p.ds_persist or not p.ds_tensor.is_floating_point():
            if owned:
                offload.release(p)
            continue
        if not owned:
            offload.adopt(p)
    if isinstance(offload, NvmeParamOffload):
        offload.check_modules(gathered_together)
    return offload


def build_param_offload(section: OffloadParamConfig, compute_device: torch.device,
                        aio_config: AioSettings = None, rank: int = 0,
                        dtype: torch.dtype | None = None) -> ParamOffload | None:
    """The offload object for a ``zero_optimization.offload_param`` section (None: no offload)."""
    device = getattr(section, "device", None) or "none"
    if device == "none":
        return None
    if device == "cpu":
        return ParamOffload(compute_device, pin_memory=bool(section.pin_memory))
    if not section.nvme_path:
        raise ConfigError(Problem("zero_optimization.offload_param.nvme_path", "required when device is 'nvme'",
                                  "a directory on a fast local drive, e.g. /local_nvme"))
    return NvmeParamOffload(section.nvme_path, compute_device, pin_memory=bool(section.pin_memory),
                            buffer_count=int(section.buffer_count), buffer_size=int(section.buffer_size),
                            max_in_cpu=int(section.max_in_cpu), aio_config=aio_config, rank=rank, dtype=dtype)
