"""DeepSpeed's engine methods beyond the training loop: batch-size changes, ``no_sync()``, explicit gradient
reduction, the process groups, module state dicts, ``compile`` and the small helpers scripts call.

A part of :class:`dsrun.engine.engine.DeepSpeedEngine` (``engine.methods``), which carries each public name
as a one-line delegation (``engine_getters.facade``); the state they read and set (``inside_no_sync_ctxt``, the
strategy, the module) stays the engine's. The work is done by the engine's strategies (:mod:`dsrun.zero.strategies`),
this module only gives it DeepSpeed's names and semantics.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Container, Iterator

import torch

from dsrun import comm
from dsrun.zero.compile_regions import compile_model
from dsrun.zero.fragments import refresh_masters_from_model
from dsrun.zero.partition_params import ParamStatus, is_zero_param, write_shard
from dsrun.zero import partition_params, quantized_shards
from dsrun.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from dsrun.zero.offload_states import offload_engine_states, reload_engine_states

MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000
log = logging.getLogger("dsrun.engine")


class EngineMethods:
    """Methods of DeepSpeed's ``DeepSpeedEngine`` that are not part of forward/backward/step."""

    def __init__(self, engine: Any):
        self._engine = engine

    # --- batch size -------------------------------------------------------------------------------------
    @property
    def _data_replicas(self) -> int:
        """Data-parallel replicas the global batch is split over (a Ulysses sequence group is one)."""
        return self._engine.dp_world_size // self._engine.sequence_parallel_size

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the gradient accumulation steps; the micro-batch stays.
        ``ValueError`` unless ``train_batch_size`` is a multiple of micro-batch x data-parallel size."""
        per_step = self._engine.train_micro_batch_size_per_gpu() * self._data_replicas
        if train_batch_size <= 0 or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size}): must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu x data-parallel size = {per_step}")
        self._engine._config.train_batch_size = int(train_batch_size)
        self._engine._config.gradient_accumulation_steps = int(train_batch_size) // per_step

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size, keeping the accumulation steps: the global batch becomes
        ``micro_batch_size x gradient_accumulation_steps x data-parallel size``. A loader built before keeps
        its batch size (as in DeepSpeed); build a new one with ``deepspeed_io``."""
        if micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): must be a positive integer")
        engine = self._engine
        engine._config.train_batch_size = int(micro_batch_size) * engine.gradient_accumulation_steps() * self._data_replicas
        self._engine._config.train_micro_batch_size_per_gpu = int(micro_batch_size)

    # --- gradient reduction -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A context in which ``backward`` accumulates gradients on this rank only (no reduction, no division
        by the accumulation steps); the next backward outside it, or :meth:`allreduce_gradients`, reduces
        everything accumulated. ZeRO stages 2-3 partition gradients as they are produced, so (as in
        DeepSpeed) it is refused there; ``step()`` inside it is refused too."""
        if self._engine.zero_optimization_partition_gradients():
            raise AssertionError("no_sync context manager is incompatible with gradient partitioning logic of "
                                 f"ZeRO stage {self._engine.zero_optimization_stage()}")
        if self._engine.inside_no_sync_ctxt:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self._engine.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self._engine.inside_no_sync_ctxt = False

    def _reduces_in_backward(self) -> bool:
        """Whether this backward reduces gradients (stages 2-3 always do: they keep only reduced partitions)."""
        return self._engine.zero_optimization_partition_gradients() or not self._engine.inside_no_sync_ctxt

    def allreduce_gradients(self, bucket_size: int = MEMORY_OPT_ALLREDUCE_SIZE) -> None:
        """Reduce the gradients accumulated on each rank since a backward skipped the reduction (inside
        ``no_sync()``, or with ``engine.enable_backward_allreduce = False``), at a gradient-accumulation
        boundary, as DeepSpeed does. A no-op when there is nothing to reduce, and at stages 2-3, which reduce
        during backward. The strategy's buckets (``zero_optimization.reduce_bucket_size``) are used, not
        ``bucket_size``."""
        engine = self._engine
        if engine.strategy is None or not engine._reduction_pending or not engine.is_gradient_accumulation_boundary():
            return
        strategy, switch = engine.strategy, engine.strategy.enable_backward_allreduce
        strategy.enable_backward_allreduce = True  # an explicit call reduces even with the switch off
        try:
            strategy.before_backward(True)
            strategy.after_backward(True)
        finally:
            strategy.enable_backward_allreduce = switch
        engine._reduction_pending = False
        engine.direct_backward.reduced()

    def was_step_applied(self) -> bool:
        """True when the last ``step()`` updated the weights (False between accumulation boundaries and on a
        step skipped for an fp16 overflow)."""
        return self._engine._step_applied

    def clip_fp32_gradients(self) -> torch.Tensor:
        """``clip_grad_norm_`` of the module parameters' ``.grad`` to ``gradient_clipping`` (what DeepSpeed's
        non-ZeRO fp32 path calls). It acts where ``.grad`` holds the reduced gradient (stage 0 after a
        boundary backward); ``step()`` itself clips by the global norm at every stage."""
        params = [p for p in self._engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm=self._engine.gradient_clipping())

    # --- process groups -----------------------------------------------------------------------------------
    @property
    def data_parallel_group(self) -> Any:
        return self._engine.dp_group

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: the client mpu's, except a sequence-parallel mpu's (DeepSpeed counts 1 there: its
        model-parallel getters are the sequence's), else the topology's model axis."""
        from dsrun.sequence.parallel_state_sp import is_sequence_parallel_mpu

        mpu = self._engine.mpu
        if is_sequence_parallel_mpu(mpu):
            return 1
        if mpu is not None and hasattr(mpu, "get_model_parallel_world_size"):
            return int(mpu.get_model_parallel_world_size())
        return self._engine.groups.size("model")

    @property
    def checkpoint_mp_rank(self) -> int:
        """The model-parallel rank in checkpoint names (``mp_rank_XX``): 0 without model parallelism."""
        if self.mp_world_size == 1:
            return 0
        mpu = self._engine.mpu
        if mpu is not None and hasattr(mpu, "get_model_parallel_rank"):
            return int(mpu.get_model_parallel_rank())
        return comm.get_rank(self._engine.groups.model)

    def get_data_parallel_group(self) -> Any:
        """The data-parallel process group ZeRO partitions over (None: the whole world)."""
        return self._engine.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self._engine.dp_world_size

    def get_data_parallel_rank(self) -> int:
        return comm.get_rank(self._engine.dp_group)

    @property
    def dist_backend(self) -> str:
        return comm.get_backend()

    # --- what DeepSpeed keeps as attributes -------------------------------------------------------------

    @property
    def basic_optimizer(self) -> torch.optim.Optimizer | None:
        """The client's (or the config's) optimizer; ZeRO re-points it at the fp32 masters. None without one (then
        ``engine.optimizer`` is ZeRO-Inference's ``DeepSpeedZeRoOffload`` at stage 3, as in DeepSpeed)."""
        strategy = self._engine.strategy
        return strategy.optimizer if strategy is not None else None

    @property
    def param_names(self) -> dict[torch.nn.Parameter, str]:
        return {p: name for name, p in self._engine.module.named_parameters()}

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """With ``sparse_gradients``: the weights of embedding layers (their gradients may be sparse)."""
        if not self._engine.sparse_gradients_enabled():
            return set()
        return {f"{name}.weight" for name, m in self._engine.module.named_modules()
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}

    @property
    def progressive_layer_drop(self) -> Any:
        return self._engine.data_efficiency.progressive_layer_drop

    @property
    def curriculum_scheduler_legacy(self) -> Any:
        return self._engine.data_efficiency.curriculum_scheduler_legacy

    @property
    def random_ltd_scheduler(self) -> Any:
        return getattr(self._engine.data_efficiency, "random_ltd_scheduler", None)

    # the compression feature's parts (None without compression_training / quantize_training)
    @property
    def compression_scheduler(self) -> Any:
        return getattr(getattr(self, "compression", None), "scheduler", None)

    @property
    def quantizer(self) -> Any:
        """MoQ (``quantize_training``), DeepSpeed's ``Quantizer``."""
        return getattr(getattr(self, "compression", None), "moq", None)

    @property
    def eigenvalue(self) -> Any:
        """The Hessian eigenvalue estimator MoQ uses (``eigenvalue.enabled`` with ``quantize_training``)."""
        return getattr(getattr(self, "compression", None), "eigenvalue", None)

    # Ulysses (docs/sequence_parallel.md): ZeRO partitions over data x sequence ranks, the engine's data group
    @property
    def seq_parallel_group(self) -> Any:
        return self._engine.groups.sequence

    def get_sequence_parallel_group(self) -> Any:
        return self._engine.groups.sequence

    @property
    def seq_data_parallel_group(self) -> Any:
        return self._engine.dp_group

    @property
    def seq_dp_world_size(self) -> int:
        return self._engine.dp_world_size

    # --- optimizer ----------------------------------------------------------------------------------------
    def _get_optimizer_param(self, name: str) -> list[Any]:
        return [group.get(name, 0.0) for group in getattr(self.basic_optimizer, "param_groups", ())]

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in getattr(self.basic_optimizer, "param_groups", ())]

    def get_mom(self) -> list[Any]:
        groups = getattr(self.basic_optimizer, "param_groups", ())
        return [group.get("betas", group.get("momentum")) for group in groups]

    def get_type(self) -> list[Any]:
        return self._get_optimizer_param("type")

    def update_optimizer_step(self, step: int) -> None:
        """Set the optimizer's step count (in every param group and every parameter's state) to ``step``."""
        def set_step(holder: dict[str, Any]) -> None:
            old = holder["step"]
            holder["step"] = (torch.tensor(step, dtype=old.dtype, device=old.device) if torch.is_tensor(old)
                              else step)

        optimizer = self.basic_optimizer
        if optimizer is None:
            return
        for group in optimizer.param_groups:
            if "step" in group:
                set_step(group)
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and "step" in state:
                    set_step(state)
        if self._engine.strategy is not None:  # counters kept outside the optimizer (NVMe-swapped sub-groups)
            self._engine.strategy.update_optimizer_step(int(step))

    # --- moving the states off the device between phases (dsrun/zero/offload_states.py) ---------------------
    def offload_states(self, include: Container[OffloadStateTypeEnum] | None = None,
                       device: OffloadDeviceEnum = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Offload the engine's states to the specified device (ZeRO stages 1-3; DeepSpeed's signature).

        Arguments:
            include: Optional. The set of states to offload (``OffloadStateTypeEnum``). If not provided, all
                states are offloaded.
            device: Optional. Where to move them; only ``OffloadDeviceEnum.cpu`` is supported.
            pin_memory: Optional. Whether to pin the memory of the offloaded states (on CUDA).
            non_blocking: Optional. Whether to offload the states asynchronously.

        On a CPU training device the states already live in host memory and stay where they are (logged once);
        only buffers rebuilt on demand are released. Call :meth:`reload_states` before training again."""
        param_offload = self._engine.zero_offload_param()
        offload_engine_states(self._engine.strategy, str(param_offload.device) if param_offload else "none",
                              include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Reload the engine states to the original device (what :meth:`offload_states` moved or released).

        Arguments:
            non_blocking: Optional. Whether to reload the states asynchronously (synchronized before returning)."""
        reload_engine_states(self._engine.strategy, non_blocking=non_blocking)

    # --- module state ---------------------------------------------------------------------------------------
    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """``module.state_dict()`` (under ZeRO-3 parameters are placeholders, as in DeepSpeed; use
        ``dsrun.zero.full_state_dict`` for their values), optionally without frozen parameters."""
        sd = self._engine.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self._engine.module.named_parameters():
                if not p.requires_grad and prefix + name in sd:
                    del sd[prefix + name]
        return sd

    def load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True,
                               custom_load_fn: Callable[..., Any] | None = None, fetch_z3_params: bool = False) -> None:
        """Load ``checkpoint["module"]`` into the module (``custom_load_fn(src=state_dict, dst=module)`` instead
        of ``load_state_dict`` when given); ``fetch_z3_params`` gathers ZeRO-3 parameters around it (rank 0's
        result is kept). ``checkpoint["frozen_param_fragments"]`` (a ZeRO-3 checkpoint of the same world size)
        restores the frozen shards. The fp32 master weights follow the loaded weights, so the next step
        starts from them (DeepSpeed leaves the masters as they were)."""
        from dsrun.zero import GatheredParameters

        # a parameter kept whole (a partition group of one) needs no gather, but the write-back to its master
        fetch = [p for p in self._engine.module.parameters() if fetch_z3_params and is_zero_param(p)
                 and (p.ds_status is ParamStatus.NOT_AVAILABLE or getattr(p, "ds_whole", False))]
        with GatheredParameters(fetch, modifier_rank=0):
            state_dict = checkpoint["module"]
            if custom_load_fn is not None:
                custom_load_fn(src=state_dict, dst=self._engine.module)
            else:
                self._engine.module.load_state_dict(state_dict, strict=strict)
        self._engine.restore_frozen_shards(checkpoint)
        if not self._engine.zero_optimization_partition_weights():  # ZeRO-3: GatheredParameters wrote the masters
            refresh_masters_from_model(self._engine.module)

    def restore_masters_from_model(self) -> None:
        """Set every trained parameter's fp32 master from the model's own (16-bit) weights: what a checkpoint load
        does with ``zero_optimization.load_from_fp32_weights`` false (DeepSpeed's ``_restore_from_bit16_weights``)."""
        refresh_masters_from_model(self._engine.module)

    def restore_frozen_shards(self, checkpoint: dict[str, Any]) -> None:
        """This rank's shards of the frozen parameters from a ZeRO-3 model states file of the same world size:
        ``frozen_param_fragments``, and where this run keeps them INT8 (``zero_quantized_nontrainable_weights``)
        the messages saved as held, restored byte for byte."""
        fragments = checkpoint.get("frozen_param_fragments") or {}
        stored = (checkpoint.get("dsrun") or {}).get("frozen_param_quantized") or {}
        for name, p in self._engine.module.named_parameters():
            if p.requires_grad or name not in fragments:
                continue
            with torch.no_grad():
                if not is_zero_param(p):
                    p.data.copy_(fragments[name].view_as(p.data))
                elif name in stored and quantized_shards.message_of(p) is not None:
                    quantized_shards.set_message(p, stored[name].to(quantized_shards.message_of(p).device))
                    partition_params.mark_stale(p)
                else:
                    write_shard(p, fragments[name].to(device=p.ds_tensor.device, dtype=p.ds_tensor.dtype))

    # --- compile ----------------------------------------------------------------------------------------
    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: list[tuple[int, list[Any]]] | None = None) -> None:
        """``torch.compile`` the module in place (``module.compile(backend=..., **compile_kwargs)``; at ZeRO-3
        each repeated block, with the gather/release hooks outside the graphs: ``dsrun/zero/compile_regions.py``);
        with ``compile.deepcompile`` at ZeRO-3, DeepCompile's passes on ``schedule`` (DeepSpeed's
        ``[(step, [pass names])]``; None: its default) put ZeRO-3 in the graph (``dsrun/compile``); a second call
        does nothing. The config's ``compile`` section (``enabled``, ``backend``, ``kwargs``) calls it at
        initialize. ``compile.passes: ["autotp"]`` compiles an AutoTP-split model as one graph with its
        tensor-parallel collectives in it (:mod:`dsrun.tensor_parallel.compile_pass`)."""
        if self._engine._is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        section = self._engine._config.compile
        if section.autoep_non_moe:
            self._compile_autoep_non_moe(backend, kwargs, schedule)
            return
        passes = section.passes or ()
        if section.deepcompile and {"autotp", "autosp"} <= set(passes):
            from dsrun.utils.errors import ConfigError, Problem

            raise ConfigError(Problem("compile.passes", "'autotp' and 'autosp' together: the two passes do not "
                                      "compose yet (as in DeepSpeed)", "one of them"))
        if section.deepcompile and "autotp" in passes and self._compile_autotp(backend, kwargs):
            return
        if section.deepcompile and "autosp" in passes and self._compile_autosp(backend, kwargs):
            return
        if self._engine._config.compile.deepcompile:
            from dsrun.compile.init import compiles_in_graph, init_z3, log_rank0

            fallback = compiles_in_graph(self._engine.strategy)
            if fallback is None:
                try:
                    init_z3(self._engine, backend, section, kwargs, schedule)
                except BaseException:
                    self._engine._set_deepcompile_active(False)  # what it took of the process-wide state back
                    raise
                self._engine._set_deepcompile_active(True)
                self._engine._is_compiled = True
                return
            log_rank0(f"the torch compiler instead: {fallback}")
        compile_model(self._engine.module, self._engine.strategy, backend, kwargs)
        self._engine._is_compiled = True

    def _compile_autotp(self, backend: str, kwargs: dict[str, Any]) -> bool:
        """The AutoTP compile pass (DeepSpeed's ``get_autotp_backend``): False (the torch compiler then) without
        tensor parallelism."""
        from dsrun.compile.init import log_rank0
        from dsrun.tensor_parallel.compile_pass import init_autotp
        from dsrun.utils.errors import ConfigError, Problem

        if self._engine.autotp_size() <= 1:
            log_rank0("the AutoTP compile pass needs tensor_parallel.autotp_size > 1: the torch compiler instead")
            return False
        if self._engine.zero_optimization_stage() == 3:
            raise ConfigError(Problem("compile.passes", "'autotp' at ZeRO stage 3: its gathers are module hooks, "
                                      "which a full graph cannot hold", "ZeRO stage 0-2, or drop 'autotp'"))
        self._engine.module.compile(backend=init_autotp(self._engine.module, backend), **{**kwargs, "fullgraph": True})
        self._engine._set_deepcompile_active(True)
        self._engine._is_compiled = True
        return True

    def _compile_autoep_non_moe(self, backend: str, kwargs: dict[str, Any], schedule: list | None) -> None:
        """``compile.autoep_non_moe``: the blocks around the AutoEP layers compiled, the layers eager
        (:mod:`dsrun.autoep.regional_compile`); refused, naming why, where DeepSpeed refuses it."""
        from dsrun.autoep.regional_compile import compile_autoep_non_moe_regions
        from dsrun.utils.errors import ConfigError, Problem

        engine = self._engine
        offloaded = engine.zero_offload_optimizer() is not None or engine.zero_offload_param() is not None
        for bad, why in ((engine._config.compile.deepcompile, "uses the torch compiler: not with compile.deepcompile"),
                         (engine.autotp_size() > 1, "does not support AutoEP folded over AutoTP yet"),
                         (int(engine._config.sequence_parallel_size) > 1, "does not support sequence parallelism yet"),
                         (engine.pipeline_parallelism, "does not support pipeline parallelism yet"),
                         (engine.zero_optimization_partition_weights(), "does not support ZeRO stage 3 yet"),
                         (offloaded, "does not support optimizer or parameter offload yet"),
                         (schedule is not None, "does not take a DeepCompile schedule")):
            if bad:
                raise ConfigError(Problem("compile.autoep_non_moe", why, "set compile.autoep_non_moe to false"))
        regions = compile_autoep_non_moe_regions(engine.module, backend, kwargs)
        from dsrun.compile.init import log_rank0

        log_rank0(f"AutoEP regional compile: {len(regions)} modules around the AutoEP layers, backend {backend}")
        engine._is_compiled = True

    def _compile_autosp(self, backend: str, kwargs: dict[str, Any]) -> bool:
        """The AutoSP pass (DeepSpeed's ``get_autosp_backend``: :mod:`dsrun.compile.autosp`): the model compiled
        as one graph that splits the sequence over ``sequence_parallel_size`` ranks; False (the torch compiler
        then, with a log line) at ZeRO stage 2-3, as DeepSpeed."""
        from dsrun.compile.autosp import init_autosp
        from dsrun.compile.init import log_rank0
        from dsrun.compile.sp_mesh import extract_mesh_size

        if self._engine.zero_optimization_stage() >= 2:
            log_rank0("AutoSP does not compose with ZeRO stage 2 and 3: the torch compiler instead")
            return False
        sp_size, dp_size = extract_mesh_size({"sequence_parallel_size": self._engine._config.sequence_parallel_size})
        debug = bool(self._engine._config.compile.debug_log)
        self._engine.module.compile(backend=init_autosp(sp_size, dp_size, backend, debug),
                                    **{**kwargs, "fullgraph": True})
        self._engine._set_deepcompile_active(True)
        self._engine._is_compiled = True
        return True

    def is_deepcompile_enabled(self) -> bool:
        """DeepSpeed's name: ``compile.deepcompile`` is set."""
        return bool(self._engine._config.compile.deepcompile)

    @property
    def is_compiled(self) -> bool:
        return self._engine._is_compiled

    def _apply_compile_config(self) -> None:
        section = self._engine._config.compile
        if section.enabled:
            self._engine.compile(backend=section.backend, compile_kwargs=dict(section.kwargs))

    # --- small helpers ------------------------------------------------------------------------------------
    @staticmethod
    def collect_python_gc() -> int:
        """Collect Python's reference cycles now (with ``disable_python_gc`` automatic collection is off: call
        this at a step every rank reaches, e.g. every N steps); returns what ``gc.collect()`` found."""
        from dsrun.utils.python_gc import python_gc_manager

        return python_gc_manager.collect()

    def print_forward_breakdown(self, fwd_time: float) -> None:
        """Rank 0 prints ``fwd_time`` (ms) and the MoE layers' share of the last forward: the layers, their first
        and second all-to-all and their gates' top-k, in ms, summed over layers (recorded with
        ``wall_clock_breakdown``; zero without it or without MoE layers)."""
        engine = self._engine
        gate = sum(g.gate_time for g in engine.gate_modules)
        moe = sum(m.time_moe for m in engine.moe_layers)
        first = sum(m.time_falltoall for m in engine.moe_layers)
        second = sum(m.time_salltoall for m in engine.moe_layers)
        if self._engine.global_rank == 0:
            print(f"[dsrun] time (ms) | fwd: {fwd_time:.2f} (fwd_moe: {moe:.2f}, 1st_a2a: {first:.2f}, "
                  f"2nd_a2a: {second:.2f}, top_k: {gate:.2f})", flush=True)

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)
