"""ZeRO-Infinity's optimizer side: each sub-group's fp32 master, optimizer states and gradient in swap files.

Per sub-group ``i`` the :class:`~.swap_store.SwapStore` holds ``master.i``, one file per optimizer state
(``exp_avg.i``, ``exp_avg_sq.i`` for Adam) and, between backward and the step, ``grad.i``. Host memory is a
pool of ``buffer_count`` page-aligned buffers of the largest sub-group's size, shared by

* **backward**: a sub-group's fp32 gradient is *open* in a pool buffer while its parameters' reduced shards
  arrive; once all have arrived (or backward ends) it is written to ``grad.i`` behind the next buckets' work
  and the buffer is recycled. With gradient accumulation the next micro-step reads it back before adding.
  On the boundary micro-step the closing sub-group's squared norm and finiteness are recorded, so the step
  can clip and skip without reading the gradients again. ``grad.i`` is written in the 16-bit model dtype
  when that is exact: every element received at most one contribution this step, itself in the model dtype
  (one micro-step per step and 16-bit reduction, the usual bf16 run). The file and its I/O are then half
  the fp32 size; otherwise (gradient accumulation, fp32 reduction or model) it is fp32;
* **the step**: ``depth`` slots of (master, gradient, states) buffers: the read of sub-group i+1 and the
  write of sub-group i-1 run on the async I/O threads while the CPU optimizer updates sub-group i and writes
  its 16-bit copy into the model's shards (:func:`~.pipeline.run_swap_pipeline`). A sub-group's files are
  read side by side, one read lane of the store each (a deeper queue on the disk than one file at a time).

Resident bytes: ``buffer_count * max_sub_group * 4`` plus, with a 16-bit model, ``depth * max_sub_group * 2``
for the fused 16-bit output; everything else of the optimizer lives in the files.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from dsrun.utils.errors import ConfigError, Problem

from dsrun.offload.backward_step import BackwardSteps, Publish
from dsrun.offload.pipeline import PipelineTimes, run_swap_pipeline
from dsrun.offload.settings import KEY, OffloadOptimizerSettings
from dsrun.offload.swap_store import SwapStore

if TYPE_CHECKING:
    from dsrun.ops.cpu_optimizer import CPUOptimizer

NORM_CHUNK = 1 << 20
CONVERT_CHUNK = 1 << 20
# DeepSpeed's ``runtime.swap_tensor.MIN_SWAPPABLE_BYTES``: the smallest tensor (1 MiB) its swapper sends to NVMe, a
# size its tests build models from. dsrun's swap stores take tensors of any size, so here it is only that number.
MIN_SWAPPABLE_BYTES = 1 << 20


def narrow_in_place(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Convert the first ``numel`` fp32 elements of ``buffer`` to the 2-byte ``dtype``, packed at the start of
    the same memory, and return that view (no full-size temporary). In ascending chunks of ``C`` elements,
    chunk ``c >= 1`` lands on bytes ``[2cC, 2(c+1)C)``, below its own source ``[4cC, ...)`` and on sources
    already converted; only chunk 0 overlaps itself and goes through a temporary."""
    src, dst = buffer[:numel], buffer.view(dtype)[:numel]
    head = src[:CONVERT_CHUNK].to(dtype)
    for lo in range(CONVERT_CHUNK, numel, CONVERT_CHUNK):
        dst[lo:lo + CONVERT_CHUNK].copy_(src[lo:lo + CONVERT_CHUNK])
    dst[:head.numel()].copy_(head)
    return dst


