"""ZeRO-3 parameter partitioning: one parameter split across the ranks of a data-parallel group.

Each parameter is split on its own (DeepSpeed's layout): every rank keeps ``ceil(numel / N)`` elements of
the flattened tensor, rank r the elements ``[r * P, (r + 1) * P)``, and the last ranks' shards are padded with
zeros. A partitioned parameter keeps its ``torch.nn.Parameter`` object (so optimizers, tied weights and
``named_parameters`` still see one thing) but its ``.data`` is an empty placeholder; the shard lives in
``param.ds_tensor``. Gathering all-gathers the shards into a fresh full buffer and points ``.data`` at it;
releasing drops the buffer again. Attributes (DeepSpeed's names, so code that inspects them keeps working):

``ds_id``            a number unique in this process, the same on every rank for the same construction order
``ds_shape``         the full shape; ``ds_numel`` its number of elements
``ds_tensor``        this rank's shard, 1-D, ``ds_partition_numel`` elements
``ds_status``        :class:`ParamStatus`
``ds_persist``       kept gathered between uses (small parameters, ``stage3_param_persistence_threshold``)
``ds_process_group`` the group it is partitioned over (None: the world)
``ds_buffer_pool``   optional :class:`GatherBufferPool` that released full buffers go back to (CPU)
``ds_quantized_gather`` optional: elements per INT8 scale when this parameter's gathers are quantized (ZeRO++
                     qwZ, :mod:`dsrun.comm.quantized`); the shard itself stays exact
``ds_quantized_shard`` optional (``zero_quantized_nontrainable_weights``, frozen parameters): the shard kept as its
                     INT8 message (:mod:`.quantized_shards`); ``ds_tensor`` is then an empty placeholder
``ds_offload``       with ``offload_param``: the object that owns the shard (:mod:`dsrun.offload.param_swapper`);
                     for NVMe ``ds_tensor`` is then an empty placeholder and the shard lives in a file
``ds_whole``         True while the stage-3 strategy keeps it whole (a partition group of one: ``.data`` views
                     ``ds_tensor``, :mod:`.whole_params`); such a parameter is never released

Where the gathers run is set by the stage-3 sharding policy (:mod:`.sharding`; MiCS, hpZ: :mod:`.zeropp`): ``ds_gather_levels`` (a hierarchical gather's
node-local and cross-node groups) and the hpZ secondary partition ``ds_secondary_tensor`` over
``ds_secondary_group`` (``ds_secondary_world_size`` ranks, this rank's place ``ds_secondary_rank``), refreshed
from every full gather and read by gathers with ``secondary=True`` while ``ds_secondary_valid``.
"""
from __future__ import annotations

import contextlib
import itertools
from enum import Enum
from typing import Iterable, Protocol

import torch

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.comm.quantized import all_gather_messages, quantized_all_gather_into_tensor

from dsrun.zero import quantized_shards


class ParamStatus(Enum):
    NOT_AVAILABLE = "not_available"  # only the shard exists
    INFLIGHT = "inflight"  # an asynchronous all-gather is filling the full buffer
    AVAILABLE = "available"  # .data is the full tensor


_ids = itertools.count()
WHOLE_ATTR = "ds_whole"  # kept whole by the stage-3 strategy (:mod:`.whole_params`)
_exact_gathers = [False]  # True inside exact_gathers(): quantized parameters gather their exact shards


@contextlib.contextmanager
def exact_gathers():
    """Gathers started inside carry the exact shards even for qwZ parameters (saving full weights)."""
    before, _exact_gathers[0] = _exact_gathers[0], True
    try:
        yield
    finally:
        _exact_gathers[0] = before


def gathers_exact() -> bool:
    """Inside :func:`exact_gathers`?"""
    return _exact_gathers[0]


