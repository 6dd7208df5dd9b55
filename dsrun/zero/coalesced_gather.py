"""One collective for a fetch's ZeRO-3 parameters: DeepSpeed's coalesced gather and its all-reduce variant.

``zero_optimization.stage3_allgather_sequential`` false (DeepSpeed's default) gathers the parameters one fetch
needs (a module's, or a prefetch bucket's) with one ``all_gather_into_tensor`` over their concatenated shards:
rank r's piece of the output holds its shard of every parameter in turn, so each parameter's full value is
copied out of the N pieces into its own buffer (DeepSpeed copies too: a parameter's value must be one contiguous
tensor). True gathers each parameter with a collective of its own (:func:`~.partition_params.start_gather`).

``stage3_use_all_reduce_for_fetch_params`` replaces that collective by one ``all_reduce`` (sum) of a zeroed flat
buffer holding each parameter's padded full slot, this rank's shard written at its offset in it: the sum of
zeros and one value is exact, and every parameter's value is a view of the flat buffer, no copy out. As in
DeepSpeed it is not used for quantized or secondary (hpZ) gathers, which gather as they would without it.

A parameter whose gather is not a plain all-gather of an in-memory shard is gathered on its own, as before: a
shard kept quantized or gathered as INT8 blocks (qwZ), a MiCS hierarchical gather, an offloaded shard (its owner
prepares it for the gather), a group of one. hpZ's secondary gathers coalesce over the secondary group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from dsrun import comm
from dsrun.zero import quantized_shards
from dsrun.zero.partition_params import (GatherBufferPool, GatherHandle, ParamStatus, Waitable, gathers_exact,
                                         start_gather)


@dataclass
class FetchMode:
    """How the coordinator's fetches are carried. ``scratch``: the CPU pool the coalesced all-gather's flat
    output is taken from and returned to (the same sizes recur module by module)."""

    coalesced: bool = False
    all_reduce: bool = False
    scratch: GatherBufferPool | None = None


SEQUENTIAL = FetchMode()


def coalesces(sequential: bool | None, device: torch.device) -> bool:
    """Whether fetches coalesce, for ``stage3_allgather_sequential`` as set; unset: not on the CPU (coalescing
    measured no faster over gloo and raised a rank's peak by its flat output, docs/zero3.md), else DeepSpeed's
    default (coalesced)."""
    return device.type != "cpu" if sequential is None else not sequential


def _plain_source(param: torch.nn.Parameter, secondary: bool) -> tuple[torch.Tensor, object, int, bool] | None:
    """(shard, group, ranks, from the secondary partition) when ``param``'s gather is a plain all-gather of an
    in-memory shard, else None (it is gathered on its own)."""
    if secondary and getattr(param, "ds_secondary_valid", False):
        return param.ds_secondary_tensor, param.ds_secondary_group, param.ds_secondary_world_size, True
    if (getattr(param, "ds_offload", None) is not None or quantized_shards.message_of(param) is not None
            or getattr(param, "ds_gather_levels", None) is not None or param.ds_world_size == 1
            or (getattr(param, "ds_quantized_gather", None) and not gathers_exact())):
        return None
    return param.ds_tensor, param.ds_process_group, param.ds_world_size, False


class _CoalescedWork:
    """The one collective of a coalesced fetch; waiting on it (once, from whichever parameter's handle asks
    first) puts every parameter's full value into its buffer."""

    def __init__(self, work: Waitable | None, flat: torch.Tensor, world: int,
                 slots: list[tuple[torch.Tensor, int, int]], scratch: GatherBufferPool | None):
        self.work, self.flat, self.world, self.slots, self.scratch = work, flat, world, slots, scratch
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        if self.slots:  # all-gather: rank r's piece holds its shard of each parameter in turn
            pieces = self.flat.view(self.world, -1)
            for buffer, offset, part in self.slots:
                buffer.view(self.world, part).copy_(pieces[:, offset:offset + part])
            del pieces  # the pool keeps a buffer only when nothing else refers to its memory
        flat, self.done, self.work, self.flat, self.slots = self.flat, True, None, None, []
        if self.scratch is not None and flat is not None:
            self.scratch.give(flat)


def _take(pool: GatherBufferPool | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    buffer = pool.take(numel) if pool is not None else None
    if buffer is None or buffer.dtype != like.dtype or buffer.device != like.device:
        buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer


def _start_batch(batch: list[tuple[torch.nn.Parameter, torch.Tensor]], group: object, world: int, secondary: bool,
                 async_op: bool, mode: FetchMode) -> list[GatherHandle]:
    """One collective for ``batch``'s parameters (shards of one dtype over one group)."""
    first = batch[0][1]
    buffers: list[torch.Tensor] = []
    if mode.all_reduce and not secondary:
        rank = comm.get_rank(group)
        flat = torch.zeros(sum(s.numel() * world for _, s in batch), dtype=first.dtype, device=first.device)
        offset = 0
        for _, shard in batch:
            part = shard.numel()
            flat[offset + rank * part: offset + (rank + 1) * part].copy_(shard)
            buffers.append(flat[offset: offset + part * world])
            offset += part * world
        work = _CoalescedWork(comm.all_reduce(flat, group=group, async_op=async_op), flat, world, [], None)
    else:
        parts = [s.numel() for _, s in batch]
        flat = _take(mode.scratch, sum(parts) * world, first)
        shards = torch.cat([s for _, s in batch]) if len(batch) > 1 else first
        collective = comm.all_gather_into_tensor(flat, shards, group=group, async_op=async_op)
        slots, offset = [], 0
        for (param, _), part in zip(batch, parts):
            buffers.append(_take(getattr(param, "ds_buffer_pool", None), part * world, first))
            slots.append((buffers[-1], offset, part))
            offset += part
        work = _CoalescedWork(collective, flat, world, slots, mode.scratch)
    if not async_op:
        work.wait()
    handles = []
    for (param, _), buffer in zip(batch, buffers):
        refresh = not secondary and getattr(param, "ds_secondary_tensor", None) is not None
        handle = GatherHandle(param, buffer, work, refresh_secondary=refresh)
        param.ds_handle, param.ds_status = handle, ParamStatus.INFLIGHT
        handles.append(handle)
    return handles


def start_gathers(params: Iterable[torch.nn.Parameter], async_op: bool, secondary: bool = False,
                  mode: FetchMode = SEQUENTIAL) -> list[GatherHandle]:
    """Begin gathering those of ``params`` that are not available or in flight, as ``mode`` says; returns the
    handles. Coalesced: one collective per group and dtype of the plain gathers (in ``params``' order, the same
    on every rank), the others one each."""
    pending = [p for p in params if p.ds_status is ParamStatus.NOT_AVAILABLE]
    if not (mode.coalesced or mode.all_reduce):
        return [h for h in (start_gather(p, async_op, secondary) for p in pending) if h is not None]
    handles: list[GatherHandle] = []
    batches: dict[tuple, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
    groups: dict[tuple, tuple[object, int, bool]] = {}
    for p in pending:
        source = _plain_source(p, secondary)
        if source is None:
            handle = start_gather(p, async_op, secondary)
            if handle is not None:
                handles.append(handle)
            continue
        shard, group, world, from_secondary = source
        key = (id(group), from_secondary, shard.dtype, shard.device)
        batches.setdefault(key, []).append((p, shard))
        groups[key] = (group, world, from_secondary)
    for key, batch in batches.items():
        group, world, from_secondary = groups[key]
        if mode.coalesced:
            handles += _start_batch(batch, group, world, from_secondary, async_op, mode)
        elif from_secondary:  # sequential with all-reduce: a secondary gather stays an all-gather
            handles += [start_gather(p, async_op, secondary) for p, _ in batch]
        else:  # sequential with all-reduce: one all-reduce per parameter
            for item in batch:
                handles += _start_batch([item], group, world, False, async_op, mode)
    return handles


def gather_params_with(params: Iterable[torch.nn.Parameter], secondary: bool, mode: FetchMode) -> None:
    """:func:`~.partition_params.gather_params` with ``mode``'s collectives: every parameter available."""
    params = list(params)
    for handle in start_gathers(params, async_op=False, secondary=secondary, mode=mode):
        handle.wait()
    for p in params:
        if p.ds_status is ParamStatus.INFLIGHT:
            p.ds_handle.wait()
