"""Where a ZeRO-3 shard lives between its uses in DeepCompile's graphs (``compile.offload_parameters``; DeepSpeed's
C++ ``DSParam::offload``/``reload`` behind its ``dc.offload_parameter``/``dc.reload_parameter`` ops).

The ``offload_parameters`` pass (:mod:`.passes.offload_parameters`) puts a reload before the first gather of each
shard in a graph and an offload after that gather's last use. :class:`ShardMoves` carries them out on dsrun's own
shards: an offload copies the shard into a host buffer kept for it (page-locked with CUDA) and re-points the shard
there, so the training device's copy is freed; a reload copies it into a fresh buffer on the training device and
re-points it back. Each tensor keeps its identity (only ``.data`` changes, as :mod:`dsrun.offload.state_moves`
moves states): the handle's gathers, the stage-3 step and a checkpoint read and write the same objects. A gather
that finds its shard still on the host (a pass that placed its readers before the reload) reloads it first.

What moves is a *unit* (:meth:`ShardMoves.for_strategy`): where the shards are views of their sub-group's master
(fp32; bf16 master state) the master moves whole with its views, as the step updates them in place, so
``sub_group_size`` sets how fine the moves are; elsewhere (16-bit shards beside fp32 masters) each shard moves
alone. A unit leaves only after the last use of every gather of its shards in the graph, and comes back before
the first.

Between graphs a shard stays on the host, as DeepSpeed's (its ``offload_param: cpu`` home): the stage-3 step
writes a 16-bit shard where it is. Where the shards are views of a master, the optimizer steps that master in
place on the training device, so :meth:`ShardMoves.recall` brings those units back before the step (they leave
again after their last use in the next forward); every unit comes back before a gather of the whole model and
``engine.offload_states()``, and is where a checkpoint's save or load finds it (the same tensors, wherever they
are). The strategy calls it (``recall_shards``).

On a CPU the host buffer is a second buffer in the same memory: the shard's training-time storage is freed at
each offload (what the pass does), but the process's total memory does not drop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from dsrun.offload.state_moves import OffloadStateTypeEnum, StateTensor, move_storage


@dataclass
class ShardMoveStats:
    """Counts since the last :meth:`ShardMoves.reset_stats`."""

    offloads: int = 0  # units moved to their host buffer
    reloads: int = 0  # units moved back by a reload op
    late_reloads: int = 0  # units a gather found on the host and moved back itself
    recalls: int = 0  # units moved back for the step, a checkpoint, an eager gather
    peak_resident_bytes: int = 0  # the most shard bytes on the training device at once


class ShardMoves:
    """The units whose shards DeepCompile's graphs move, by ``ds_id``."""

    def __init__(self, units: list[StateTensor], ds_ids: list[list[int]], pin_memory: bool = True,
                 masters: list[bool] | None = None) -> None:
        self.units = units
        self.masters = masters or [False] * len(units)  # units the optimizer steps in place (on the device)
        self.homes = [unit.tensor.device for unit in units]
        self.unit_by_id = {ds_id: index for index, ids in enumerate(ds_ids) for ds_id in ids}
        self.out = [False] * len(units)
        self.unit_bytes = [unit.tensor.numel() * unit.tensor.element_size() for unit in units]
        self._resident = sum(self.unit_bytes)
        self.pin_memory = pin_memory and torch.cuda.is_available()  # page-locking needs a device driver
        self._host: dict[int, torch.Tensor] = {}  # unit -> its host buffer, made at its first offload
        self.stats = ShardMoveStats(peak_resident_bytes=self._resident)

    @classmethod
    def for_params(cls, params: Iterable[torch.nn.Parameter], pin_memory: bool = True) -> "ShardMoves":
        """Each parameter's ``ds_tensor`` a unit of its own (shards that alias no master)."""
        params = list(params)
        return cls([StateTensor(p.ds_tensor) for p in params], [[p.ds_id] for p in params], pin_memory)

    @classmethod
    def for_strategy(cls, strategy: object, pin_memory: bool = True) -> "ShardMoves":
        """The stage-3 strategy's shards as it names them for ``offload_states`` (``lp_params``: a master with its
        views where the shards alias it, else each shard), those on the training device (a CPU's: all of them;
        CUDA's: not the host masters an ``offload_optimizer`` store keeps, whose shards are their views)."""
        device = strategy.ctx.device
        units = [unit for unit in strategy.state_tensors(OffloadStateTypeEnum.lp_params)
                 if unit.tensor.device.type == device.type and unit.tensor.numel() > 0]
        unit_of_tensor = {id(t): index for index, unit in enumerate(units) for t in [unit.tensor, *unit.views]}
        ds_ids: list[list[int]] = [[] for _ in units]
        for p in strategy.params:
            index = unit_of_tensor.get(id(p.ds_tensor))
            if index is not None:
                ds_ids[index].append(p.ds_id)
        kept = [i for i, ids in enumerate(ds_ids) if ids]
        masters = {id(sg.master) for sg in strategy.sub_groups}
        return cls([units[i] for i in kept], [ds_ids[i] for i in kept], pin_memory,
                   [id(units[i].tensor) in masters for i in kept])

    # --- the moves --------------------------------------------------------------------------------------------
    def unit_of(self, ds_id: int) -> int | None:
        return self.unit_by_id.get(ds_id)

    def offload(self, ds_id: int) -> None:
        """``ds_id``'s unit into its host buffer; the training device's storage goes."""
        index = self.unit_by_id.get(ds_id)
        if index is None or self.out[index]:
            return
        unit = self.units[index]
        host = self._host.get(index)
        if host is None:
            host = torch.empty(unit.tensor.shape, dtype=unit.tensor.dtype, device="cpu", pin_memory=self.pin_memory)
            self._host[index] = host
        move_storage(unit, host)
        self.out[index] = True
        self._resident -= self.unit_bytes[index]
        self.stats.offloads += 1

    def _bring_back(self, index: int) -> bool:
        if not self.out[index]:
            return False
        move_storage(self.units[index], torch.empty_like(self._host[index], device=self.homes[index]))
        self.out[index] = False
        self._resident += self.unit_bytes[index]
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self._resident)
        return True

    def reload(self, ds_id: int) -> None:
        """``ds_id``'s unit back on the training device (nothing when it is there)."""
        index = self.unit_by_id.get(ds_id)
        if index is not None and self._bring_back(index):
            self.stats.reloads += 1

    def ensure_resident(self, ds_id: int) -> None:
        """Before a gather reads ``ds_id``'s shard: a unit still on the host comes back (counted late)."""
        index = self.unit_by_id.get(ds_id)
        if index is not None and self._bring_back(index):
            self.stats.late_reloads += 1

    def recall(self, masters_only: bool = False) -> None:
        """Every unit back on the training device (before anything outside the graphs reads or writes them); with
        ``masters_only`` those the optimizer steps (the step writes the other shards where they are)."""
        for index in range(len(self.units)):
            if (self.masters[index] or not masters_only) and self._bring_back(index):
                self.stats.recalls += 1

    def close(self) -> None:
        """Every unit back; the host buffers go."""
        self.recall()
        self._host.clear()

    # --- what tests and benchmarks read -------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of the units on the training device now."""
        return self._resident

    def total_bytes(self) -> int:
        return sum(self.unit_bytes)

    def host_bytes(self) -> int:
        """Bytes of the host buffers made so far (kept between steps)."""
        return sum(host.numel() * host.element_size() for host in self._host.values())

    def reset_stats(self) -> None:
        self.stats = ShardMoveStats(peak_resident_bytes=self._resident)