def is_zero_param(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def partition_numel(numel: int, world_size: int) -> int:
    """Elements each rank keeps of a parameter with ``numel`` elements."""
    return -(-numel // world_size) if numel else 0


def _placeholder(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


def partition_param(param: torch.nn.Parameter, group: ProcessGroup = None, dtype: torch.dtype | None = None,
                    device: torch.device | None = None) -> torch.nn.Parameter:
    """Turn a full parameter (identical on every rank) into a partitioned one, in place; returns it.

    The full tensor is freed (unless something else still references it)."""
    if is_zero_param(param):
        return param
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    full = param.data
    dtype = dtype or full.dtype
    device = device or full.device
    numel = full.numel()
    part = partition_numel(numel, world)
    shard = torch.zeros(part, dtype=dtype, device=device)
    start = min(rank * part, numel)
    end = min(start + part, numel)
    if end > start:
        shard[: end - start].copy_(full.reshape(-1)[start:end])
    param.ds_id = next(_ids)
    param.ds_shape = full.shape
    param.ds_numel = numel
    param.ds_partition_numel = part
    param.ds_tensor = shard
    param.ds_status = ParamStatus.NOT_AVAILABLE
    param.ds_persist = False
    param.ds_process_group = group
    param.ds_world_size = world
    param.ds_handle = None
    param.data = torch.empty(0, dtype=dtype, device=device)
    return param


def shard_padding(param: torch.nn.Parameter, rank: int) -> int:
    """Zero padding elements at the end of ``rank``'s shard of ``param``."""
    start = rank * param.ds_partition_numel
    return max(0, param.ds_partition_numel - max(0, param.ds_numel - start))


def _storage_references(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s memory (tensors and views on it, plus the one this call makes)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


# what :func:`_storage_references` says of a tensor nothing else refers to (the storage object the call makes
# counts too: 2, not 1)
_LONE_TENSOR_REFERENCES = _storage_references(torch.empty(1))


class GatherBufferPool:
    """Full-parameter buffers released by their parameters, kept (up to ``limit`` elements in all) for the
    next gather of the same size. On the CPU a fresh buffer costs a page fault per 4 KiB when the all-gather
    first writes it (ZeRO-3 pins glibc's mmap threshold, :mod:`.host_memory`, so freed buffers leave the
    process); reusing one skips that. A buffer is kept only when nothing but the pool refers to its memory
    (no view of it saved for backward, for instance), so a reused buffer never overwrites live values."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.numel = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self.hits = self.misses = 0  # gathers served from the pool, and not

    def take(self, numel: int) -> torch.Tensor | None:
        free = self._free.get(numel)
        if not free:
            self.misses += 1
            return None
        self.hits += 1
        self.numel -= numel
        return free.pop()

    def give(self, buffer: torch.Tensor) -> None:
        numel = buffer.numel()
        if buffer._base is not None or buffer.device.type != "cpu" or self.numel + numel > self.limit:
            return
        if _storage_references(buffer) != _LONE_TENSOR_REFERENCES:
            return  # something else (a saved view) still reads this memory
        self._free.setdefault(numel, []).append(buffer)
        self.numel += numel

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def clear(self) -> None:
        self._free, self.numel = {}, 0


class Waitable(Protocol):
    """An asynchronous collective in flight (torch's work object, or the quantized gather's)."""

    def wait(self) -> object: ...


class GatherHandle:
    """An all-gather in flight for one parameter; :meth:`wait` makes the parameter available (and, for a
    gather of the primary partition, refreshes the hpZ secondary one from it)."""

    def __init__(self, param: torch.nn.Parameter, buffer: torch.Tensor, work: Waitable | None,
                 refresh_secondary: bool = False):
        self.param = param
        self.buffer = buffer
        self.work = work
        self.refresh_secondary = refresh_secondary

    def wait(self, handle_dependency: bool = True) -> None:
        """``handle_dependency``: DeepSpeed's keyword (an accelerator that resolves the buffer's data dependency
        itself); a gather here always hands its buffer over when it completes."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        param = self.param
        if param.ds_handle is self:
            param.ds_gathered = self.buffer
            param.data = self.buffer[: param.ds_numel].view(param.ds_shape)
            param.ds_status = ParamStatus.AVAILABLE
            param.ds_handle = None
            if self.refresh_secondary:
                _refresh_secondary(param, self.buffer)


def _refresh_secondary(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's piece of the hpZ secondary partition out of a freshly gathered full value."""
    part = param.ds_secondary_tensor.numel()
    start = min(param.ds_secondary_rank * part, param.ds_numel)
    end = min(start + part, param.ds_numel)
    with torch.no_grad():
        param.ds_secondary_tensor[: end - start].copy_(full[start:end])
        param.ds_secondary_tensor[end - start:].zero_()
    param.ds_secondary_valid = True


def start_gather(param: torch.nn.Parameter, async_op: bool, secondary: bool = False) -> GatherHandle | None:
    """Begin gathering ``param`` unless it is available or already in flight; returns the handle (None when
    nothing had to start). ``secondary``: from the hpZ secondary partition when it is current (backward)."""
    if param.ds_status is not ParamStatus.NOT_AVAILABLE:
        return None
    levels = None
    message = None  # a shard kept quantized: its stored INT8 message
    if secondary and getattr(param, "ds_secondary_valid", False):
        shard, group, world = param.ds_secondary_tensor, param.ds_secondary_group, param.ds_secondary_world_size
    else:
        owner = getattr(param, "ds_offload", None)
        message = quantized_shards.message_of(param)
        shard = owner.gather_input(param) if owner is not None else param.ds_tensor
        group, world = param.ds_process_group, param.ds_world_size
        levels = getattr(param, "ds_gather_levels", None)
        secondary = False
        if message is not None and (world == 1 or levels is not None):
            shard, message = quantized_shards.dequantized_shard(param), None  # decoded here, gathered as values
    if world == 1:
        buffer = shard
        work = None
    else:
        part = param.ds_partition_numel if message is not None else shard.numel()
        numel = part * world
        dtype, device = shard.dtype, shard.device  # a kept message: shard is the placeholder in the model dtype
        pool = getattr(param, "ds_buffer_pool", None)
        buffer = pool.take(numel) if pool is not None else None
        if buffer is None or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
        block = getattr(param, "ds_quantized_gather", None)
        if levels is not None:  # MiCS hierarchical: two synchronous steps
            comm.all_gather_hierarchical(buffer, shard, *levels)
            work = None
        elif message is not None:  # a shard kept quantized: its message as it is, decoded into buffer
            work = all_gather_messages(buffer, message, part, group=group, async_op=async_op,
                                       block=param.ds_quantized_block)
        elif block and not _exact_gathers[0]:  # ZeRO++ qwZ: INT8 blocks on the wire, decoded into buffer
            work = quantized_all_gather_into_tensor(buffer, shard, group=group, async_op=async_op, block=block)
        else:
            work = comm.all_gather_into_tensor(buffer, shard, group=group, async_op=async_op)
        if not async_op:
            work = None
    refresh = not secondary and getattr(param, "ds_secondary_tensor", None) is not None
    handle = GatherHandle(param, buffer, work, refresh_secondary=refresh)
    param.ds_handle = handle
    param.ds_status = ParamStatus.INFLIGHT
    return handle


def gather_params(params: Iterable[torch.nn.Parameter], secondary: bool = False) -> None:
    """Make every parameter available (synchronously; waits for ones already in flight); ``secondary``: from
    the hpZ secondary partitions where current."""
    for param in params:
        if param.ds_status is ParamStatus.NOT_AVAILABLE:
            start_gather(param, async_op=False, secondary=secondary).wait()
        elif param.ds_status is ParamStatus.INFLIGHT:
            param.ds_handle.wait()


def gather_exact(params: list[torch.nn.Parameter]) -> list[bool]:
    """Make every parameter available with its exact value, even qwZ ones (whose gathered copy, if they were
    available, is the dequantized one: released and gathered again from the exact shards). Returns, per
    parameter, whether it stays available afterwards as it was before (False: release it when done)."""
    was = [p.ds_status is ParamStatus.AVAILABLE for p in params]
    for k, p in enumerate(params):
        if getattr(p, "ds_quantized_gather", None) and p.ds_status is not ParamStatus.NOT_AVAILABLE:
            release_param(p)
            was[k] = False
    with exact_gathers():
        gather_params(params)
    return was


def release_param(param: torch.nn.Parameter) -> None:
    """Drop the full tensor; only the shard remains (not for a parameter kept whole: its ``.data`` is its
    shard)."""
    if getattr(param, WHOLE_ATTR, False):
        return
    if param.ds_status is ParamStatus.INFLIGHT:
        param.ds_handle.wait()  # a collective in flight must finish before its buffer can go
    if param.ds_status is ParamStatus.AVAILABLE:
        param.data = _placeholder(param)
        param.ds_status = ParamStatus.NOT_AVAILABLE
        buffer, param.ds_gathered = getattr(param, "ds_gathered", None), None
        pool = getattr(param, "ds_buffer_pool", None)
        # over a group of one the gathered buffer is the shard itself, unless the shard lives in a swap file
        # (then it is the private copy the offload made for this gather)
        owner = getattr(param, "ds_offload", None)
        private = param.ds_world_size > 1 or (owner is not None and owner.swapped(param))
        if pool is not None and buffer is not None and private:
            pool.give(buffer)


def write_full_value(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Replace ``param``'s value with ``full`` (the same on every rank): this rank keeps its shard of it."""
    rank = comm.get_rank(param.ds_process_group)
    part = param.ds_partition_numel
    flat = full.detach().reshape(-1)
    start = min(rank * part, param.ds_numel)
    end = min(start + part, param.ds_numel)
    with torch.no_grad():
        shard = torch.zeros(part, dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)
        if end > start:
            shard[: end - start].copy_(flat[start:end])
        write_shard(param, shard)
        master = getattr(param, "ds_fp32_shard", None)
        if master is not None and master.data_ptr() != param.ds_tensor.data_ptr():
            master.copy_(shard)  # the optimizer's fp32 copy follows the change


def mark_stale(param: torch.nn.Parameter) -> None:
    """The shard changed: the hpZ secondary partition must be refreshed by the next full gather."""
    param.ds_secondary_valid = False


def write_shard(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """Set this rank's shard of ``param`` to ``values`` (``ds_partition_numel`` elements), wherever it lives."""
    mark_stale(param)
    owner = getattr(param, "ds_offload", None)
    if owner is not None:
        owner.write_shard(param, values)
        owner.flush()
    elif quantized_shards.message_of(param) is not None:
        quantized_shards.write_quantized(param, values)
    elif values.data_ptr() != param.ds_tensor.data_ptr():
        with torch.no_grad():
            param.ds_tensor.copy_(values)


def full_tensor(param: torch.nn.Parameter) -> torch.Tensor:
    """A copy of the full value of a partitioned parameter (collective: every rank must call it)."""
    was_available = gather_exact([param])[0]
    value = param.data.detach().clone()
    if not was_available:
        release_param(param)
    return value
