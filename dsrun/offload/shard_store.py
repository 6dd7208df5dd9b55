"""Where a ZeRO-3 sub-group's optimizer state lives: the training device, host memory or NVMe swap files.

A sub-group (consecutive shards of one optimizer param group, stepped as one fp32 tensor) is placed in one
store, which owns its fp32 master, its gradient accumulator, its share of the overflow check and of the
squared norm, its update, the write-back into the model's shards, its checkpoint entries and its bytes.
The stage-3 strategy asks its stores (:func:`shard_stores`, chosen from ``offload_optimizer``) and never
branches on where a sub-group lives.

* :class:`DeviceShardStore`: on the device; the update is the optimizer's own step (or, beside offloaded
  sub-groups with ``ratio`` < 1, the CPU optimizer's update of each sub-group where it lives).
* :class:`HostShardStore` (``device: cpu``): master, states and gradient accumulator in host memory; the
  compiled CPU optimizer steps tile by tile (:class:`~.pipeline.StepPipeline`), writing the 16-bit shards in
  the same pass.
* :class:`NvmeShardStore` (``device: nvme``): master, states and gradient in swap files (:mod:`.nvme`); only
  ``buffer_count`` buffers are resident.

The stores never see the strategy: it hands them a :class:`ShardContext` (the training device, the model's
dtype, the precision facts they act on) and the :class:`SubGroup` s it places.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from dsrun.offload import param_swapper
from dsrun.offload.chunked_step import chunked_step
from dsrun.offload.nvme import NORM_CHUNK, SwappedOptimizerState, SwappedShard, SwappedUnit
from dsrun.offload.pipeline import PipelineTimes, StepPipeline, scatter_to_shards, tiled_cpu_step
from dsrun.offload.settings import (CPU_TILE_ELEMENTS, HostBuffers, OffloadOptimizerSettings, require_cpu_optimizer,
                                    require_master_optimizer)
from dsrun.offload.state_moves import OffloadStateTypeEnum, StateTensor
from dsrun.precision.keep_fp32 import is_kept

if TYPE_CHECKING:
    from dsrun.offload.swap_store import SwapStore
    from dsrun.ops.cpu_optimizer import CPUOptimizer

HOST = torch.device("cpu")


@dataclass
class SubGroup:
    """Consecutive shards of one optimizer param group, stepped as one fp32 tensor."""

    group_index: int
    params: list[torch.nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    master: torch.nn.Parameter | None = None
    grad: torch.Tensor | None = None
    index: int = -1  # among the strategy's sub-groups
    store: DeviceShardStore | None = None  # where master, gradient and optimizer state live

    @property
    def placement(self) -> str:
        """``device``, ``cpu`` or ``nvme``."""
        return self.store.kind

    @property
    def kept_fp32(self) -> bool:
        """Its parameters are fp32-kept ones (``data_types.keep_in_fp32_modules``): never mixed with others."""
        return bool(self.params) and is_kept(self.params[0])

    def takes(self, param: torch.nn.Parameter, size: int) -> bool:
        """Whether ``param`` joins this sub-group of at most ``size`` elements (an empty one takes any)."""
        fits = not self.numel or self.numel + param.ds_partition_numel <= size
        return fits and (not self.params or is_kept(param) == self.kept_fp32)

    def add(self, param: torch.nn.Parameter) -> None:
        self.params.append(param)
        self.offsets.append(self.numel)
        self.numel += param.ds_partition_numel


@dataclass
class ShardContext:
    """What the shard stores know of the stage-3 strategy that places sub-groups in them."""

    device: torch.device  # the training device
    model_dtype: torch.dtype  # the dtype of the model's shards
    needs_master_weights: bool  # a 16-bit model with fp32 masters: they are copies, not the shards themselves
    measure_gradients: bool  # overflow checked or clipping on: NVMe measures each gradient as it is swapped out
    rank: int
    separate_shards: bool = False  # fp32 with an offloaded shard that could not alias its master
    # the masters' and gradient accumulators' dtype: fp32, or bf16 with bf16.bf16_master_weights_and_grads (on the
    # device: a bf16 model's shards are then the masters themselves), or fp16 with fp16.fp16_master_weights_and_grads
    # (in host memory: on a CPU device the fp16 shards are then views of them)
    master_dtype: torch.dtype = torch.float32
    # the gradient accumulators' dtype on the device when data_types.grad_accum_dtype names another than the
    # masters' (None: the masters'); the step then reads a copy in the masters' dtype
    grad_dtype: torch.dtype | None = None

    @property
    def writes_shards(self) -> bool:
        """Are the model's shards separate from the fp32 masters, so the step must write them? (16-bit
        models; fp32 once an offloaded shard could not alias its master.)"""
        return self.needs_master_weights or self.separate_shards

    def alias_shards(self, sg: SubGroup) -> None:
        """Masters in the model's dtype (fp32, or bf16 master state): make the model's shards views of the
        master, so the step updates them in place; an offloaded shard that lives elsewhere (NVMe, or host memory
        beside a device master) is written after the step instead."""
        for p, off in zip(sg.params, sg.offsets):
            owner = param_swapper.offload_of(p)
            if owner is not None and not owner.can_alias(p, sg.master):
                self.separate_shards = True
                continue
            p.ds_tensor = sg.master.data[off:off + p.ds_partition_numel]


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _flat_shards(sg: SubGroup, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of ``sg``'s shards laid end to end, in ``dtype`` on ``device``."""
    shards = [param_swapper.shard_value(p).detach().to(device=device, dtype=dtype) for p in sg.params]
    return torch.cat(shards) if shards else torch.zeros(0, device=device, dtype=dtype)


