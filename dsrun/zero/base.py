"""The ZeRO strategy interface and the machinery stages 0-2 share.

The engine holds one strategy, chosen once at initialize, and talks to it only through :class:`ZeroStrategy`:
``before_forward``/``before_backward``/``after_backward`` around the model's passes, ``step`` at a boundary,
``zero_grad``, ``memory_breakdown`` and ``state_dict``. A new stage is a subclass in :mod:`dsrun.zero.strategies`.

:class:`FlatStrategy` implements the shared part of stages 0-2: each optimizer param group is flattened
(:mod:`.layout`), the optimizer is re-pointed at fp32 master tensors, and ``step`` unscales, checks for
overflow on every rank, clips by the global norm and updates. Subclasses decide where gradients live and
how they are reduced (:meth:`_launch`), and how updated weights reach the model (:meth:`_publish`).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from dsrun import comm
from dsrun.comm.groups import expert_parallel_size_of
from dsrun.utils.errors import ConfigError, Problem
from dsrun.checkpoint.layout import CheckpointLayout, layout_for_stage
from dsrun.optim.rank_state import RangeRead, read_in_memory
from dsrun.offload.flat_store import DeviceFlatStore
from dsrun.offload.pipeline import PipelineTimes
from dsrun.precision.keep_fp32 import split_kept
from dsrun.precision.strategy import PrecisionStrategy

from dsrun.zero.averaging import gradient_averaging
from dsrun.zero.buckets import Bucket, BucketQueue, plan_buckets
from dsrun.zero.layout import FlatGroup, flatten_params, parameter_alignment
from dsrun.zero.memory import MemoryBreakdown, tensor_bytes
from dsrun.utils.zero_to_fp32 import alignment_paddings
from dsrun.zero.step_hooks import AFTER_UPDATE, BEFORE_UPDATE, GradientReduction, StepHooks, StepState


_COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class StrategyContext:
    """Everything a ZeRO strategy is built from: the live objects, the typed DeepSpeed config (the one source of
    every setting and default, ``dsrun.config.DSConfig``), the run's process groups, and what features supply
    (``Features.sharding_policy()``, ``Features.gradient_accumulation()``)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    precision: PrecisionStrategy
    device: torch.device
    config: Any  # dsrun.config.DSConfig
    groups: Any = None  # dsrun.comm.ProcessGroups; None: the whole world is the data-parallel group
    sharding: Any = None  # stage 3's dsrun.zero.sharding.ShardingPolicy from a feature (ZeRO++); None: plain
    accumulation: Any = None  # dsrun.zero.grad_accum.GradientAccumulation from a feature; None: the stage's own

    @property
    def group(self) -> Any:
        """The data-parallel group ZeRO partitions over (None: the world)."""
        return self.groups.data if self.groups is not None else None

    @property
    def pipelined(self) -> bool:
        """Whether the model is split over pipeline stages: the stages hold different parameters, so the
        step's overflow flag and squared norm are also reduced over ``groups.pipe``."""
        return self.groups is not None and self.groups.size("pipe") > 1

    @property
    def world_size(self) -> int:
        return comm.get_world_size(self.group)

    def process_group_of(self, params: list[torch.nn.Parameter], where: str = "an optimizer param group"
                         ) -> tuple[Any, int, int]:
        """(group, its size, this rank's place in it) that ``params`` are reduced and partitioned over: the
        data-parallel group, or for MoE experts their expert-data-parallel group. All of ``params`` must
        share it."""
        if self.groups is None or not params:
            return self.group, self.world_size, self.rank
        if len({expert_parallel_size_of(p) for p in params}) > 1:
            raise ConfigError(Problem(where, "mixes MoE expert parameters with shared ones (or experts of "
                                      "different expert-parallel sizes)", "build the optimizer's param groups with "
                                      "dsrun.moe.utils.split_params_into_different_moe_groups_for_optimizer"))
        group = self.groups.group_of_param(params[0])
        return group, comm.get_world_size(group), comm.get_rank(group)

    @property
    def rank(self) -> int:
        return comm.get_rank(self.group)

    @property
    def zero_config(self) -> Any:
        """The ``zero_optimization`` section (stage-specific keys, offload sections)."""
        return self.config.zero_optimization

    @property
    def aio_config(self) -> Any:
        return self.config.aio

    @property
    def reduce_bucket_size(self) -> int:
        return int(self.zero_config.reduce_bucket_size)

    @property
    def allgather_bucket_size(self) -> int:
        return int(self.zero_config.allgather_bucket_size)

    @property
    def overlap_comm(self) -> bool:
        return bool(self.zero_config.overlap_comm)

    @property
    def reduce_scatter(self) -> bool:
        return bool(self.zero_config.reduce_scatter)

    @property
    def communication_data_type(self) -> torch.dtype | None:
        name = self.config.communication_data_type
        return _COMM_DTYPES[str(name).lower()] if name else None

    @property
    def prescale_gradients(self) -> bool:
        return bool(self.config.prescale_gradients)

    @property
    def gradient_predivide_factor(self) -> float:
        return float(self.config.gradient_predivide_factor)

    @property
    def gradient_average(self) -> bool:
        """``gradient_allreduce_op``: average the gradients over ranks ("mean"), or sum them ("sum")."""
        return getattr(self.config, "gradient_allreduce_op", "mean") == "mean"

    @property
    def force_ds_cpu_optimizer(self) -> bool:
        """``zero_force_ds_cpu_optimizer``: offload needs a DeepSpeed CPU optimizer."""
        return bool(self.config.zero_force_ds_cpu_optimizer)

    @property
    def gradient_clipping(self) -> float:
        """Known ahead, so NVMe offload measures gradients only when the step needs it."""
        return float(self.config.gradient_clipping or 0.0)


