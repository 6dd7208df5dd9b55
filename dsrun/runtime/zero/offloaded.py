"""ZeRO strategies with the optimizer offloaded (``zero_optimization.offload_optimizer``).

The stores they place state in (host buffers, swap files, the overlap pipeline) are :mod:`dsrun.runtime.offload`,
a layer below the ZeRO strategies; the strategies here are the stages with that placement.

Each class is its stage's strategy with the master weights, optimizer states and fp32 gradients moved off the
training device; forward, backward and the collectives are the stage's own. The update runs on the compiled
CPU optimizer (DeepSpeedCPUAdam/Adagrad/Lion) tile by tile; with a 16-bit model the same pass writes the
rounded parameters (``update_tile(low_precision=...)``), which then go to the device.

* stages 1-2, ``device: cpu``: each group's fp32 partition and its states are host tensors; the gradient
  partition reaches the host (stage 1: tile by tile during the step, overlapping the update; stage 2: as each
  bucket is reduced during backward, as DeepSpeed does). The updated 16-bit partition is all-gathered.
* stage 3, ``device: cpu``: each sub-group's master, states and gradient accumulator are host tensors.
* stage 3, ``device: nvme``: each sub-group's master, states and gradient live in swap files
  (:mod:`.nvme`); only ``buffer_count`` buffers are resident.
* stage 3, ``ratio`` < 1: the first ``ratio`` of the trainable elements (whole sub-groups, in order) are
  offloaded; the other sub-groups keep master, states and gradient on the device and step there.

Checkpoints keep the stages' own layout (DeepSpeed's), so offloaded and in-memory runs load each other's.
"""
from __future__ import annotations

from typing import Any

import torch

from dsrun import comm

from dsrun.runtime.offload import param_swapper
from dsrun.runtime.offload.nvme import SwappedOptimizerState, SwappedShard, SwappedUnit
from dsrun.runtime.offload.pipeline import PipelineTimes, StepPipeline, scatter_to_shards
from dsrun.runtime.offload.settings import CPU_TILE_ELEMENTS, OffloadOptimizerSettings, host_empty, require_cpu_optimizer

from .base import MemoryBreakdown, StrategyContext, optimizer_state_bytes, tensor_bytes
from .partition_params import shard_padding
from .partitioned import Stage1Strategy, Stage2Strategy
from .stage3 import Stage3Strategy, SubGroup

HOST = torch.device("cpu")


def _tiles(numel: int, tile: int) -> list[tuple[int, int]]:
    return [(a, min(numel, a + tile)) for a in range(0, numel, tile)] if numel else []