class DeviceShardStore:
    """Sub-groups with master, gradient and states on the training device."""

    kind = "device"
    swap_files: SwapStore | None = None  # an NVMe store's files (where Muon's binding swaps its momentum)
    steps_during_backward = False  # super_offload: sub-groups updated before the step hooks run

    def __init__(self, shard_ctx: ShardContext, optimizer: torch.optim.Optimizer,
                 cpu_optimizer: CPUOptimizer | None = None):
        self.shard_ctx, self.optimizer, self.cpu_optimizer = shard_ctx, optimizer, cpu_optimizer
        self.sub_groups: list[tuple[int, SubGroup]] = []  # (index among the strategy's sub-groups, sub-group)
        self.times = PipelineTimes()  # the last update's pipeline (offloaded stores)
        self._norm_buffer: torch.Tensor | None = None  # on the CPU: the float64 squares of one norm chunk

    # --- placement ------------------------------------------------------------------------------------------
    def place(self, index: int, sg: SubGroup) -> None:
        """Give sub-group ``index`` its master and gradient accumulator here (``master_dtype``)."""
        self.sub_groups.append((index, sg))
        master = _flat_shards(sg, self.shard_ctx.device, self.shard_ctx.master_dtype)  # cat made a new tensor
        sg.master = torch.nn.Parameter(master)
        sg.grad = torch.zeros_like(sg.master.data, dtype=self.shard_ctx.grad_dtype or master.dtype)
        for p, off in zip(sg.params, sg.offsets):
            p.ds_fp32_shard = sg.master.data[off:off + p.ds_partition_numel]  # GatheredParameters writes here
        if not self.shard_ctx.needs_master_weights:
            self.shard_ctx.alias_shards(sg)

    def finish(self) -> None:
        """Every sub-group is placed."""

    # --- backward -----------------------------------------------------------------------------------------
    def begin_micro_step(self, boundary: bool) -> None:
        pass

    def end_micro_step(self) -> None:
        pass

    def accumulate(self, index: int, sg: SubGroup, offset: int, values: torch.Tensor) -> None:
        """Add one parameter's reduced shard gradient into sub-group ``index``'s fp32 accumulator."""
        sg.grad[offset:offset + values.numel()].add_(values.to(sg.grad.device))

    def zero_grad(self) -> None:
        for _, sg in self.sub_groups:
            sg.grad.zero_()

    # --- the step -----------------------------------------------------------------------------------------
    def overflow(self) -> bool:
        return any(not bool(torch.isfinite(sg.grad).all()) for _, sg in self.sub_groups)

    def add_sq_norm(self, sq: torch.Tensor) -> None:
        """Add the sum of squares of these gradients into ``sq`` (float64; shard padding holds zeros), a chunk at
        a time as the NVMe store sums its own: a whole sub-group in float64 would be two temporaries of twice
        its bytes, fresh pages on every step (on CPU, past the C allocator's 32 MiB mmap ceiling)."""
        on_cpu = self.shard_ctx.device.type == "cpu"
        for _, sg in self.sub_groups:
            for chunk in sg.grad.split(NORM_CHUNK):
                if on_cpu:  # the float64 squares in one buffer kept across steps: no fresh pages each chunk
                    if self._norm_buffer is None:
                        self._norm_buffer = torch.empty(NORM_CHUNK, dtype=torch.float64)
                    squares = self._norm_buffer[:chunk.numel()]
                    squares.copy_(chunk).square_()
                    sq += squares.sum().to(sq.device)
                else:
                    sq += chunk.double().pow(2).sum().to(sq.device)

    def gradients(self) -> list[torch.Tensor]:
        """The resident fp32 gradients the update reads (for step hooks)."""
        return [sg.grad for _, sg in self.sub_groups]

    @contextmanager
    def gradient_in_memory(self, index: int, sg: SubGroup) -> Iterator[torch.Tensor]:
        """Sub-group ``index``'s gradient as the update will read it, for a step hook that rewrites it (Muon's
        binding): here the resident accumulator itself; an NVMe store reads its file and writes it back."""
        yield sg.grad

    def update(self, coef: float) -> None:
        """Scale the gradients by ``coef``, step, and write the new values into the model's shards."""
        if not self.sub_groups:
            return
        if self.cpu_optimizer is None:  # the optimizer steps every master it holds (none lives elsewhere)
            self._optimizer_step(coef)
            return
        for _, sg in self.sub_groups:  # partial offload: each sub-group steps where it lives
            if coef != 1.0:
                sg.grad.mul_(coef)
            state = self.cpu_optimizer.state_for(sg.master)
            state["step"] += 1
            self.cpu_optimizer.update_tile(self.optimizer.param_groups[sg.group_index], sg.master.detach(), sg.grad,
                                           {k: state[k] for k in self.cpu_optimizer.STATE_KEYS}, state["step"])
            if self.shard_ctx.writes_shards:
                scatter_to_shards(sg.params, sg.offsets, 0, sg.master.detach())
        if self.shard_ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _optimizer_step(self, coef: float) -> None:
        """The optimizer's own step over these sub-groups (scaled by ``coef``), then the write-back."""
        copies = False
        for _, sg in self.sub_groups:
            grad = sg.grad
            if grad.dtype != sg.master.dtype:  # grad_accum_dtype's accumulator: the step reads a copy
                grad, copies = grad.to(sg.master.dtype), True
            if coef != 1.0:
                grad.mul_(coef)
            sg.master.grad = grad
        if self.shard_ctx.device.type == "cpu":  # small temporaries the heap reuses, not fresh pages
            chunked_step(self.optimizer)
        else:
            self.optimizer.step()
        if copies:
            for _, sg in self.sub_groups:
                sg.master.grad = None
        self.publish()

    def publish(self) -> None:
        """Write the fp32 masters into the model's shards (after a step or a load); unless they are views."""
        if not self.shard_ctx.writes_shards:
            return
        with torch.no_grad():
            for _, sg in self.sub_groups:
                for p, off in zip(sg.params, sg.offsets):
                    value = sg.master.data[off:off + p.ds_partition_numel]
                    offload = param_swapper.offload_of(p)
                    if offload is not None:
                        offload.write_shard(p, value)  # write-behind: overlaps the next sub-group's copy
                    elif value.data_ptr() != p.ds_tensor.data_ptr():
                        p.ds_tensor.copy_(value)

    def set_step(self, step: int) -> None:
        """Set the step counters this store keeps outside the optimizer's state (``update_optimizer_step``)."""

    # --- checkpoints --------------------------------------------------------------------------------------
    def master_for_checkpoint(self, index: int, sg: SubGroup) -> torch.Tensor:
        return sg.master.detach().clone()

    def state_entry(self, index: int) -> dict[str, Any] | None:
        """Sub-group ``index``'s optimizer state when it is not the optimizer's own (swapped)."""
        return None

    def load(self, index: int, sg: SubGroup, master: torch.Tensor, state: dict[str, Any] | None) -> bool:
        """Restore sub-group ``index``'s master (and, returning True, its optimizer state)."""
        sg.master.data.copy_(master)
        return False

    # --- fragments (dsrun.utils.safe_get_full_fp32_param & co.) ------------------------------------------
    def master_of(self, index: int, sg: SubGroup) -> torch.Tensor:
        return sg.master.detach()

    def grad_of(self, index: int, sg: SubGroup) -> torch.Tensor | None:
        return sg.grad

    def state_of(self, index: int, sg: SubGroup) -> dict[str, Any]:
        return self.optimizer.state.get(sg.master, {})

    def write_state(self, index: int, sg: SubGroup, key: str, offset: int, values: torch.Tensor) -> None:
        """Set elements ``[offset, offset + len)`` of sub-group ``index``'s optimizer state ``key``."""
        self.state_of(index, sg)[key].reshape(-1)[offset:offset + values.numel()].copy_(values)

    def write_grad(self, index: int, sg: SubGroup, offset: int, values: torch.Tensor) -> None:
        """Set elements ``[offset, offset + len)`` of sub-group ``index``'s gradient accumulator (as stored)."""
        if sg.grad is None:
            raise ValueError("no gradient to set yet: call safe_set_*_grad after backward and before step()")
        sg.grad[offset:offset + values.numel()].copy_(values.to(sg.grad.device, sg.grad.dtype))

    # --- engine.offload_states (dsrun/zero/offload_states.py) ----------------------------------------------
    def state_tensors(self, state: OffloadStateTypeEnum) -> list[StateTensor]:
        """The tensors of these sub-groups that ``state`` names: ``hp_params`` each master (with the shard views
        of it: ``ds_fp32_shard``, and ``ds_tensor`` where the shards alias it), ``optim_states`` its optimizer
        state, ``lp_grads`` its gradient accumulator. Host memory's stay there when offloaded."""
        if state is OffloadStateTypeEnum.hp_params:
            return [StateTensor(sg.master, [t for p in sg.params for t in (p.ds_fp32_shard, p.ds_tensor)])
                    for _, sg in self.sub_groups]
        if state is OffloadStateTypeEnum.optim_states:
            return [StateTensor(v) for i, sg in self.sub_groups for v in self.state_of(i, sg).values()
                    if torch.is_tensor(v)]
        if state is OffloadStateTypeEnum.lp_grads:
            return [StateTensor(sg.grad) for _, sg in self.sub_groups if sg.grad is not None]
        return []

    # --- accounting ---------------------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        return sum(_bytes(sg.grad) for _, sg in self.sub_groups)

    def master_bytes(self) -> int:
        """The fp32 masters counted apart from the model's shards (not when the shards are their views)."""
        return sum(_bytes(sg.master) for _, sg in self.sub_groups) if self.shard_ctx.writes_shards else 0

    def buffer_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class HostShardStore(DeviceShardStore):
    """``offload_optimizer.device: cpu``: master, states and gradient accumulator in host memory."""

    kind = "cpu"

    def __init__(self, shard_ctx: ShardContext, optimizer: torch.optim.Optimizer, cpu_optimizer: CPUOptimizer | None,
                 settings: OffloadOptimizerSettings):
        super().__init__(shard_ctx, optimizer, cpu_optimizer)
        # fp32 masters, or fp16 ones of an fp16 model (fp16.fp16_master_weights_and_grads; moments stay fp32)
        require_master_optimizer(cpu_optimizer, shard_ctx.master_dtype)
        self.settings = settings
        self.host = HostBuffers(settings)
        self.pipeline = StepPipeline()
        self.tile = max(1, min(settings.sub_group_size, CPU_TILE_ELEMENTS))
        self._lp_staging: list[torch.Tensor] = []

    def aliased(self) -> bool:
        """fp32 on a CPU device: the model's shards are views of the host master (updated in place), except
        NVMe-offloaded parameter shards (offload_param): once some cannot alias, the step writes every shard."""
        return not self.shard_ctx.writes_shards and self.shard_ctx.device.type == "cpu"

    def place(self, index: int, sg: SubGroup) -> None:
        self.sub_groups.append((index, sg))
        flat = _flat_shards(sg, HOST)
        master = self.host.empty(sg.numel, self.shard_ctx.master_dtype)
        master.copy_(flat)
        del flat
        sg.master = torch.nn.Parameter(master)
        sg.grad = self.host.zeros(sg.numel, self.shard_ctx.master_dtype)
        for p, off in zip(sg.params, sg.offsets):
            p.ds_fp32_shard = sg.master.data[off:off + p.ds_partition_numel]
        if self.aliased():
            self.shard_ctx.alias_shards(sg)

    def finish(self) -> None:
        if self.shard_ctx.model_dtype != self.shard_ctx.master_dtype and self.sub_groups:  # 16-bit model, fp32 masters
            largest = max(sg.numel for _, sg in self.sub_groups)
            self._lp_staging = [self.host.empty(min(self.tile, largest), self.shard_ctx.model_dtype)
                                for _ in range(2)]

    def update(self, coef: float) -> None:
        if self.cpu_optimizer is None:  # another optimizer on the host tensors
            if self.sub_groups:
                self._optimizer_step(coef)
            return
        subs = [sg for _, sg in self.sub_groups]

        def grad(u: int, j: int, a: int, b: int) -> torch.Tensor:
            g = subs[j].grad[a:b]
            if coef != 1.0:
                g.mul_(coef)
            return g

        def store(u: int, j: int, a: int, b: int) -> None:
            sg = subs[j]
            if self._lp_staging and not sg.kept_fp32:
                scatter_to_shards(sg.params, sg.offsets, a, self._lp_staging[u % 2][:b - a])
            elif not self.aliased():
                scatter_to_shards(sg.params, sg.offsets, a, sg.master.detach()[a:b])

        def low(u: int, j: int, a: int, b: int) -> torch.Tensor | None:  # fp32-kept shards take the master itself
            return None if subs[j].kept_fp32 else self._lp_staging[u % 2][:b - a]

        low = low if self._lp_staging else None
        jobs = [(self.optimizer.param_groups[sg.group_index], sg.master) for sg in subs]
        self.times = tiled_cpu_step(self.pipeline, self.cpu_optimizer, jobs, self.tile, grad, low, store)
        if self.shard_ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def publish(self) -> None:
        if self.aliased():
            return
        with torch.no_grad():
            for _, sg in self.sub_groups:
                scatter_to_shards(sg.params, sg.offsets, 0, sg.master.detach())

    def master_bytes(self) -> int:
        return sum(_bytes(sg.master) for _, sg in self.sub_groups) if not self.aliased() else 0

    def buffer_bytes(self) -> int:
        return sum(_bytes(t) for t in self._lp_staging)

    def close(self) -> None:
        self.pipeline.close()
        self.host.release()