def widen_in_place(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`narrow_in_place`: ``numel`` 2-byte ``dtype`` elements packed at the start of
    ``buffer`` become its first ``numel`` fp32 elements (``dtype`` fp32: they already are). Descending chunks:
    chunk ``c >= 1`` writes bytes ``[4cC, 4(c+1)C)``, the sources of chunks ``2c`` and ``2c + 1``, already
    converted."""
    if dtype == torch.float32:
        return buffer[:numel]
    src, dst = buffer.view(dtype)[:numel], buffer[:numel]
    head = src[:CONVERT_CHUNK].float()
    for lo in reversed(range(CONVERT_CHUNK, numel, CONVERT_CHUNK)):
        dst[lo:lo + CONVERT_CHUNK].copy_(src[lo:lo + CONVERT_CHUNK])
    dst[:head.numel()].copy_(head)
    return dst


def grad_stats(grad: torch.Tensor) -> tuple[float, bool]:
    """(sum of squares in float64, all finite) of a flat fp32 gradient, without a full-size temporary: one
    float64 chunk buffer is reused (a fresh chunk-sized temporary per chunk costs page faults every time, as
    ZeRO-3 returns freed blocks of this size to the OS); squaring in place equals ``pow(2)``."""
    sq, finite = 0.0, True
    scratch = torch.empty(min(NORM_CHUNK, grad.numel()), dtype=torch.float64)
    for chunk in grad.split(NORM_CHUNK):
        d = scratch[:chunk.numel()]
        d.copy_(chunk)
        s = float(d.mul_(d).sum())
        sq += s
        finite = finite and math.isfinite(s)
    return sq, finite


@dataclass
class _Slot:
    master: torch.Tensor
    grad: torch.Tensor
    states: dict[str, torch.Tensor]
    low_precision: torch.Tensor | None


@dataclass
class SwappedUnit:
    """One NVMe-resident sub-group: its index among the strategy's sub-groups, size and parameter count."""

    index: int
    numel: int
    params_per_step: int
    group_index: int
    state_keys: tuple[str, ...] = ()  # the optimizer states of its param group (set by ``add_unit``)
    kept_fp32: bool = False  # its shards are fp32 (data_types.keep_in_fp32_modules): they take the master itself


class BufferPool:
    """``count`` page-aligned fp32 buffers of ``numel`` elements, allocated on first use."""

    def __init__(self, store: SwapStore, count: int, numel: int):
        self.store, self.count, self.numel = store, count, numel
        self.free: list[torch.Tensor] = []
        self.allocated = 0

    def take(self) -> torch.Tensor | None:
        if self.free:
            return self.free.pop()
        if self.allocated < self.count:
            self.allocated += 1
            return self.store.aligned_buffer(self.numel, torch.float32)
        return None

    def give(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)

    def available(self) -> int:
        """Buffers :meth:`take` can still hand out."""
        return len(self.free) + self.count - self.allocated

    @property
    def nbytes(self) -> int:
        return self.allocated * self.numel * 4


def as_dtype(buffer: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of an fp32 pool buffer seen as ``dtype`` (bf16 states use half of it)."""
    return (buffer if dtype == torch.float32 else buffer.view(dtype))[:numel]


class SwappedOptimizerState:
    """Masters, optimizer states and gradients of the NVMe-offloaded sub-groups of one rank."""

    def __init__(self, settings: OffloadOptimizerSettings, optimizer: CPUOptimizer, rank: int,
                 model_dtype: torch.dtype, measure_gradients: bool = True):
        self.settings = settings
        self.optimizer = optimizer
        self.state_keys: tuple[str, ...] = tuple(optimizer.STATE_KEYS)
        self.state_dtype: torch.dtype = optimizer._state_dtype()
        self.model_dtype = model_dtype
        # record each gradient's norm and finiteness as it is swapped out (needed for clipping / fp16 skips)
        self.measure_gradients = measure_gradients
        self.per_slot = 2 + len(self.state_keys)  # master, gradient, states
        if settings.buffer_count < self.per_slot:
            raise ConfigError(Problem(f"{KEY}.buffer_count", f"got {settings.buffer_count}; NVMe offload with "
                                      f"{type(optimizer).__name__} needs at least {self.per_slot} buffers (master, "
                                      f"gradient and {len(self.state_keys)} state(s) of one sub-group)",
                                      f"set buffer_count to {3 * self.per_slot} to overlap reads, update and writes"))
        self.depth = min(3, settings.buffer_count // self.per_slot)
        # one read lane per file of a sub-group: its master, gradient and states are read side by side
        self.store = SwapStore(settings.nvme_path, settings.aio, rank=rank, pin_memory=settings.pin_memory,
                               read_lanes=self.per_slot)
        self.units: list[SwappedUnit] = []
        self.steps: dict[int, int] = {}
        self.pool: BufferPool | None = None
        self._staging: list[torch.Tensor] = []
        # gradients
        self._open: OrderedDict[int, torch.Tensor] = OrderedDict()  # sub-group -> its open gradient's buffer
        self._remaining: dict[int, int] = {}
        self._writing: list[torch.Tensor] = []
        # 16-bit gradient files: the elements that got a contribution this step, and the sub-groups whose
        # gradient is no longer exact in the model dtype (a second contribution, or one in another dtype)
        self.narrow_dtype = model_dtype if model_dtype in (torch.bfloat16, torch.float16) else None
        self._contributed: dict[int, set[int]] = {}
        self._wide: set[int] = set()
        self._boundary = True
        self.stats: dict[int, tuple[float, bool]] = {}
        self.last_times = PipelineTimes()
        self.backward_steps: BackwardSteps | None = None  # super_offload: sub-groups stepped during backward

    def step_during_backward(self, param_group: Callable[[int], dict[str, Any]], publish: Publish) -> None:
        """``super_offload``: step each sub-group during the boundary's backward once its gradient is final
        (:mod:`.backward_step`); ``publish`` as :meth:`step`'s, but writing without a copy."""
        self.backward_steps = BackwardSteps(self, param_group, publish)

    # ------------------------------------------------------------------ construction
    def add_unit(self, unit: SwappedUnit, master: torch.Tensor) -> None:
        """Write sub-group ``unit``'s initial fp32 master (and, unless ``fast_init``, zero states) to files."""
        # an optimizer whose groups keep different states names them per group (Muon's: none for a Muon group)
        per_group = getattr(self.optimizer, "tile_state_keys", None)
        unit.state_keys = (tuple(per_group(self.optimizer.param_groups[unit.group_index])) if per_group is not None
                           else self.state_keys)
        self.units.append(unit)
        self.steps[unit.index] = 0
        self.store.write(self._key("master", unit.index), master.detach().float().contiguous())
        if not self.settings.fast_init:
            zeros = torch.zeros(unit.numel, dtype=self.state_dtype)
            for key in unit.state_keys:
                self.store.async_write(self._key(key, unit.index), zeros)
            self.store.wait_writes()
        # fast_init: no state files yet; the first step starts from zeros in its buffers

    def finish_setup(self) -> None:
        largest = max((u.numel for u in self.units), default=0)
        self.pool = BufferPool(self.store, self.settings.buffer_count, largest)
        self._unit_by_index = {u.index: u for u in self.units}

    @staticmethod
    def _key(name: str, index: int) -> str:
        return f"{name}.{index}"

    # ------------------------------------------------------------------ gradients (backward)
    def begin_micro_step(self, boundary: bool) -> None:
        self._boundary = boundary
        self._remaining = {u.index: u.params_per_step for u in self.units}
        if self.backward_steps is not None:
            self.backward_steps.begin(boundary)

    def as_state(self, buffer: torch.Tensor, numel: int) -> torch.Tensor:
        """A pool buffer as one optimizer state of ``numel`` elements."""
        return as_dtype(buffer, self.state_dtype, numel)

    def _take_buffer(self) -> torch.Tensor:
        assert self.pool is not None
        buffer = self.pool.take()
        if buffer is None and self._writing:
            self.recycle()
            buffer = self.pool.take()
        if buffer is None and self.backward_steps is not None and self.backward_steps.give_up_read_ahead():
            buffer = self.pool.take()
        if buffer is None:  # every buffer holds an open gradient: write the oldest one out early
            oldest = next(iter(self._open))
            self._close(oldest, final=False)
            self.recycle()
            buffer = self.pool.take()
        assert buffer is not None
        return buffer

    def recycle(self) -> None:
        """Wait for gradient writes in flight and return their buffers to the pool."""
        if self._writing:
            self.store.wait_writes()
            for buffer in self._writing:
                self.pool.give(buffer)
            self._writing = []

    def accumulate(self, index: int, offset: int, values: torch.Tensor) -> None:
        """Add one parameter's reduced shard gradient (``values``, any device and dtype) at ``offset`` of
        sub-group ``index``."""
        buffer = self._open.get(index)
        if buffer is None:
            unit = self._unit_by_index[index]
            buffer = self._take_buffer()
            grad = buffer[:unit.numel]
            if self._key("grad", index) in self.store:  # earlier micro-steps of this step (or an early write-out)
                self._read_grad(index, buffer)
            else:
                grad.zero_()
            self._open[index] = buffer
        grad = buffer[:self._unit_by_index[index].numel]
        contributed = self._contributed.setdefault(index, set())
        if values.dtype != self.narrow_dtype or offset in contributed:
            self._wide.add(index)
        contributed.add(offset)
        grad[offset:offset + values.numel()].add_(values.to(grad.device))
        self._remaining[index] -= 1
        if self._remaining[index] <= 0:
            self._close(index, final=True)

    def _close(self, index: int, final: bool) -> None:
        buffer = self._open.pop(index)
        grad = buffer[:self._unit_by_index[index].numel]
        if final and self._boundary and self.backward_steps is not None:
            self.backward_steps.closed(index)
            if self.backward_steps.try_step(index, buffer):
                return
        if final and self._boundary and self.measure_gradients:
            self.stats[index] = grad_stats(grad)
        if self.narrow_dtype is not None and index not in self._wide:  # exact in the model dtype: half the bytes
            grad = narrow_in_place(buffer, grad.numel(), self.narrow_dtype)
        self.store.async_write(self._key("grad", index), grad)
        self._writing.append(buffer)

    def _read_grad(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """Read ``grad.index`` (fp32 or 16-bit) into ``buffer`` as fp32; returns the sub-group's slice."""
        numel = self._unit_by_index[index].numel
        dtype = self.store.entry(self._key("grad", index)).dtype
        self.store.read(self._key("grad", index), as_dtype(buffer, dtype, numel))
        return widen_in_place(buffer, numel, dtype)

    @contextmanager
    def gradient_in_memory(self, index: int) -> Iterator[torch.Tensor]:
        """Sub-group ``index``'s gradient for the coming step, read into a pool buffer as fp32 (zeros where no
        gradient reached it); what the caller leaves there is written back to ``grad.index`` (fp32), which the
        step then reads: for a step hook that rewrites gradients (Muon's binding writes its updates there). The
        norm and overflow were measured before, on the gradient as backward left it."""
        self.recycle()
        buffer = self._take_buffer()
        try:
            key = self._key("grad", index)
            grad = (self._read_grad(index, buffer) if key in self.store
                    else buffer[:self._unit_by_index[index].numel].zero_())
            yield grad
            self.store.write(key, grad)
        finally:
            self.pool.give(buffer)

    def end_micro_step(self) -> None:
        """Backward is over: write out every gradient still open (parameters without a gradient this pass)."""
        for index in list(self._open):
            self._close(index, final=True)

    def local_grad_stats(self) -> tuple[float, bool]:
        """Sum of squares and finiteness of this rank's swapped gradients for the coming step."""
        sq, finite = 0.0, True
        for unit in self.units:
            stats = self.stats.get(unit.index)
            if stats is None and self._key("grad", unit.index) in self.store:
                # no contribution on the boundary micro-step: measure what earlier micro-steps left
                self.recycle()
                buffer = self._take_buffer()
                stats = grad_stats(self._read_grad(unit.index, buffer))
                self.pool.give(buffer)
                self.stats[unit.index] = stats
            if stats is not None:
                sq += stats[0]
                finite = finite and stats[1]
        return sq, finite

    def zero_grad(self) -> None:
        self.recycle()
        for unit in self.units:
            key = self._key("grad", unit.index)
            if key in self.store:  # the file stays: the next step's gradient overwrites its blocks in place
                self.store.delete(key, keep_blocks=True)
        self.stats = {}
        self._contributed, self._wide = {}, set()

    # ------------------------------------------------------------------ the step
    def _slots(self) -> list[_Slot]:
        assert self.pool is not None
        self.recycle()
        slots = []
        numel = self.pool.numel
        for s in range(self.depth):
            buffers = [self.pool.take() for _ in range(self.per_slot)]
            if any(b is None for b in buffers):
                raise RuntimeError("offload buffer pool exhausted (a gradient buffer was not returned)")
            if len(self._staging) <= s and self.model_dtype != torch.float32:
                self._staging.append(self.store.aligned_buffer(numel, self.model_dtype))
            low = self._staging[s] if self.model_dtype != torch.float32 else None
            slots.append(_Slot(master=buffers[0], grad=buffers[1],
                               states={k: b for k, b in zip(self.state_keys, buffers[2:])}, low_precision=low))
        return slots

    def step(self, coef: float, param_group: Callable[[int], dict[str, Any]],
             publish: Callable[[int, torch.Tensor], None]) -> PipelineTimes:
        """Update every swapped sub-group: gradient scaled by ``coef``; ``publish(index, values)`` receives the
        updated values (16-bit when the model is, else the fp32 master) to write into the model's shards."""
        done = self.backward_steps.finish(coef) if self.backward_steps is not None else set()
        slots = self._slots()
        order = [u for u in self.units if u.index not in done]

        def issue_read(k: int) -> None:
            unit, slot = order[k], slots[k % self.depth]
            n = unit.numel
            self.store.async_read(self._key("master", unit.index), slot.master[:n], lane=0)
            key = self._key("grad", unit.index)
            if key in self.store:  # a 16-bit file is widened in place before the update
                self.store.async_read(key, as_dtype(slot.grad, self.store.entry(key).dtype, n), lane=1)
            else:
                slot.grad[:n].zero_()  # no gradient reached this sub-group this step
            for lane, name in enumerate(unit.state_keys, start=2):
                target = as_dtype(slot.states[name], self.state_dtype, n)
                key = self._key(name, unit.index)
                if key in self.store:
                    self.store.async_read(key, target, lane=lane)
                else:
                    target.zero_()  # fast_init: the states start as zeros at the first step

        def compute(k: int) -> None:
            unit, slot = order[k], slots[k % self.depth]
            n = unit.numel
            key = self._key("grad", unit.index)
            grad = widen_in_place(slot.grad, n, self.store.entry(key).dtype if key in self.store else torch.float32)
            if coef != 1.0:
                grad.mul_(coef)
            self.steps[unit.index] += 1
            low = slot.low_precision[:n] if slot.low_precision is not None and not unit.kept_fp32 else None
            self.optimizer.update_tile(param_group(unit.group_index), slot.master[:n], grad,
                                       {name: as_dtype(slot.states[name], self.state_dtype, n)
                                        for name in unit.state_keys},
                                       self.steps[unit.index], low_precision=low)
            publish(unit.index, low if low is not None else slot.master[:n])

        def issue_write(k: int) -> None:
            unit, slot = order[k], slots[k % self.depth]
            n = unit.numel
            self.store.async_write(self._key("master", unit.index), slot.master[:n])
            for name in unit.state_keys:
                self.store.async_write(self._key(name, unit.index), as_dtype(slot.states[name], self.state_dtype, n))

        try:
            self.last_times = run_swap_pipeline(len(order), self.depth, issue_read, self.store.wait_reads, compute,
                                                issue_write, self.store.wait_writes)
        finally:
            self.store.wait()
            for slot in slots:
                for buffer in (slot.master, slot.grad, *slot.states.values()):
                    self.pool.give(buffer)
        return self.last_times

    # ------------------------------------------------------------------ checkpoints
    def master_tensor(self, index: int) -> torch.Tensor:
        """Sub-group ``index``'s fp32 master, mapped from its file (paged in as it is read)."""
        return self.store.mapped(self._key("master", index))

    def state_entry(self, index: int) -> dict[str, Any] | None:
        """The optimizer state of sub-group ``index`` as the CPU optimizer keeps it (None before a step, and for a
        group without states: a Muon group's, as its in-memory step leaves it)."""
        if self.steps.get(index, 0) == 0 or not self._unit_by_index[index].state_keys:
            return None
        entry: dict[str, Any] = {"step": self.steps[index]}
        for name in self._unit_by_index[index].state_keys:
            entry[name] = self.store.mapped(self._key(name, index))
        return entry

    def load(self, index: int, master: torch.Tensor, state: dict[str, Any] | None) -> None:
        """Replace sub-group ``index``'s master and optimizer state (from a checkpoint)."""
        self.store.write(self._key("master", index), master.detach().float().contiguous())
        keys = self._unit_by_index[index].state_keys
        if state:
            self.steps[index] = int(state.get("step", 0))
            for name in keys:
                self.store.async_write(self._key(name, index), state[name].detach().to(self.state_dtype).contiguous()
                                       .reshape(-1))
            self.store.wait_writes()
        else:
            self.steps[index] = 0
            for name in keys:
                key = self._key(name, index)
                if key in self.store:
                    self.store.delete(key)

    def write_master_slice(self, index: int, offset: int, values: torch.Tensor) -> None:
        """Overwrite elements ``[offset, offset + len)`` of sub-group ``index``'s fp32 master in its file (read,
        modify, write: for ``GatheredParameters(modifier_rank=...)``, not for the training loop)."""
        self.recycle()
        buffer = self._take_buffer()
        try:
            master = self.store.read(self._key("master", index), buffer[:self._unit_by_index[index].numel])
            master[offset:offset + values.numel()].copy_(values.reshape(-1))
            self.store.write(self._key("master", index), master)
        finally:
            self.pool.give(buffer)

    def read_master(self, index: int, visit: Callable[[torch.Tensor], None]) -> None:
        """Read sub-group ``index``'s master into a pool buffer and pass it to ``visit``."""
        self.recycle()
        buffer = self._take_buffer()
        try:
            unit = self._unit_by_index[index]
            visit(self.store.read(self._key("master", index), buffer[:unit.numel]))
        finally:
            self.pool.give(buffer)

    # ------------------------------------------------------------------ accounting
    @property
    def resident_bytes(self) -> int:
        pool = self.pool.nbytes if self.pool is not None else 0
        return pool + sum(t.numel() * t.element_size() for t in self._staging)

    @property
    def swapped_bytes(self) -> int:
        return self.store.nbytes()

    def close(self) -> None:
        self.store.close()


class SwappedShard:
    """Stands for a parameter's fp32 master shard that lives in a swap file (``param.ds_fp32_shard``): a
    ``copy_`` (what ``GatheredParameters(modifier_rank=...)`` does after a change) is written through to the
    file, so the next step starts from the modified value."""

    def __init__(self, state: SwappedOptimizerState, index: int, offset: int, numel: int):
        self.state, self.index, self.offset, self.numel_ = state, index, offset, numel

    def data_ptr(self) -> int:
        return -1  # never the model's shard

    def numel(self) -> int:
        return self.numel_

    def copy_(self, values: torch.Tensor) -> "SwappedShard":
        self.state.write_master_slice(self.index, self.offset, values.detach().float().cpu())
        return self