# --------------------------------------------------------------------------------------------------------
# stages 1 and 2
# --------------------------------------------------------------------------------------------------------
class _OffloadedPartitions:
    """What stages 1 and 2 share with the optimizer offloaded to the host (mixed in before the stage class)."""

    def __init__(self, ctx: StrategyContext):
        settings = OffloadOptimizerSettings.from_context(ctx)
        assert settings is not None
        self.offload = settings
        super().__init__(ctx)  # type: ignore[call-arg]
        self.cpu_optimizer = require_cpu_optimizer(self._optimizer, settings)
        self.tile = max(1, min(settings.sub_group_size, CPU_TILE_ELEMENTS))
        self.pipeline = StepPipeline()
        self.direct_low_precision = ctx.device.type == "cpu"  # the kernel writes the model's partition itself
        self._lp_staging: list[torch.Tensor] = []
        if self.model_dtype != torch.float32 and not self.direct_low_precision:
            self._lp_staging = [host_empty(g.partition_numel, self.model_dtype, settings.pinned) for g in self.groups]

    def _build_masters(self) -> list[torch.nn.Parameter]:
        masters = []
        for group in self.groups:  # (MoE experts: partitioned over their expert-data group, at its rank)
            lo, hi = group.partition_range(group.rank)
            master = host_empty(hi - lo, torch.float32, self.offload.pinned)
            master.copy_(group.flat_param[lo:hi])
            masters.append(torch.nn.Parameter(master))
        return masters

    def _device_partition(self, gi: int) -> torch.Tensor:
        group = self.groups[gi]
        lo, hi = group.partition_range(group.rank)
        return group.flat_param[lo:hi]

    def _host_grad_tile(self, gi: int, a: int, b: int, coef: float) -> torch.Tensor:
        """The host fp32 gradient of elements [a, b) of group gi's partition, scaled by ``coef``."""
        raise NotImplementedError

    def _update_masters(self, grads: list[torch.Tensor], coef: float) -> None:
        if self.cpu_optimizer is None:  # zero_force_ds_cpu_optimizer: false: another optimizer, on the host
            for gi, master in enumerate(self.masters):
                master.grad = self._host_grad_tile(gi, 0, master.numel(), coef)
            self._optimizer.step()
            for gi, master in enumerate(self.masters):
                self._device_partition(gi).copy_(master.detach())
            return
        steps, units = [], []
        for gi, master in enumerate(self.masters):
            state = self.cpu_optimizer.state_for(master)
            state["step"] += 1
            steps.append(state)
            units += [(gi, a, b) for a, b in _tiles(master.numel(), self.tile)]
        host_grads: dict[int, torch.Tensor] = {}

        def fetch(u: int) -> None:
            gi, a, b = units[u]
            host_grads[u] = self._host_grad_tile(gi, a, b, coef)

        def compute(u: int) -> None:
            gi, a, b = units[u]
            group, state = self._optimizer.param_groups[gi], steps[gi]
            low = None
            if self.model_dtype != torch.float32:
                low = (self._device_partition(gi) if self.direct_low_precision else self._lp_staging[gi])[a:b]
            self.cpu_optimizer.update_tile(group, self.masters[gi].detach()[a:b], host_grads.pop(u),
                                           {k: state[k][a:b] for k in self.cpu_optimizer.STATE_KEYS}, state["step"],
                                           low_precision=low)

        def store(u: int) -> None:
            gi, a, b = units[u]
            if self.model_dtype == torch.float32:
                self._device_partition(gi)[a:b].copy_(self.masters[gi].detach()[a:b], non_blocking=True)
            elif not self.direct_low_precision:
                self._device_partition(gi)[a:b].copy_(self._lp_staging[gi][a:b], non_blocking=True)

        self.pipeline.run(len(units), fetch, compute, store)
        if self.ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _partition_for_publish(self, group: Any, master: torch.Tensor) -> torch.Tensor:
        # the step already wrote this rank's 16-bit (or fp32) partition into the model's flat buffer; the
        # all-gather needs it as a separate input (one rank: nothing to gather, the buffer is already right)
        lo, hi = group.partition_range(group.rank)
        return group.flat_param[lo:hi] if group.world_size == 1 else group.flat_param[lo:hi].clone()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)  # type: ignore[misc]
        # the stage's _publish gathers the device partitions: bring them up to the loaded masters first
        with torch.no_grad():
            for gi, master in enumerate(self.masters):
                self._device_partition(gi).copy_(master.detach())
        self._publish()  # type: ignore[attr-defined]

    @property
    def last_step_times(self) -> PipelineTimes:
        return self.pipeline.times

    def close(self) -> None:
        super().close()  # type: ignore[misc]
        self.pipeline.close()


class OffloadStage1Strategy(_OffloadedPartitions, Stage1Strategy):
    """ZeRO-1 with master partitions, optimizer states and the fp32 gradient partition on the host. The
    gradient partition (model dtype, on the device) is copied to the host tile by tile during the step, each
    copy overlapping the previous tile's update."""

    supports_local_gradients = False  # the step reads the reduced partition only

    def _build_buffers(self) -> None:
        super()._build_buffers()
        # fp32 host copy of the reduced gradient partition (distinct from the device's model-dtype partition)
        self.master_grads = [host_empty(g.partition_numel, torch.float32, self.offload.pinned) for g in self.groups]

    def _master_grads(self) -> list[torch.Tensor]:
        return self.partition_grads  # checked for overflow and measured on the device; copied tile by tile

    def _host_grad_tile(self, gi: int, a: int, b: int, coef: float) -> torch.Tensor:
        tile = self.master_grads[gi][a:b]
        tile.copy_(self.partition_grads[gi][a:b])
        if coef != 1.0:
            tile.mul_(coef)
        return tile

    def _local_sq_norm(self) -> torch.Tensor:
        if all(g.dtype == torch.float32 for g in self._step_grads):
            return super()._local_sq_norm()
        sq = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        for g in self._step_grads:  # 16-bit partitions: square in fp32, a chunk at a time
            for chunk in g.split(CPU_TILE_ELEMENTS):
                c = chunk.float()
                sq += torch.dot(c, c).double()
        return sq


