"""The training engine: ``loss = engine(batch); engine.backward(loss); engine.step()``.

The engine is composed once at initialize from a precision strategy (:mod:`dsrun.precision.strategy`) and a
ZeRO strategy (:mod:`dsrun.zero.strategies`), and then only orchestrates: gradient-accumulation boundaries,
loss scaling, the optimizer/scheduler step, counters, timers and reporting. It keeps DeepSpeed's
attribute and method names (``global_steps``, ``micro_steps``, ``skipped_steps``, ``get_lr()``,
``train_batch_size()`` …) so DeepSpeed training scripts run unchanged.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch.utils.data import Dataset

from dsrun import comm
from dsrun.comm import ProcessGroups
from dsrun.comm.comm import ProcessGroup
from dsrun.config import DSConfig
from dsrun.accelerator import get_accelerator
from dsrun.checkpoint.deepspeed_checkpoint import _checkpoint_parallel_metadata  # noqa: F401  (DeepSpeed's runtime.engine name)
from dsrun.optim import check_zero_optimizer
from dsrun.data_efficiency.engine_api import DataEfficiencyMethods
from dsrun.compression.feature import CompressionFeature
from dsrun.data_efficiency.features import DataEfficiency
from dsrun.engine.dataloader import DeepSpeedDataLoader
from dsrun.engine.direct_backward import DirectBackward
from dsrun.engine.engine_collectives import Collectives
from dsrun.engine.engine_getters import ConfigView, facade
from dsrun.engine.engine_methods import EngineMethods
from dsrun.engine import builtin_features  # noqa: F401  (registers the built-in features, in hook order)
from dsrun.features import Features
from dsrun.optim.lr_schedules import build_lr_scheduler
from dsrun.engine.autotuning_probe import AutotuningProbe
from dsrun.engine.observer import EngineObserver
from dsrun.precision.strategy import PrecisionStrategy, build_precision, cast_model
from dsrun.precision.torch_autocast import autocast_if_enabled, init_autocast_params
from dsrun.profiling.timers import WallClockTimers
from dsrun.zero.strategies import DeepSpeedZeRoOffload, MemoryBreakdown, StrategyContext, ZeroStrategy, build_zero_inference, build_zero_strategy
from dsrun.comm.groups import set_current_groups
from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.logging import set_log_level_from_string
from dsrun.utils.python_gc import python_gc_manager

if TYPE_CHECKING:
    from dsrun.checkpoint.engine_io import Tag


class DataParallelMpu(Protocol):
    """Megatron's ``mpu`` as the engine reads it: the data-parallel group it brings."""

    def get_data_parallel_group(self) -> ProcessGroup: ...


FORWARD_TIMER, BACKWARD_TIMER, BACKWARD_INNER_TIMER = "forward", "backward", "backward_inner"
BACKWARD_REDUCE_TIMER, STEP_TIMER = "backward_allreduce", "step"