class NvmeShardStore(DeviceShardStore):
    """``offload_optimizer.device: nvme``: master, states and gradient of each sub-group in swap files."""

    kind = "nvme"

    def __init__(self, shard_ctx: ShardContext, optimizer: torch.optim.Optimizer, cpu_optimizer: CPUOptimizer | None,
                 settings: OffloadOptimizerSettings):
        super().__init__(shard_ctx, optimizer, cpu_optimizer)
        self.swapped = SwappedOptimizerState(settings, optimizer, shard_ctx.rank, shard_ctx.model_dtype,
                                             measure_gradients=shard_ctx.measure_gradients)

    def place(self, index: int, sg: SubGroup) -> None:
        self.sub_groups.append((index, sg))
        self.swapped.add_unit(SwappedUnit(index, sg.numel, len(sg.params), sg.group_index, kept_fp32=sg.kept_fp32),
                              _flat_shards(sg, HOST))
        for p, off in zip(sg.params, sg.offsets):  # GatheredParameters writes through to the file
            p.ds_fp32_shard = SwappedShard(self.swapped, index, off, p.ds_partition_numel)
        # the optimizer's param is a placeholder with the right size and no storage
        sg.master = torch.nn.Parameter(torch.empty(sg.numel, dtype=torch.float32, device="meta"))
        sg.grad = None

    def finish(self) -> None:
        self.swapped.finish_setup()
        if self.swapped.settings.super_offload:  # each sub-group stepped during backward (offload/backward_step.py)
            by_index = dict(self.sub_groups)
            self.swapped.step_during_backward(
                lambda gi: self.optimizer.param_groups[gi],
                lambda index, values: scatter_to_shards(by_index[index].params, by_index[index].offsets, 0, values,
                                                        borrowed=True))

    def begin_micro_step(self, boundary: bool) -> None:
        self.swapped.begin_micro_step(boundary)

    def end_micro_step(self) -> None:
        self.swapped.end_micro_step()

    def accumulate(self, index: int, sg: SubGroup, offset: int, values: torch.Tensor) -> None:
        self.swapped.accumulate(index, offset, values)

    def zero_grad(self) -> None:
        self.swapped.zero_grad()

    def overflow(self) -> bool:
        return not self.swapped.local_grad_stats()[1]

    def add_sq_norm(self, sq: torch.Tensor) -> None:
        sq += self.swapped.local_grad_stats()[0]  # measured as each gradient was swapped out

    def gradients(self) -> list[torch.Tensor]:
        return []

    def gradient_in_memory(self, index: int, sg: SubGroup) -> Any:
        return self.swapped.gradient_in_memory(index)

    @property
    def swap_files(self) -> SwapStore:  # type: ignore[override]
        return self.swapped.store

    @property
    def steps_during_backward(self) -> bool:  # type: ignore[override]
        return self.swapped.backward_steps is not None

    def update(self, coef: float) -> None:
        by_index = dict(self.sub_groups)

        def write_back(index: int, values: torch.Tensor) -> None:
            sg = by_index[index]
            scatter_to_shards(sg.params, sg.offsets, 0, values)

        self.swapped.step(coef, lambda gi: self.optimizer.param_groups[gi], write_back)
        self.times = self.swapped.last_times

    def publish(self) -> None:
        with torch.no_grad():
            for index, sg in self.sub_groups:
                self.swapped.read_master(index, lambda values, sg=sg: scatter_to_shards(sg.params, sg.offsets, 0,
                                                                                         values))

    def set_step(self, step: int) -> None:
        for index in self.swapped.steps:  # sub-groups that have stepped count their steps here
            if self.swapped.steps[index]:
                self.swapped.steps[index] = step

    def master_for_checkpoint(self, index: int, sg: SubGroup) -> torch.Tensor:
        return self.swapped.master_tensor(index)  # mapped from its file, not copied into memory

    def state_entry(self, index: int) -> dict[str, Any] | None:
        return self.swapped.state_entry(index)

    def load(self, index: int, sg: SubGroup, master: torch.Tensor, state: dict[str, Any] | None) -> bool:
        self.swapped.load(index, master, state)
        return True

    def master_of(self, index: int, sg: SubGroup) -> torch.Tensor:
        return self.swapped.master_tensor(index)  # mapped from its file

    def grad_of(self, index: int, sg: SubGroup) -> torch.Tensor | None:
        key = self.swapped._key("grad", index)
        steps = self.swapped.backward_steps
        if steps is not None and steps.holds_gradient_of(index):
            raise ValueError("safe_get_full_grad/safe_get_local_grad: offload_optimizer.super_offload stepped this "
                             "parameter's sub-group during backward and kept no gradient; read gradients with "
                             "super_offload off")
        if key not in self.swapped.store:
            return torch.zeros(sg.numel)  # no gradient written since the last step
        self.swapped.recycle()
        return self.swapped.store.mapped(key).float()

    def state_of(self, index: int, sg: SubGroup) -> dict[str, Any]:
        return self.swapped.state_entry(index) or {}

    def state_tensors(self, state: OffloadStateTypeEnum) -> list[StateTensor]:
        return []  # masters, states and gradients are in swap files: nothing of them is in device memory

    def write_grad(self, index: int, sg: SubGroup, offset: int, values: torch.Tensor) -> None:
        raise ValueError("safe_set_full_grad/safe_set_local_grad: gradients offloaded to NVMe live in swap files, "
                         "which dsrun does not write outside the step; offload the optimizer to 'cpu' instead")

    def write_state(self, index: int, sg: SubGroup, key: str, offset: int, values: torch.Tensor) -> None:
        entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.state_of(index, sg).items()}
        entry[key].reshape(-1)[offset:offset + values.numel()].copy_(values)
        self.swapped.load(index, self.master_of(index, sg).clone(), entry)

    def grad_bytes(self) -> int:
        return 0

    def master_bytes(self) -> int:
        return 0

    def buffer_bytes(self) -> int:
        return self.swapped.resident_bytes

    def close(self) -> None:
        self.swapped.close()