class OffloadStage2Strategy(_OffloadedPartitions, Stage2Strategy):
    """ZeRO-2 with master partitions, optimizer states and the fp32 gradient accumulators on the host: each
    reduced bucket is added into the host accumulator during backward."""

    def _build_buffers(self) -> None:
        super()._build_buffers()
        self.master_grads = [torch.zeros(g.partition_numel, dtype=torch.float32, pin_memory=self.offload.pinned)
                             for g in self.groups]

    def _host_grad_tile(self, gi: int, a: int, b: int, coef: float) -> torch.Tensor:
        tile = self.master_grads[gi][a:b]
        if coef != 1.0:
            tile.mul_(coef)
        return tile


# --------------------------------------------------------------------------------------------------------
# stage 3
# --------------------------------------------------------------------------------------------------------
class OffloadStage3Strategy(Stage3Strategy):
    """ZeRO-3 with the optimizer's sub-groups on the host (``device: cpu``) or in swap files (``nvme``)."""

    def __init__(self, ctx: StrategyContext):
        settings = OffloadOptimizerSettings.from_context(ctx)
        assert settings is not None
        self.offload = settings
        self.cpu_optimizer = require_cpu_optimizer(ctx.optimizer, settings)
        if self.cpu_optimizer is None and settings.ratio < 1.0:
            from dsrun.utils.errors import ConfigError, Problem

            raise ConfigError(Problem("zero_optimization.offload_optimizer.ratio", "partial offload steps tiles with "
                                      "a DeepSpeed CPU optimizer", "use optimizer type Adam, AdamW, Adagrad or Lion"))
        self.swapped: SwappedOptimizerState | None = None
        if settings.device == "nvme":
            measure = ctx.precision.checks_overflow or ctx.gradient_clipping > 0
            self.swapped = SwappedOptimizerState(settings, ctx.optimizer, ctx.rank, ctx.precision.model_dtype,
                                                 measure_gradients=measure)
        self._offload_budget: float | None = None
        self._placed_numel = 0
        self.pipeline = StepPipeline()
        self._lp_staging: list[torch.Tensor] = []
        super().__init__(ctx)
        self._sg_index = {id(sg): i for i, sg in enumerate(self.sub_groups)}
        if self.swapped is not None:
            self.swapped.finish_setup()
        tile = max(1, min(self.sub_group_size, CPU_TILE_ELEMENTS))
        self.tile = tile
        if self.model_dtype != torch.float32 and any(sg.placement == "cpu" for sg in self.sub_groups):
            largest = max(sg.numel for sg in self.sub_groups if sg.placement == "cpu")
            self._lp_staging = [host_empty(min(tile, largest), self.model_dtype, settings.pinned) for _ in range(2)]

    # --- where each sub-group lives -----------------------------------------------------------------------
    def _trainable_numel(self) -> int:
        seen, total = set(), 0
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    total += p.ds_partition_numel
        return total

    def _init_sub_group(self, index: int, sg: SubGroup) -> None:
        if self._offload_budget is None:
            self._offload_budget = self.offload.ratio * self._trainable_numel()
        offloaded = self._placed_numel < self._offload_budget
        self._placed_numel += sg.numel
        if not offloaded:
            sg.placement = "device"
            super()._init_sub_group(index, sg)
            return
        sg.placement = self.offload.device
        shards = [param_swapper.shard_value(p).detach().to(device=HOST, dtype=torch.float32) for p in sg.params]
        flat = torch.cat(shards) if shards else torch.zeros(0)
        del shards
        if sg.placement == "nvme":
            assert self.swapped is not None
            self.swapped.add_unit(SwappedUnit(index, sg.numel, len(sg.params), sg.group_index), flat)
            del flat
            for p, off in zip(sg.params, sg.offsets):  # GatheredParameters writes through to the file
                p.ds_fp32_shard = SwappedShard(self.swapped, index, off, p.ds_partition_numel)
            # the optimizer's param is a placeholder with the right size and no storage
            sg.master = torch.nn.Parameter(torch.empty(sg.numel, dtype=torch.float32, device="meta"))
            sg.grad = None
            return
        master = host_empty(sg.numel, torch.float32, self.offload.pinned)
        master.copy_(flat)
        del flat
        sg.master = torch.nn.Parameter(master)
        sg.grad = torch.zeros(sg.numel, dtype=torch.float32, pin_memory=self.offload.pinned)
        for p, off in zip(sg.params, sg.offsets):
            p.ds_fp32_shard = sg.master.data[off:off + p.ds_partition_numel]
        if self._aliased():
            # fp32 on a CPU device: the model's shards are views of the host master (updated in place),
            # except NVMe-offloaded parameter shards (offload_param), which are written after the step
            self._alias_shards(sg)

    def _aliased(self) -> bool:
        # once some shards cannot alias their master (offload_param nvme), the step writes every shard
        return not self._writes_shards and self.ctx.device.type == "cpu"

    # --- backward -----------------------------------------------------------------------------------------
    def before_backward(self, boundary: bool) -> None:
        super().before_backward(boundary)
        if self.swapped is not None:
            self.swapped.begin_micro_step(boundary)

    def after_backward(self, boundary: bool) -> None:
        super().after_backward(boundary)
        if self.swapped is not None:
            self.swapped.end_micro_step()

    def _accumulate(self, sg: SubGroup, offset: int, values: torch.Tensor) -> None:
        if sg.placement == "nvme":
            self.swapped.accumulate(self._sg_index[id(sg)], offset, values)
        elif sg.placement == "cpu":
            sg.grad[offset:offset + values.numel()].add_(values.to(HOST))
        else:
            super()._accumulate(sg, offset, values)

    # --- the step -----------------------------------------------------------------------------------------
    def _resident(self) -> list[SubGroup]:
        return [sg for sg in self.sub_groups if sg.placement != "nvme"]

    def _local_overflow(self) -> bool:
        local = any(not bool(torch.isfinite(sg.grad).all()) for sg in self._resident())
        return local or (self.swapped is not None and not self.swapped.local_grad_stats()[1])

    def _local_sq_norm(self) -> torch.Tensor:
        sq = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        for sg in self._resident():
            sq += sg.grad.double().pow(2).sum().to(self.ctx.device)
        if self.swapped is not None:  # measured as each gradient was swapped out
            sq += self.swapped.local_grad_stats()[0]
        return sq

    def _apply_update(self, coef: float) -> None:
        device_groups = [sg for sg in self.sub_groups if sg.placement == "device"]
        if self.cpu_optimizer is None:  # another optimizer on the host tensors (CPU offload only)
            super()._apply_update(coef)
            return
        if self.swapped is not None:
            self.swapped.step(coef, lambda gi: self._optimizer.param_groups[gi], self._publish_swapped)
        self._step_host(coef)
        for sg in device_groups:  # partial offload: the rest steps where it lives
            if coef != 1.0:
                sg.grad.mul_(coef)
            state = self.cpu_optimizer.state_for(sg.master)
            state["step"] += 1
            self.cpu_optimizer.update_tile(self._optimizer.param_groups[sg.group_index], sg.master.detach(), sg.grad,
                                           {k: state[k] for k in self.cpu_optimizer.STATE_KEYS}, state["step"])
            if self._writes_shards:
                scatter_to_shards(sg.params, sg.offsets, 0, sg.master.detach())
        if self.ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        if self.param_offload is not None:
            self.param_offload.flush()  # offload_param: the updated shards are in their files
        self.coordinator.invalidate()

    def _publish_swapped(self, index: int, values: torch.Tensor) -> None:
        sg = self.sub_groups[index]
        scatter_to_shards(sg.params, sg.offsets, 0, values)

    def _step_host(self, coef: float) -> None:
        host = [sg for sg in self.sub_groups if sg.placement == "cpu"]
        units, states = [], {}
        for sg in host:
            state = self.cpu_optimizer.state_for(sg.master)
            state["step"] += 1
            states[id(sg)] = state
            units += [(sg, a, b) for a, b in _tiles(sg.numel, self.tile)]

        def fetch(u: int) -> None:
            sg, a, b = units[u]
            if coef != 1.0:
                sg.grad[a:b].mul_(coef)

        def compute(u: int) -> None:
            sg, a, b = units[u]
            state = states[id(sg)]
            low = self._lp_staging[u % 2][:b - a] if self._lp_staging else None
            self.cpu_optimizer.update_tile(self._optimizer.param_groups[sg.group_index], sg.master.detach()[a:b],
                                           sg.grad[a:b], {k: state[k][a:b] for k in self.cpu_optimizer.STATE_KEYS},
                                           state["step"], low_precision=low)

        def store(u: int) -> None:
            sg, a, b = units[u]
            if self._lp_staging:
                scatter_to_shards(sg.params, sg.offsets, a, self._lp_staging[u % 2][:b - a])
            elif not self._aliased():
                scatter_to_shards(sg.params, sg.offsets, a, sg.master.detach()[a:b])

        self.pipeline.run(len(units), fetch, compute, store)

    def _publish(self) -> None:
        """Write every master into the model's shards (after a load)."""
        with torch.no_grad():
            for i, sg in enumerate(self.sub_groups):
                if sg.placement == "nvme":
                    self.swapped.read_master(i, lambda values, sg=sg: scatter_to_shards(sg.params, sg.offsets, 0, values))
                elif sg.placement == "device" and not self._writes_shards:
                    continue  # views of the master
                elif sg.placement == "cpu" and self._aliased():
                    continue
                else:
                    scatter_to_shards(sg.params, sg.offsets, 0, sg.master.detach())
        if self.param_offload is not None:
            self.param_offload.flush()
        self.coordinator.invalidate()

    def zero_grad(self) -> None:
        for sg in self._resident():
            sg.grad.zero_()
        if self.swapped is not None:
            self.swapped.zero_grad()
        for p in self.params:
            p.grad = None

    @property
    def last_step_times(self) -> PipelineTimes:
        return self.swapped.last_times if self.swapped is not None else self.pipeline.times

    # --- checkpoints --------------------------------------------------------------------------------------
    def _optimizer_state_dict(self) -> dict[str, Any]:
        osd = super()._optimizer_state_dict()
        if self.swapped is not None:  # the swapped sub-groups' states, mapped from their files
            for i, sg in enumerate(self.sub_groups):
                entry = self.swapped.state_entry(i) if sg.placement == "nvme" else None
                if entry is not None:
                    osd["state"][i] = entry
            osd["state"] = dict(sorted(osd["state"].items()))
        return osd

    def _master_for_checkpoint(self, index: int, sg: SubGroup) -> torch.Tensor:
        if sg.placement == "nvme":
            return self.swapped.master_tensor(index)  # mapped from its file, not copied into memory
        return super()._master_for_checkpoint(index, sg)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.swapped is None:
            super().load_state_dict(sd)
            return
        if sd.get("partition_count") != self.world_size:
            raise RuntimeError("ZeRO-3 state was saved with a different data-parallel world size "
                               f"({sd.get('partition_count')}) than this run ({self.world_size})")
        osd = sd["optimizer_state_dict"]
        state = {int(k): v for k, v in osd["state"].items()}
        with torch.no_grad():
            for i, (sg, saved) in enumerate(zip(self.sub_groups, sd["fp32_flat_groups"])):
                if sg.placement == "nvme":
                    self.swapped.load(i, saved, state.pop(i, None))
                else:
                    sg.master.data.copy_(saved)
        self._optimizer.load_state_dict({"state": state, "param_groups": osd["param_groups"]})
        self.precision.load_state_dict(sd)
        self._publish()

    # --- accounting ---------------------------------------------------------------------------------------
    def memory_breakdown(self) -> MemoryBreakdown:
        """Resident bytes only: swapped masters, states and gradients are not counted; the swap buffers are
        (``buffers``). Host-resident (CPU-offloaded) state is counted as it lives in this process's memory."""
        shards = sum(tensor_bytes(p.ds_tensor) for p in self.params) + self.sharding.secondary_bytes(self.params)
        persistent = sum(p.ds_numel * p.ds_tensor.element_size() for p in self.params if p.ds_persist)
        resident = self._resident()
        grads = sum(tensor_bytes(sg.grad) for sg in resident)
        masters = sum(tensor_bytes(sg.master) for sg in resident
                      if self._writes_shards or (sg.placement == "cpu" and not self._aliased()))
        states = optimizer_state_bytes(self._optimizer)
        buffers = (sum(tensor_bytes(t) for t in self._lp_staging) + self.bucket_pool_bytes()
                   + self.coordinator.buffer_pool.nbytes)
        if self.swapped is not None:
            buffers += self.swapped.resident_bytes
        if self.param_offload is not None:
            buffers += self.param_offload.buffer_bytes()  # offload_param nvme: read/write pool and cache
        padding = sum(shard_padding(p, comm.get_rank(p.ds_process_group)) * p.ds_tensor.element_size()
                      for p in self.params)  # each shard at its rank in the group it is cut over (MoE experts)
        return MemoryBreakdown(parameters=shards + persistent, gradients=grads, master_weights=masters,
                               optimizer_states=states, padding=int(padding), buffers=buffers)

    def close(self) -> None:
        super().close()
        self.pipeline.close()
        if self.swapped is not None:
            self.swapped.close()