class DeepSpeedEngine(torch.nn.Module):
    """Wraps the model; built by :func:`dsrun.initialize`. DeepSpeed's config getters, its other methods
    (``no_sync``, ``set_train_batch_size``, ``load_module_state_dict`` …), its reduction helpers and its
    data-efficiency methods live in parts the engine holds (``settings``: :mod:`~dsrun.engine.engine_getters`,
    ``methods``: :mod:`~dsrun.engine.engine_methods`, ``collectives``: :mod:`~dsrun.engine.engine_collectives`,
    ``data_efficiency_methods``: :mod:`~dsrun.data_efficiency.engine_api`); the class carries each of
    their public names as a one-line delegation (``facade``, below the class). Features attach through
    :mod:`dsrun.features`.

    ``config`` is the typed :class:`dsrun.config.DSConfig` (every setting and default comes from it); ``optimizer`` an optimizer over the model's
    parameters (client or from the config) or None; ``lr_scheduler`` a scheduler object, a callable taking
    the optimizer, or None (then the config's ``scheduler`` section, if any, is used).
    """

    # DeepSpeed's switches and the engine's step state (read and set by engine_methods.py too)
    inside_no_sync_ctxt: bool = False
    _python_gc_lease: int | None = None  # disable_python_gc's lease, given back at destroy()
    # managed_gradient_accumulation false: step() is the boundary (True while it runs); backwards since the last
    _stepping: bool = False
    _backwards_since_step: int = 0
    _reduction_pending: bool = False  # a boundary backward skipped the reduction (no_sync, or switched off)
    _step_applied: bool = False
    _is_compiled: bool = False
    _deepcompile_active: bool = False  # the module runs DeepCompile's graphs (engine.compile)
    parameter_offload: DeepSpeedZeRoOffload | None = None  # stage 3 without an optimizer (dsrun/zero/parameter_offload.py)
    pipeline_parallelism = False  # the pipeline engine's is True
    scale_wrt_gas: bool | None = None  # when set, overrides backward(scale_wrt_gas=...)
    loaded_checkpoint_dp_world_size: int | None = None  # set by load_checkpoint
    loaded_checkpoint_mp_world_size: int | None = None
    # DeepSpeed's names for the model's MoE layers: the MoE feature (dsrun/moe/feature.py) sets them at attach
    has_moe_layers: bool = False
    moe_layers: tuple[torch.nn.Module, ...] | list = ()
    gate_modules: tuple[torch.nn.Module, ...] | list = ()

    def __init__(self, model: torch.nn.Module, config: DSConfig, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None, training_data: Dataset | None = None, collate_fn: Callable | None = None,
                 mpu: DataParallelMpu | None = None, raw_config: Any = None, features: Features | None = None):
        super().__init__()
        self._config = config
        if config.log_level is not None:  # the "DeepSpeed" logger's level, first thing (as DeepSpeed's engine)
            set_log_level_from_string(config.log_level)
        self.settings = ConfigView(config, self)  # DeepSpeed's config getters, delegated to (engine_getters.py)
        self.data_efficiency_methods = DataEfficiencyMethods(self)  # DeepSpeed's data-efficiency methods, too
        self.collectives = Collectives(self)  # DeepSpeed's reduction helpers (allreduce_bucket & co.), too
        self.methods = EngineMethods(self)  # the rest of DeepSpeed's methods (no_sync, set_train_batch_size ...)
        self.training_data, self.collate_fn, self.client_lr_scheduler = training_data, collate_fn, lr_scheduler
        self.client_optimizer: Any = None  # set by initialize when the client passed one
        self.config = raw_config if raw_config is not None else config
        self.mpu = mpu
        # the features (dsrun/features.py), built by initialize; they shape the topology (group_sizes), take the
        # run's groups once built (take_topology), and initialize attaches them once the engine is built
        self.features = features if features is not None else Features.build(config)
        # the run's topology and process groups, built once (dsrun/comm/groups.py); ZeRO partitions over
        # the data-parallel group
        self.groups = self._process_groups(mpu)
        self.dp_group = self.groups.data
        self.global_rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()
        self.world_size = comm.get_world_size()
        self.dp_world_size = comm.get_world_size(self.dp_group)
        # Ulysses: consecutive data-parallel ranks share samples (dsrun/sequence); ZeRO keeps the whole data group
        self.sequence_parallel_size = self.groups.sequence_parallel_size
        self.device = get_accelerator().device(self.local_rank)
        # the features take the run's groups (MoE layers get their expert groups: collective; Ulysses sets the
        # reduction dtype)
        self.features.take_topology(model, self.groups)
        set_current_groups(self.groups)  # the run's groups (a no-op when a feature already made them so)
        # DeepSpeed's data-efficiency methods read it, on or off
        self.data_efficiency = self.features.get(DataEfficiency) or DataEfficiency(config)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.losses: torch.Tensor | None = None  # the mean loss summed over this step's micro-batches (DeepSpeed's)
        # DeepSpeed's "step=N, skipped=S, lr=[...]" line every steps_per_print steps; a caller that prints its
        # own progress (dsrun's worker) turns it off
        self.print_step_lines = True
        self.gradient_average = config.gradient_allreduce_op == "mean"  # "sum": gradients summed over ranks
        self._boundary_override: bool | None = None
        self.timers = WallClockTimers(bool(config.wall_clock_breakdown))
        comm.configure(config)

        self.precision: PrecisionStrategy = build_precision(config.fp16, config.bf16, config.zero_optimization.stage)
        model.to(self.device)
        # data_types.buffer_dtype and keep_in_fp32_modules: the casts' own rules (dsrun/precision/keep_fp32.py)
        self.fp32_islands = None if self.precision.model_dtype == torch.float32 else cast_model(
            model, self.precision.model_dtype, config.data_types.buffer_dtype, config.data_types.keep_in_fp32_modules,
            self.precision.master_dtype, config.torch_autocast.enabled)
        self.module = model
        self._broadcast_model()
        if self.torch_autocast_enabled():  # the torch_autocast section: comm dtypes of the safe modules' params
            init_autocast_params(self, self.torch_autocast_dtype(), self.torch_autocast_lower_precision_safe_modules())

        self.strategy: ZeroStrategy | None = None
        self.optimizer: torch.optim.Optimizer | DeepSpeedZeRoOffload | None = None
        stage = int(config.zero_optimization.stage)
        if optimizer is not None:
            check_zero_optimizer(optimizer, stage, bool(config.zero_allow_untested_optimizer))
            self.strategy = build_zero_strategy(stage, self._strategy_context(optimizer))
            self.optimizer = self.strategy.optimizer
        elif stage > 0:  # ZeRO-Inference at 3 (engine.optimizer: its DeepSpeedZeRoOffload, as DeepSpeed's); 1-2: refused
            self.optimizer = self.parameter_offload = build_zero_inference(self._strategy_context(None))
        self.direct_backward = DirectBackward(self)  # backward passes engine.backward() did not run
        self.lr_scheduler = self._configure_lr_scheduler(lr_scheduler)
        self.training_dataloader = (self.deepspeed_io(training_data, collate_fn=collate_fn)
                                    if training_data is not None else None)
        self._comm_at_step_start = comm.get_comms_stats()
        self._last_step_comm: dict[str, dict[str, float]] = {}
        # observability (monitors, wall-clock breakdown, flops profiler): dsrun/engine/observer.py
        self.observer = EngineObserver(self, config)
        self.autotuning_probe = AutotuningProbe(self, config)  # dsrun/engine/autotuning_probe.py
        self.monitor = self.observer.monitor
        self.flops_profiler = self.observer.flops_profiler
        self.methods._apply_compile_config()  # the config's compile section (engine_methods.py)
        self.observer.engine_built()  # memory_breakdown's line; dump_state logs the engine's attributes
        # disable_python_gc: automatic cyclic GC off while this engine lives (dsrun/utils/python_gc.py)
        self._python_gc_lease = python_gc_manager.acquire() if config.disable_python_gc else None

    # --- construction ---------------------------------------------------------------------------------
    @classmethod
    def prepare_model(cls, model: torch.nn.Module, config: DSConfig) -> None:
        """Called by :func:`dsrun.initialize` before the optimizer is built over the model's parameters, on the
        engine class the model names (``model.engine_class()``), which may re-cut it. A plain model: nothing."""

    def _process_groups(self, mpu: DataParallelMpu | None) -> ProcessGroups:
        """The run's groups: the whole world data-parallel, with the axes the features ask for (Ulysses: sequence
        groups); an mpu that holds a whole topology's :class:`ProcessGroups` (``mpu.groups``: a grid the model
        brings) gives them as they are; a client mpu otherwise gives its data-parallel group (a feature refuses
        them when it needs an axis they lack)."""
        if mpu is None:
            return ProcessGroups(**self.features.group_sizes())
        own = getattr(mpu, "groups", None)
        if isinstance(own, ProcessGroups):
            return own
        return comm.groups.from_data_group(mpu.get_data_parallel_group())

    def _broadcast_model(self) -> None:
        """Start every rank from rank 0's weights and buffers (as DeepSpeed does); an MoE expert from the first
        rank of its expert-data-parallel group (the other ranks hold other experts)."""
        if self.dp_world_size == 1:
            return
        src = 0 if self.dp_group is None else comm.get_global_rank(self.dp_group, 0)
        with torch.no_grad():
            for param in self.module.parameters():
                if hasattr(param, "ds_optim_param"):  # OptimizedLinear's base-weight shard: each rank's own
                    continue
                members = self.groups.members_of_param(param)
                if len(members) > 1:
                    comm.broadcast(param.data, src=members[0], group=self.groups.group_of_param(param))
            for tensor in self.module.buffers():
                comm.broadcast(tensor.data, src=src, group=self.dp_group)

    def _strategy_context(self, optimizer: torch.optim.Optimizer | None) -> StrategyContext:
        # a feature's stage-3 sharding policy (ZeRO++/MiCS/hpZ; built at stage 3 only), else plain ZeRO-3's; a
        # feature's gradient accumulation (data_types.grad_accum_dtype), else the stage's own
        return StrategyContext(module=self.module, optimizer=optimizer, precision=self.precision,
                               device=self.device, config=self._config, groups=self.groups,
                               sharding=self.features.sharding_policy(),
                               accumulation=self.features.gradient_accumulation())

    def _configure_lr_scheduler(self, client_scheduler: Any) -> Any:
        if client_scheduler is not None:
            if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
                return client_scheduler(self.optimizer)
            return client_scheduler
        scheduler = self._config.scheduler
        if scheduler is None or scheduler.type is None:
            return None
        if self.strategy is None:  # no optimizer (ZeRO-Inference's engine.optimizer steps nothing)
            raise ConfigError(Problem("scheduler", "a scheduler needs an optimizer",
                                      "add an \"optimizer\" section or pass optimizer= to initialize"))
        return build_lr_scheduler(scheduler.type, self.optimizer, scheduler.params)

    # --- the training loop ----------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.autotuning_probe.before_forward()  # autotuning.model_info.profile: count the activations
        self.observer.before_forward()
        self.timers.start(FORWARD_TIMER)
        if self.strategy is not None:
            self.strategy.before_forward()
        inputs, kwargs = self.precision.prepare_inputs(inputs, kwargs)
        kwargs.update(self.features.forward_kwargs(self.module.training, self.global_steps))
        with autocast_if_enabled(self):  # the torch_autocast section
            out = self.module(*inputs, **kwargs)
        self.timers.stop(FORWARD_TIMER)
        self.observer.after_forward()
        return out

    def backward(self, loss: torch.Tensor, allreduce_gradients: bool = True, release_loss: bool = False,
                 retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps; on the boundary micro-step gradients are
        reduced across ranks (stage 2 reduces on every micro-step). ``loss.backward()`` followed by ``step()``
        trains the same (:mod:`dsrun.engine.direct_backward`), except in fp16."""
        if not allreduce_gradients:
            warnings.warn("backward(allreduce_gradients=False) is deprecated and ignored, as in DeepSpeed; use "
                          "engine.no_sync() to accumulate without reducing", DeprecationWarning, stacklevel=2)
        if self.scale_wrt_gas is not None:
            scale_wrt_gas = self.scale_wrt_gas
        self.autotuning_probe.before_backward()  # autotuning.model_info.profile: write the model info, exit
        self.observer.before_backward()
        self.timers.start(BACKWARD_TIMER)
        divisor = self._gas_divisor(scale_wrt_gas)
        if divisor != 1.0:
            loss = loss.float() / divisor
        mean_loss = loss.detach().mean()
        self.losses = mean_loss if self.losses is None else self.losses + mean_loss
        boundary = self._backward_prologue()
        with self.direct_backward.engine_backward():
            self.precision.scale_loss(loss).backward(retain_graph=retain_graph)
        self._backward_epilogue(boundary)
        self.timers.stop(BACKWARD_TIMER)
        self.observer.after_backward(loss)
        return loss

    def _gas_divisor(self, scale_wrt_gas: bool) -> float:
        """What a backward's gradients are divided by: the accumulation steps; as DeepSpeed, not for a backward
        that does not reduce (no_sync, enable_backward_allreduce=False)."""
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1 and self.enable_backward_allreduce and not self.inside_no_sync_ctxt:
            return float(gas)
        return 1.0

    def _backward_prologue(self) -> bool:
        """Before a backward's gradients arrive: whether it reduces (the boundary), and the strategy armed."""
        # no_sync() / enable_backward_allreduce=False: a boundary micro-step accumulates like any other, and the
        # reduction waits for the next boundary backward or allreduce_gradients() (engine_methods.py)
        boundary = self.is_gradient_accumulation_boundary()
        self._backwards_since_step += 1
        if not self._config.managed_gradient_accumulation and not self.zero_optimization_partition_gradients():
            self._reduction_pending = True  # stages 0-1 accumulate; the caller's step() reduces (engine_methods.py)
        if boundary and not self.methods._reduces_in_backward():  # no_sync: the next boundary backward or step reduces
            boundary, self._reduction_pending = False, True
        elif boundary:  # with the switch off the strategy keeps local gradients; allreduce_gradients() may reduce
            self._reduction_pending = not self.enable_backward_allreduce
        if self.strategy is not None:
            self.strategy.before_backward(boundary)
        self.timers.start(BACKWARD_INNER_TIMER)
        return boundary

    def _backward_epilogue(self, boundary: bool) -> None:
        """After every gradient of a backward arrived: finish the reduction this micro-step needs."""
        self.timers.stop(BACKWARD_INNER_TIMER)
        self.timers.start(BACKWARD_REDUCE_TIMER)
        if self.strategy is not None:
            self.strategy.after_backward(boundary)
            if boundary or self.strategy.stage >= 2:  # every gradient there is was reduced
                self.direct_backward.reduced()
        self.timers.stop(BACKWARD_REDUCE_TIMER)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count the micro-step; at a boundary update the weights (unless the gradients overflowed), step
        the scheduler, and advance ``global_steps``/``global_samples``."""
        if self.inside_no_sync_ctxt:
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")
        if self.parameter_offload is not None:
            self.parameter_offload.step()  # ZeRO-Inference: no optimizer, refused
        self._stepping = True  # managed_gradient_accumulation false: every step() is the boundary
        if self.strategy is not None:
            self.direct_backward.hand_over()  # gradients a loss.backward() left (fp16: refused)
            if self.is_gradient_accumulation_boundary():
                self.direct_backward.check_step()  # an optimizer step on no gradient at all: refused
        self.observer.before_step()
        self.timers.start(STEP_TIMER)
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            if self.enable_backward_allreduce:  # gradients a no_sync() backward left unreduced, if any
                self.allreduce_gradients()
            self.features.before_step(self.global_steps)
            overflow = False
            if self.strategy is not None:
                outcome = self.strategy.step(float(self._config.gradient_clipping or 0.0))
                overflow = outcome.overflow
                if self.strategy.deepspeed_wrapper is not None:  # DeepSpeed's wrappers keep the norm there
                    self.optimizer._global_grad_norm = outcome.grad_norm
                self.precision.update(overflow)
                self.strategy.zero_grad()
            self._step_applied = self.strategy is not None and not overflow
            if overflow:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.features.after_step(overflow)
            self.global_steps += 1
            if self._config.managed_gradient_accumulation:
                self.global_samples += self.train_batch_size()
            else:  # the micro-batches the caller actually ran, as DeepSpeed counts them
                self.global_samples += self.train_batch_size() // self.gradient_accumulation_steps() * \
                    self._backwards_since_step
            self._backwards_since_step = 0
            self.losses = None
            self._close_comm_window()
            self._report()
        self.micro_steps += 1
        self._boundary_override = None
        self._stepping = False
        self.timers.stop(STEP_TIMER)
        self.autotuning_probe.after_step(boundary)  # autotuning.metric_path: measure, then stop the run
        self.observer.after_step(boundary)  # monitor events; wall-clock means every steps_per_print

    def _close_comm_window(self) -> None:
        now = comm.get_comms_stats()
        before = self._comm_at_step_start
        self._last_step_comm = {}
        for op, stats in now.items():
            prev = before.get(op, {})
            delta = {k: v - prev.get(k, 0) for k, v in stats.items()}
            if delta["count"]:
                self._last_step_comm[op] = delta
        self._comm_at_step_start = now

    def _report(self) -> None:
        every = int(self._config.steps_per_print or 0)
        if not (self.print_step_lines and every) or self.global_steps % every or self.global_rank != 0:
            return
        rate = self.observer.flops_rate()  # with set_model_flops: TFLOP/s and MFU since the last line
        print(f"[dsrun] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}"
              + (f" | {rate.text()}" if rate is not None else ""), flush=True)

    def set_model_flops(self, flops_per_sample: float, peak_flops: float | None = None) -> float:
        """dsrun's: from now on report the model's TFLOP/s per device and MFU (achieved / peak) every
        ``steps_per_print`` steps, on the step line and to the monitors. ``flops_per_sample``: one sample's
        forward + backward model FLOPs, without recompute (a decoder of ``N`` weights, ``L`` layers, width ``d``
        over ``T`` tokens: ``T * dsrun.profiling.mfu.train_flops_per_token(N, L, d, T)``). ``peak_flops``: one
        device's peak FLOP/s (default: the table's for a known GPU, else a timed matmul at the model's dtype;
        call on every rank). Returns the peak used."""
        from dsrun.profiling.mfu import DevicePeak

        peak = DevicePeak(peak_flops, "given") if peak_flops else None
        return self.observer.set_model_flops(flops_per_sample, peak).flops

    def zero_grad(self) -> None:
        if self.strategy is not None:
            self.strategy.zero_grad()

    # --- DeepSpeed's accessors ------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        if not self._config.managed_gradient_accumulation:  # the caller owns the boundary: its step() calls
            return self._stepping
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the next backward/step to be (or not be) a boundary; reset after ``step()``."""
        if not self._config.managed_gradient_accumulation:
            raise AssertionError("set_gradient_accumulation_boundary() is not supported with "
                                 "managed_gradient_accumulation=False; every step() is the boundary")
        self._boundary_override = bool(is_boundary)

    @property
    def enable_backward_allreduce(self) -> bool:
        """DeepSpeed's switch: whether backward all-reduces gradients (the 1-bit optimizers turn it off once
        their warm-up ends); settable at ZeRO stages 0-1."""
        return self.strategy.enable_backward_allreduce if self.strategy is not None else True

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, value: bool) -> None:
        if self.strategy is not None:
            self.strategy.enable_backward_allreduce = value

    @property
    def compression(self) -> CompressionFeature | None:
        """The compression feature when the model is compressed (dsrun/compression/feature.py), else None."""
        feature = self.features.get(CompressionFeature)
        return feature if feature is not None and feature.active else None

    @property
    def cur_scale(self) -> float:
        """The loss scale in use now (fp16's dynamic scale; 1.0 otherwise). ``loss_scale()`` is the config's."""
        return self.precision.loss_scale

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (computed when gradient_clipping is on)."""
        return getattr(self.strategy, "global_grad_norm", None)

    def memory_breakdown(self) -> MemoryBreakdown:
        """This rank's bytes of parameters, gradients, master weights, optimizer states and padding."""
        holder = self.strategy or self.parameter_offload  # ZeRO-Inference's: the shards, no optimizer state
        if holder is None:
            size = sum(p.numel() * p.element_size() for p in self.module.parameters())
            return MemoryBreakdown(parameters=size, gradients=0, master_weights=0, optimizer_states=0, padding=0)
        return holder.memory_breakdown()

    def comm_stats_last_step(self) -> dict[str, dict[str, float]]:
        """Collectives of the last optimizer step on this rank: {op: {count, message_bytes, traffic_bytes,
        latency_s}} — what moved between the previous boundary and this one."""
        return dict(self._last_step_comm)

    def deepspeed_io(self, dataset: Dataset, batch_size: int | None = None, route: str | None = None,
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Callable | None = None,
                     num_local_io_workers: int | None = None) -> DeepSpeedDataLoader:
        """A loader giving this data-parallel rank its shard of ``dataset`` in micro-batches."""
        if self.mpu is not None:
            dp_rank, dp_size = self.mpu.get_data_parallel_rank(), self.mpu.get_data_parallel_world_size()
        else:
            # a sequence-parallel group reads the same samples (each rank keeps its slice of the sequence), and so
            # does a tensor-parallel group (the ranks of the model axis: AutoTP)
            sp = self.sequence_parallel_size
            dp_rank, dp_size = self.groups.coord("data") // sp, self.groups.size("data") // sp
        if self.data_efficiency.sampling_enabled:  # data efficiency: batches under the curriculum's difficulty
            from dsrun.data_efficiency.data_sampling.data_loader import build_curriculum_loader

            return build_curriculum_loader(self._config, dataset, batch_size or self.train_micro_batch_size_per_gpu(),
                                           dp_rank, dp_size, self.gradient_accumulation_steps(), self.global_rank,
                                           self.dp_group, collate_fn, pin_memory and get_accelerator().pin_memory_enabled())
        return DeepSpeedDataLoader(
            dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            pin_memory=pin_memory and get_accelerator().pin_memory_enabled(), local_rank=self.local_rank,
            collate_fn=collate_fn, num_local_io_workers=num_local_io_workers, data_sampler=data_sampler,
            data_parallel_world_size=dp_size, data_parallel_rank=dp_rank,
            dataloader_drop_last=bool(self._config.dataloader_drop_last))

    # --- checkpoints (dsrun.checkpoint does the work; every rank must call these) -------------------------
    def save_checkpoint(self, save_dir: str, tag: Tag = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save the full training state to ``save_dir/<tag>`` (default tag ``global_step<N>``), atomically."""
        from dsrun.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Tag = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable | None = None
                        ) -> tuple[str | None, dict | None]:
        """Restore a checkpoint (``tag`` None: the one ``latest`` names, or ``latest_universal`` with
        ``checkpoint.load_universal``); returns ``(load_path, client_state)``. ``custom_load_fn(src=state_dict,
        dst=module)`` replaces ``module.load_state_dict`` for the module weights."""
        from dsrun.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               custom_load_fn=custom_load_fn)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the model's weights (in the model's dtype) to ``save_dir/save_filename``; only global rank 0
        writes. Collective under ZeRO-3 (every rank must call it). Under ZeRO-3 without
        ``stage3_gather_16bit_weights_on_model_save`` nothing is saved and False is returned."""
        from dsrun.checkpoint import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The gathered weights on rank 0 ({} elsewhere), gathered whatever the save flag says; see
        :func:`dsrun.checkpoint.export.consolidated_16bit_state_dict`. Hugging Face's accelerate and Trainer call it."""
        from dsrun.checkpoint.export import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's: the whole weights on rank 0 of a model whose weights are split, by ZeRO-3 (as
        :meth:`_zero3_consolidated_16bit_state_dict`) or by AutoTP (each split parameter gathered over its
        tensor-parallel group; None on the other ranks)."""
        if int(self._config.zero_optimization.stage) == 3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.autotp_size() > 1:
            from dsrun.tensor_parallel.layers import consolidated_state_dict

            return consolidated_state_dict(self.module)
        raise ValueError("consolidated_16bit_state_dict is for weights split by ZeRO stage 3 or tensor parallelism")

    def destroy(self) -> None:
        """Release what the engine holds beyond its Python objects: the ZeRO strategy's autograd and module
        hooks, buckets, swap files and worker threads, the monitors, and the process groups it created
        (DeepSpeed's ``engine.destroy()``). The module keeps its (gathered, for ZeRO-3) weights as plain
        tensors only where the strategy can give them back; use the engine no further. A decoupled checkpoint
        still being written is waited for first (published; its error is raised once all is released)."""
        from dsrun.checkpoint import decoupled
        from dsrun.compile.handle import get_deepcompile_handle

        if self.is_deepcompile_active():
            get_deepcompile_handle().cleanup()  # one DeepCompile engine at a time: the handle is this one's
        self._set_deepcompile_active(False)  # the rest of DeepCompile's process-wide state it holds
        if "_config" not in vars(self):  # never initialized (DeepSpeed's tests build one so): nothing else held
            return
        failure: Exception | None = None
        try:
            decoupled.drain()
        except Exception as exc:  # noqa: BLE001 - raised below, after the engine let go of what it holds
            failure = exc
        for holder in filter(None, (self.strategy, self.parameter_offload)):  # ZeRO's strategy, or ZeRO-Inference's
            holder.close()
        self.direct_backward.close()
        self.features.close()
        self.observer.close()
        set_current_groups(None)
        self.groups.destroy()
        if self._python_gc_lease is not None:
            python_gc_manager.release(self._python_gc_lease)
            self._python_gc_lease = None
        if failure is not None:
            raise failure

    def is_deepcompile_active(self) -> bool:
        """DeepSpeed's name: the module runs DeepCompile's graphs (``engine.compile()`` with ``compile.deepcompile``)."""
        return self._deepcompile_active

    def _set_deepcompile_active(self, active: bool) -> None:
        """DeepSpeed's: off gives back what the engine holds of DeepCompile's process-wide state (the frames whose
        backward it awaits, its share of dynamo's settings: :func:`dsrun.compile.init.release_engine_state`)."""
        if not active:
            from dsrun.compile.init import release_engine_state

            release_engine_state(self)
        self._deepcompile_active = active

    def empty_partition_cache(self) -> None:
        """Release the ZeRO-3 parameters kept gathered between uses (persistent or kept for reuse), e.g. at the
        end of training; they are gathered again when next needed. A no-op at stages 0-2."""
        release = getattr(self.strategy or self.parameter_offload, "empty_partition_cache", None)
        if release is not None:
            release()

    @staticmethod
    def _validate_autoep_folding_checkpoint_metadata(state: object, **expected: object) -> None:
        """DeepSpeed's check of a checkpoint's AutoEP-over-AutoTP folding record against the runtime's layout
        (:func:`dsrun.checkpoint.autoep_universal.check_folding_record`)."""
        from dsrun.checkpoint.autoep_universal import check_folding_record

        check_folding_record(state, **expected)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Deprecated name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)


facade(DeepSpeedEngine, "settings", ConfigView)  # engine.train_batch_size() & co.: one-line delegations
facade(DeepSpeedEngine, "data_efficiency_methods", DataEfficiencyMethods)
facade(DeepSpeedEngine, "collectives", Collectives)
facade(DeepSpeedEngine, "methods", EngineMethods)