@dataclass
class StepOutcome:
    overflow: bool
    grad_norm: float | None


class ZeroStrategy(ABC):
    """What the engine needs from a ZeRO stage, and the one optimizer-step path every stage shares."""

    stage: int = -1
    norm_is_partitioned = True  # each rank holds part of the gradients: the squared norm is summed over ranks
    # whether the backward reduction may be switched off (enable_backward_allreduce = False): the stage keeps
    # each rank's whole local gradient until the step (stages 0-1, on the device)
    supports_local_gradients = False
    deepspeed_wrapper: str | None = None  # DeepSpeed's optimizer wrapper here (dsrun.optim.optimizer_wrappers)
    scatters_gradients = False  # reduced by a reduce-scatter (else an all-reduce): the averaging rule differs
    param_alignment_paddings: list[list[int]] | None = None  # DeepSpeed's, per master (parameter_alignment)

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx
        self.world_size = ctx.world_size
        self.rank = ctx.rank
        self.precision = ctx.precision
        self.model_dtype = ctx.precision.model_dtype
        self.comm_dtype = ctx.communication_data_type or self.model_dtype
        # each reduction divides its payload before the collective and finishes the average on what it received
        # (averaging.py), so a reduced gradient is always the average, whatever is reduced again later
        self.averaging = gradient_averaging(self.world_size, average=ctx.gradient_average,
                                            prescale=ctx.prescale_gradients, factor=ctx.gradient_predivide_factor,
                                            scatter=self.scatters_gradients)
        self.hooks = StepHooks()  # named points on the step path (step_hooks.py)
        self.global_grad_norm: float | None = None
        self.norm_group = ctx.group  # the ranks whose partitions together hold every gradient once
        self.steps_taken = 0
        self.reduction = GradientReduction()  # the backward reduction's switch, and what this step's gradients are

    @property
    def enable_backward_allreduce(self) -> bool:
        """DeepSpeed's switch: reduce gradients across ranks in backward (True), or leave each rank its own
        local gradient for an optimizer that communicates itself (the 1-bit family turns it off once its
        warm-up ends). Read at each accumulation boundary's backward; the step then sees unreduced
        gradients: the local mean over this rank's micro-batches, ``local_gradients()``."""
        return self.reduction.enabled

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, value: bool) -> None:
        if not value and not self.supports_local_gradients:
            raise RuntimeError(f"{type(self).__name__} cannot keep unreduced gradients (only ZeRO stages 0 and 1 "
                               "without optimizer offload hold each rank's whole gradient until the step)")
        self.reduction.enabled = bool(value)

    def local_gradients(self) -> list[torch.Tensor] | None:
        """This rank's whole gradients, one flat tensor per master in the model's dtype, summed over its
        micro-steps and still multiplied by the loss scale (None where the stage does not keep them). Before
        the reduction they are the local gradients; after it, they hold what the reduction left there."""
        return None

    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that steps this rank's (master) parameters; schedulers act on its param groups."""

    def before_forward(self) -> None:
        """Called before each forward (stage 3 gathers parameters here)."""

    @abstractmethod
    def before_backward(self, boundary: bool) -> None:
        """Called before ``loss.backward()``; ``boundary`` is True on the last micro-step of an optimizer step."""

    @abstractmethod
    def after_backward(self, boundary: bool) -> None:
        """Called after ``loss.backward()``: finish whatever gradient reduction this micro-step needs."""

    # --- the optimizer step: one path for every stage -------------------------------------------------
    def step(self, gradient_clipping: float) -> StepOutcome:
        """Check overflow on every rank, measure and clip by the global norm, update, and make the model's
        parameters current; the step hooks run around the update."""
        self._begin_step()
        if self.precision.checks_overflow and self._overflow_on_any_rank():
            self.global_grad_norm = None
            return StepOutcome(overflow=True, grad_norm=None)
        # One multiply removes the loss scale and clips.
        coef = 1.0 / self.precision.loss_scale
        norm = None
        if gradient_clipping and gradient_clipping > 0:
            norm = self._global_norm(coef)
            clip_coef = gradient_clipping / (norm + 1e-6)
            if clip_coef < 1.0:
                coef *= clip_coef
        state = StepState(strategy=self, coef=coef, grad_norm=norm, step=self.steps_taken)
        self.hooks.run(BEFORE_UPDATE, state)
        self.global_grad_norm = state.grad_norm  # a hook may measure it anew (Muon: over its updates)
        self._apply_update(state.coef)
        self.steps_taken += 1
        self.hooks.run(AFTER_UPDATE, state)
        return StepOutcome(overflow=False, grad_norm=state.grad_norm)

    def _begin_step(self) -> None:
        """Bring the gradients to where the step reads them (stages 0-2: the fp32 master gradients)."""

    def _overflow_on_any_rank(self) -> bool:
        local = self._local_overflow()
        if self.world_size == 1 and not self.ctx.pipelined:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=self.ctx.device)
        if self.world_size > 1:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.ctx.group)
        if self.ctx.pipelined:  # every stage skips the step together
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.ctx.groups.pipe)
        return bool(flag.item() > 0)

    def _global_norm(self, scale: float) -> float:
        sq = self._local_sq_norm()
        if self.norm_is_partitioned and self.reduction.reduced and self.world_size > 1:
            comm.all_reduce(sq, group=self.norm_group)
        if self.ctx.pipelined:  # the stages hold disjoint parameters: their squares add up
            comm.all_reduce(sq, group=self.ctx.groups.pipe)
        return math.sqrt(sq.item()) * scale

    @abstractmethod
    def _local_overflow(self) -> bool:
        """Whether this rank's gradients hold an inf or nan."""

    @abstractmethod
    def _local_sq_norm(self) -> torch.Tensor:
        """The sum of squares of this rank's gradients (float64, one element, on the device)."""

    @abstractmethod
    def _apply_update(self, coef: float) -> None:
        """Scale the gradients by ``coef``, update, and write the new weights into the model."""

    def step_gradients(self) -> list[torch.Tensor]:
        """The resident gradients the update reads (for step hooks)."""
        return []

    @abstractmethod
    def zero_grad(self) -> None:
        ...

    @abstractmethod
    def memory_breakdown(self) -> MemoryBreakdown:
        ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        ...

    @abstractmethod
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ...

    def update_optimizer_step(self, step: int) -> None:
        """Set step counters kept outside the optimizer's own state (``engine.update_optimizer_step``)."""

    def close(self) -> None:
        """Release hooks, buffers, files and threads (``engine.destroy()``); the strategy is unusable after."""

    def rank_state_dict(self) -> dict[str, Any] | None:
        """Optimizer state that differs on every data-parallel rank even where the rest is replicated (the
        1-bit optimizers' error buffers): the checkpoint writes it once per rank. None when there is none."""
        own = getattr(self.optimizer, "rank_state_dict", None)
        return own() if own is not None else None

    def load_rank_state_dicts(self, states: list[dict[str, Any]], read: RangeRead = read_in_memory) -> None:
        """Restore :meth:`rank_state_dict`: this rank's own, or every saved rank's re-cut (ranges via ``read``)."""
        load = getattr(self.optimizer, "load_rank_state_dicts", None)
        if load is not None:
            load(states, read)

    # --- checkpoints: what this strategy saves and in which files -------------------------------------
    @property
    def checkpoint_layout(self) -> CheckpointLayout:
        """The files this strategy's state goes to (DeepSpeed's layout of its stage)."""
        return layout_for_stage(self.stage)

    @abstractmethod
    def checkpoint_param_shapes(self) -> list["OrderedDict[str, torch.Size]"]:
        """One ``{name: full shape}`` per master tensor, in the order its elements are laid out (DeepSpeed's
        ``param_shapes``, which resharding and zero_to_fp32 read)."""

    @abstractmethod
    def master_partitions(self) -> list[tuple[int, int, Any]]:
        """Per master tensor (in :meth:`checkpoint_param_shapes`' order): how many ranks it is cut over (1: whole
        on every rank), this rank's place among them, and their process group (the data-parallel group, or an
        MoE expert's expert-data-parallel group); with the stage, ``master_slots`` locates every element."""

    def full_param_value(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A CPU copy of ``param``'s whole value in the model's dtype (stage 3: gathered, a collective within
        the group it is partitioned over)."""
        return param.detach().cpu().clone()

    def frozen_param_fragments(self) -> tuple[dict[str, torch.Size], dict[str, torch.Tensor]]:
        """Shapes and this rank's pieces of the parameters that do not train (partitioned weights only)."""
        from dsrun.checkpoint.state import frozen_params

        return frozen_params(self.ctx.module)

    def frozen_param_messages(self) -> dict[str, torch.Tensor]:
        """ZeRO-3 with ``zero_quantized_nontrainable_weights``: the frozen shards as stored (INT8 messages)."""
        return {}

    def _names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.ctx.module.named_parameters()}

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The model's full state dict for ``save_16bit_model`` (collective under stage 3); None when this
        strategy cannot give one (stage 3 without ``stage3_gather_16bit_weights_on_model_save``)."""
        return self.full_16bit_state_dict(exclude_frozen_parameters)

    def full_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The full state dict whatever the gather flag says (collective under stage 3): DeepSpeed's
        ``engine._zero3_consolidated_16bit_state_dict``, which only ``save_16bit_model`` gates on the flag."""
        sd = self.ctx.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.ctx.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd


class FlatStrategy(ZeroStrategy):
    """Shared implementation of stages 0-2 over flat param groups."""

    alignment_per_rank = 0  # 0: no padding (stage 0); k: pad to k * world_size
    partitioned = False  # gradients and master weights hold only this rank's partition
    reduce_every_micro_step = False  # stage 2 cannot keep full gradients across micro-steps

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        self._optimizer = ctx.optimizer
        self.groups: list[FlatGroup] = []
        seen: set[int] = set()
        # zero_optimization.parameter_alignment (stages 1-2): each parameter starts 16-byte aligned (layout.py)
        aligned = self.partitioned and ctx.zero_config.parameter_alignment
        starts = parameter_alignment(self.model_dtype) if aligned else 1
        param_groups = []
        for param_group in self._optimizer.param_groups:
            params = []
            for p in param_group["params"]:
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                params.append(p)
            group, size, rank = ctx.process_group_of(params)
            alignment = self.alignment_per_rank * size if self.alignment_per_rank else 1
            # data_types.keep_in_fp32_modules: the kept parameters flat in fp32, in a param group of their own
            for dtype, subset in split_kept(params, self.model_dtype):
                self.groups.append(flatten_params(subset, dtype, ctx.device, alignment, size, group, rank, starts))
                param_groups.append({**param_group, "params": subset})
        self._optimizer.param_groups[:] = param_groups
        if starts > 1:
            self.param_alignment_paddings = [list(g.paddings) for g in self.groups]
        self.store = self._make_store(ctx)  # where the masters, their gradients and states live
        # MoE experts are reduced over their own (smaller) groups: at stage 0 each rank then holds gradients the
        # others do not, so the squared norm is summed over the data group, each group's copies once (_local_sq_norm)
        self._own_groups = any(g.world_size != self.world_size or g.process_group is not ctx.group
                               for g in self.groups)
        self._build_buffers()
        self.masters: list[torch.nn.Parameter] = self._build_masters()
        for param_group, master in zip(self._optimizer.param_groups, self.masters):
            param_group["params"] = [master]
        if self._optimizer.state:
            self._optimizer.state.clear()  # state keyed by the old per-tensor params would never be used
        self.queue = BucketQueue(self.groups, plan_buckets(self.groups, ctx.reduce_bucket_size), self._launch,
                                 self._on_param_ready, self._on_accumulated)
        self._step_grads: list[torch.Tensor] = []

    def close(self) -> None:
        self.queue.remove()
        self.store.close()

    def _make_store(self, ctx: StrategyContext) -> DeviceFlatStore:
        return DeviceFlatStore(self.model_dtype, ctx.device)

    @property
    def last_step_times(self) -> PipelineTimes | None:
        """Where the last update's time went (an offloaded store's tile pipeline; None on the device)."""
        return self.store.times

    # --- what subclasses provide ---------------------------------------------------------------------------
    @abstractmethod
    def _build_buffers(self) -> None:
        """Allocate gradient buffers (flat or partitioned)."""

    @abstractmethod
    def _build_masters(self) -> list[torch.nn.Parameter]:
        """One fp32 master tensor per group (the full group at stage 0, this rank's partition at 1-2)."""

    @abstractmethod
    def _reduce(self, bucket: Bucket, async_op: bool) -> None:
        """Start (or, with ``async_op=False``, do) the reduction of one bucket of gradients."""

    @property
    def reduce_during_backward(self) -> bool:
        """Reduce buckets from the autograd hooks as they fill (``overlap_comm``), or all after backward."""
        return bool(self.ctx.overlap_comm)

    def _on_param_ready(self, gi: int, pi: int, buckets: list[Bucket]) -> None:
        """A parameter's gradient is complete (stage 2 copies it out here)."""
    _on_accumulated = None  # stages 0-1: (gi, pi) -> None after every accumulation into a .grad

    @abstractmethod
    def _complete(self, bucket: Bucket) -> None:
        """Wait for a bucket's reduction and put the result where the step will read it."""

    @abstractmethod
    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients matching ``self.masters``, averaged over ranks but still multiplied by
        the loss scale (the step removes it)."""

    @abstractmethod
    def _publish(self) -> None:
        """Copy the updated master weights into the model's parameters."""

    # --- shared -------------------------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def before_backward(self, boundary: bool) -> None:
        if boundary:
            self.reduction.latch()
        if (boundary or self.reduce_every_micro_step) and self.enable_backward_allreduce:
            self.queue.start()

    def _launch(self, bucket: Bucket) -> None:
        """Called by the bucket queue, in bucket order, once backward has filled ``bucket``."""
        if self.reduce_during_backward:
            self._reduce(bucket, async_op=bool(self.ctx.overlap_comm))
            if not self.ctx.overlap_comm:
                self._complete(bucket)

    def after_backward(self, boundary: bool) -> None:
        if not self.queue.active:
            return
        self.queue.flush()
        if not self.reduce_during_backward:
            for bucket in self.queue.buckets:
                self._reduce(bucket, async_op=False)
        for bucket in self.queue.buckets:
            self._complete(bucket)

    def _comm_dtype_of(self, group: FlatGroup) -> torch.dtype:
        """The dtype ``group``'s gradients are reduced in: fp32 for fp32-kept parameters (keep_in_fp32_modules)."""
        return self.comm_dtype if group.flat_param.dtype == self.model_dtype else torch.float32

    def _divide_before_reduce(self, tensor: torch.Tensor) -> None:
        self.averaging.before(tensor)

    @property
    def norm_is_partitioned(self) -> bool:  # type: ignore[override]
        return self.partitioned or self._own_groups

    def _begin_step(self) -> None:
        self._step_grads = self._master_grads()

    def step_gradients(self) -> list[torch.Tensor]:
        return self._step_grads

    def _checked_grads(self) -> list[torch.Tensor]:
        """What overflow and norm are measured on: the step's gradients, or each rank's whole local gradient
        when backward did not reduce (then every rank checks and clips its own)."""
        return self._step_grads if self.reduction.reduced else (self.local_gradients() or self._step_grads)

    def _local_overflow(self) -> bool:
        # A sum is inf/nan when any element is (DeepSpeed's check too): one pass, no temporary.
        return any(not math.isfinite(float(g.sum())) for g in self._checked_grads())

    def _local_sq_norm(self) -> torch.Tensor:
        sq = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        for group, g in zip(self.groups, self._checked_grads()):
            part = self.store.square_sum(g)
            if self._own_groups and not self.partitioned and self.reduction.reduced:
                part = part / group.world_size  # whole copies on each of the group's ranks
            sq += part
        return sq

    def _apply_update(self, coef: float) -> None:
        self.store.update(self._optimizer, self.masters, self._step_grads, coef)
        self._publish()

    def _padding_bytes(self) -> int:
        return sum(g.padding * g.flat_param.element_size() for g in self.groups)

    def _param_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.ctx.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += tensor_bytes(p)
        return total + self._padding_bytes()

    def _master_bytes(self) -> int:
        own = {g.flat_param.data_ptr() for g in self.groups}
        return sum(tensor_bytes(m) for m in self.masters if m.data_ptr() not in own)

    # --- checkpoint state (DeepSpeed's names where they exist) -------------------------------------------
    def _unpadded_master(self, gi: int) -> torch.Tensor:
        master = self.masters[gi].detach()
        group = self.groups[gi]
        if self.partitioned:
            pad = group.partition_padding(group.rank)
            return master[: master.numel() - pad]
        return master[: group.numel]

    def checkpoint_param_shapes(self) -> list["OrderedDict[str, torch.Size]"]:
        names = self._names()
        return [OrderedDict((names[id(p)], p.shape) for p in group.params) for group in self.groups]

    def master_partitions(self) -> list[tuple[int, int, Any]]:
        return [(g.world_size, g.rank, g.process_group) if self.partitioned else (1, 0, None) for g in self.groups]

    def state_dict(self) -> dict[str, Any]:
        extra = self.store.state_entries()  # first: a store's update still running finishes before masters are read
        sd = {
            "zero_stage": self.stage,
            "partition_count": self.world_size if self.partitioned else 1,
            "base_optimizer_state": self._optimizer.state_dict(),
            "single_partition_of_fp32_groups": [self._unpadded_master(i).clone()
                                                for i in range(len(self.groups))],
            "group_paddings": [g.partition_padding(g.rank) if self.partitioned else g.padding for g in self.groups],
            "param_shapes": [g.param_shapes() for g in self.groups],
        }
        if self.param_alignment_paddings is not None:
            sd["param_alignment_paddings"] = self.param_alignment_paddings
        sd.update(self.precision.state_dict(), **extra)
        return sd

    def load_rank_state_dicts(self, states: list[dict[str, Any]], read: RangeRead = read_in_memory) -> None:
        super().load_rank_state_dicts(states, read)
        self._publish()  # the rank state may hold this rank's own weights (0/1 Adam between synchronisations)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("partition_count", 1) != (self.world_size if self.partitioned else 1):
            raise RuntimeError("ZeRO optimizer state was saved with a different data-parallel world size "
                               f"({sd.get('partition_count')}) than this run ({self.world_size})")
        if alignment_paddings(sd.get("param_alignment_paddings")) != alignment_paddings(self.param_alignment_paddings):
            raise RuntimeError("ZeRO optimizer state was saved with another zero_optimization.parameter_alignment "
                               "layout than this run's; load it through load_checkpoint, which re-lays it out")
        with torch.no_grad():
            for gi, saved in enumerate(sd["single_partition_of_fp32_groups"]):
                self.masters[gi].data[: saved.numel()].copy_(saved)
        self._optimizer.load_state_dict(sd["base_optimizer_state"])
        self.precision.load_state_dict(sd)
        self.store.load_state_entries(sd)
        self.store.loaded(self.masters)
        self._publish()