class ShardPlacement:
    """Which store each sub-group goes to: ``offload_optimizer.ratio`` of the trainable elements (whole
    sub-groups, in order) offloaded to ``device`` (cpu or nvme), the rest on the training device."""

    def __init__(self, shard_ctx: ShardContext, optimizer: torch.optim.Optimizer,
                 settings: OffloadOptimizerSettings | None):
        self.settings = settings
        cpu_optimizer = None
        offloaded: DeviceShardStore | None = None
        if settings is not None:
            cpu_optimizer = require_cpu_optimizer(optimizer, settings)
            if cpu_optimizer is None and settings.ratio < 1.0:
                from dsrun.utils.errors import ConfigError, Problem

                raise ConfigError(Problem("zero_optimization.offload_optimizer.ratio", "partial offload steps tiles "
                                          "with a DeepSpeed CPU optimizer", "use optimizer type Adam, AdamW, Adagrad "
                                          "or Lion"))
            kind = NvmeShardStore if settings.device == "nvme" else HostShardStore
            offloaded = kind(shard_ctx, optimizer, cpu_optimizer, settings)
        self.device = DeviceShardStore(shard_ctx, optimizer, cpu_optimizer)
        self.offloaded = offloaded
        # resident stores first (their squared norms are summed in sub-group order), swap files last
        self.stores = [s for s in (offloaded, self.device) if s is not None]
        if isinstance(offloaded, NvmeShardStore):
            self.stores.reverse()
        self._budget: float | None = None
        self._placed = 0

    def store_for(self, sg: SubGroup, trainable_numel: Callable[[], int]) -> DeviceShardStore:
        """The store sub-group ``sg`` (the next in order) lives in; ``trainable_numel()`` is called once."""
        if self.offloaded is None:
            return self.device
        if self._budget is None:
            self._budget = self.settings.ratio * trainable_numel()
        offload = self._placed < self._budget
        self._placed += sg.numel
        return self.offloaded if offload else self.device

    @property
    def times(self) -> PipelineTimes | None:
        """Where the last offloaded step's time went (its tile or swap pipeline); None when nothing is."""
        return self.offloaded.times if self.offloaded is not None else None
