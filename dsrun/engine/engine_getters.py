"""DeepSpeed's config getters (``engine.zero_optimization()``, ``engine.fp16_enabled()`` …) as a typed view.

:class:`ConfigView` reads the typed config (:class:`dsrun.config.DSConfig`) and returns what DeepSpeed
0.14's getter of the same name returns for the same config; the few that report on live state (the precision in
use, the strategy's communication dtype, the client optimizer) ask the engine. The engine holds one
(``engine.settings``) and carries every public name of it as a one-line delegation (:func:`facade`), so DeepSpeed
scripts call ``engine.train_batch_size()`` as before. The data-efficiency getters live with their feature
(:mod:`dsrun.data_efficiency.engine_api`).
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _dtype_name(value: torch.dtype | str) -> str:
    """``torch.float16`` / ``"fp16"`` / ``"FP16"`` -> ``"fp16"`` (the config's spelling)."""
    for name, dtype in _DTYPES.items():
        if value is dtype or str(value).lower() == name:
            return name
    raise ValueError(f"communication_data_type: got {value!r}; allowed: torch.float16, torch.bfloat16, "
                     "torch.float32 (or 'fp16', 'bf16', 'fp32')")


if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.precision.strategy import PrecisionStrategy


def facade(engine_cls: type, attr: str, part: type) -> None:
    """Give ``engine_cls`` every public method and property of ``part`` that it does not define itself, as a
    one-line delegation to ``self.<attr>`` (same name, signature and docstring); static methods are shared."""
    for name, member in vars(part).items():
        if name.startswith("_") or name in vars(engine_cls):
            continue
        if isinstance(member, staticmethod):
            setattr(engine_cls, name, member)
        elif isinstance(member, property):
            setattr(engine_cls, name, _delegated_property(attr, name, member))
        elif callable(member):
            setattr(engine_cls, name, _delegated_method(attr, name, member))


def _delegated_method(attr: str, name: str, member: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(member)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        part = getattr(self, attr, None)
        if part is None:  # called unbound on a stand-in holding the part's own state (DeepSpeed's `_config`)
            return member(self, *args, **kwargs)
        return getattr(part, name)(*args, **kwargs)
    return method


def _delegated_property(attr: str, name: str, member: property) -> property:
    def fget(self: Any) -> Any:
        return getattr(getattr(self, attr), name)

    def fset(self: Any, value: Any) -> None:
        setattr(getattr(self, attr), name, value)

    return property(fget, fset if member.fset is not None else None, doc=member.__doc__)


class _Strategy(Protocol):
    comm_dtype: torch.dtype


class _Engine(Protocol):
    """The live state a few getters report: the precision, the strategy's reduction dtype, the rank."""

    precision: "PrecisionStrategy"
    strategy: _Strategy | None
    global_rank: int


class ConfigView:
    """The config getters of DeepSpeed's ``DeepSpeedEngine``, with its names and return values, over one
    typed config; ``engine`` answers the few that report live state."""

    def __init__(self, config: "DSConfig", engine: _Engine):
        self._config = config
        self._engine = engine

    # --- batch ----------------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return int(self._config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self._config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self._config.gradient_accumulation_steps)

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` (DeepSpeed 0.14
        returns the three bound methods by mistake; dsrun returns their values)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def dataloader_drop_last(self) -> bool:
        return bool(self._config.dataloader_drop_last)

    # --- logging and profiling ------------------------------------------------------------------------
    def steps_per_print(self) -> int | None:
        """None (the default, as in DeepSpeed 0.19): no progress line; the wall-clock means come every step."""
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self._config.wall_clock_breakdown)

    def dump_state(self) -> bool:
        return bool(self._config.dump_state)

    def log_level(self) -> str | None:
        return self._config.log_level

    def flops_profiler_enabled(self) -> bool:
        return bool(self._config.flops_profiler.enabled or self.autotuning_enabled())

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return float(self._config.flops_profiler.recompute_fwd_factor)

    def flops_profiler_profile_step(self) -> int:
        if self.autotuning_enabled():
            return self.autotuning_start_profile_step()
        return int(self._config.flops_profiler.profile_step)

    def flops_profiler_module_depth(self) -> int:
        return int(self._config.flops_profiler.module_depth)

    def flops_profiler_top_modules(self) -> int:
        return int(self._config.flops_profiler.top_modules)

    def flops_profiler_detailed(self) -> bool:
        return False if self.autotuning_enabled() else bool(self._config.flops_profiler.detailed)

    def flops_profiler_output_file(self) -> str | None:
        return self._config.flops_profiler.output_file

    # --- autotuning -----------------------------------------------------------------------------------
    def autotuning_enabled(self) -> bool:
        return bool(self._config.autotuning.enabled)

    def autotuning_start_profile_step(self) -> int:
        return int(self._config.autotuning.start_profile_step)

    def autotuning_end_profile_step(self) -> int:
        return int(self._config.autotuning.end_profile_step)

    def autotuning_metric_path(self) -> str:
        return self._config.autotuning.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        return self._config.autotuning.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def autotuning_metric(self) -> str:
        return str(self._config.autotuning.metric)

    def autotuning_profile_model_info(self) -> bool:
        info = self._config.autotuning.model_info
        return bool(self.autotuning_enabled() and info is not None and info.profile)

    # --- optimizer and scheduler ----------------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's ``optimizer.type``."""
        client = getattr(self._engine, "client_optimizer", None)
        if client is not None:
            return type(client).__name__
        return self._config.optimizer.name

    def optimizer_params(self) -> dict[str, Any] | None:
        return dict(self._config.optimizer.params) if self._config.optimizer.type else None

    def optimizer_legacy_fusion(self) -> bool:
        return bool(self._config.optimizer.legacy_fusion)

    def scheduler_name(self) -> str | None:
        return self._config.scheduler.type

    def scheduler_params(self) -> dict[str, Any] | None:
        return dict(self._config.scheduler.params) if self._config.scheduler.type else None

    def quantize_training(self) -> tuple[Any, ...]:
        """DeepSpeed's 9-tuple from ``compression_training.weight_quantization.shared_parameters``:
        (quantize_weight_in_forward, enabled, quantize_groups, fp16_mixed_quantize, quantize_change_ratio,
        quantization_type, rounding, quantize_verbose, quantizer_kernel)."""
        wq = self._config.compression_training.weight_quantization.shared_parameters
        return (wq.quantize_weight_in_forward, wq.enabled, wq.quantize_groups, wq.fp16_mixed_quantize.enabled,
                wq.fp16_mixed_quantize.quantize_change_ratio, wq.quantization_type, wq.rounding,
                wq.quantize_verbose, wq.quantizer_kernel)

    def sparse_gradients_enabled(self) -> bool:
        return bool(self._config.sparse_gradients)

    def gradient_clipping(self) -> float:
        return float(self._config.gradient_clipping or 0.0)

    def graph_harvesting(self) -> bool:
        return bool(self._config.graph_harvesting)

    # --- gradient reduction -----------------------------------------------------------------------------
    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's ``communication_data_type``, else the model's."""
        return _DTYPES[self._config.resolved_communication_data_type]

    @communication_data_type.setter
    def communication_data_type(self, value: torch.dtype | str) -> None:
        name = _dtype_name(value)
        self._config.communication_data_type = name
        if self._engine.strategy is not None:  # the strategy reduces in it from the next bucket on
            self._engine.strategy.comm_dtype = _DTYPES[name]

    def postscale_gradients(self) -> bool:
        return not bool(self._config.prescale_gradients)

    def gradient_predivide_factor(self) -> float:
        return float(self._config.gradient_predivide_factor)

    # --- ZeRO -------------------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        """True when a ZeRO stage >= 1 is on."""
        return bool(self._config.zero_enabled)

    def zero_optimization_stage(self) -> int:
        return int(self._config.zero_optimization.stage)

    def autotp_size(self) -> int:
        """The AutoTP degree: the ranks the model is split over (``tensor_parallel.autotp_size``, or what
        ``tp_model_init`` recorded; the config's value, 0 by default, when nothing is split)."""
        live = self._engine.groups.size("model")
        return live if live > 1 else int(self._config.tensor_parallel.autotp_size)

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_allow_untested_optimizer(self) -> bool:
        return bool(self._config.zero_allow_untested_optimizer)

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return bool(self._config.zero_force_ds_cpu_optimizer)

    def _zc(self) -> Any:
        return self._config.zero_optimization

    def zero_reduce_scatter(self) -> bool:
        return bool(self._zc().reduce_scatter)

    def zero_overlap_comm(self) -> bool:
        return bool(self._zc().overlap_comm)

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` section, or None when the optimizer is not offloaded."""
        section = self._zc().offload_optimizer
        return section if section.device != "none" else None

    def zero_offload_param(self) -> Any:
        """The ``offload_param`` section, or None when parameters are not offloaded."""
        section = self._zc().offload_param
        return section if section.device != "none" else None

    def zero_use_cpu_optimizer(self) -> bool:
        return self._zc().offload_optimizer.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        return self._zc().offload_optimizer.device == "cpu"

    def zero_partial_offload(self) -> float:
        return float(self._zc().offload_optimizer.ratio)

    def super_offload(self) -> bool:
        """``offload_optimizer.super_offload`` (DeepSpeed's getter): NVMe sub-groups stepped during backward."""
        return bool(self._zc().offload_optimizer.super_offload)

    def zero_has_nvme_offload(self) -> bool:
        return "nvme" in (self._zc().offload_optimizer.device, self._zc().offload_param.device)

    def zero_sub_group_size(self) -> int:
        return int(self._zc().sub_group_size)

    def mics_shard_size(self) -> int:
        return int(self._zc().mics_shard_size)

    def is_first_weights_partition_group(self) -> bool:
        shard = self.mics_shard_size()
        if shard > 0:
            return self._engine.global_rank < shard
        return self.zero_optimization_partition_weights()

    def zero_reduce_bucket_size(self) -> int:
        return int(self._zc().reduce_bucket_size)

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return bool(self._zc().use_multi_rank_bucket_allreduce)

    def zero_allgather_bucket_size(self) -> int:
        return int(self._zc().allgather_bucket_size)

    def zero_allgather_partitions(self) -> bool:
        return bool(self._zc().allgather_partitions)

    def zero_contiguous_gradients(self) -> bool:
        return bool(self._zc().contiguous_gradients)

    def zero_load_from_fp32_weights(self) -> bool:
        return bool(self._zc().load_from_fp32_weights)

    def zero_elastic_checkpoint(self) -> bool:
        return bool(self._zc().elastic_checkpoint)

    def zero_max_live_parameters(self) -> int:
        return int(self._zc().stage3_max_live_parameters)

    def zero_max_reuse_distance(self) -> int:
        return int(self._zc().stage3_max_reuse_distance)

    def zero_prefetch_bucket_size(self) -> int:
        return int(self._zc().stage3_prefetch_bucket_size)

    def zero_param_persistence_threshold(self) -> int:
        return int(self._zc().stage3_param_persistence_threshold)

    def zero_model_persistence_threshold(self) -> int:
        return int(self._zc().stage3_model_persistence_threshold)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._zc().stage3_gather_16bit_weights_on_model_save)

    def zero_grad_hooks(self) -> bool:
        return bool(self._zc().grad_hooks)

    def zero_legacy_stage1(self) -> bool:
        return bool(self._zc().legacy_stage1)

    def zero_ignore_unused_parameters(self) -> bool:
        return bool(self._zc().ignore_unused_parameters)

    def zero_round_robin_gradients(self) -> bool:
        return bool(self._zc().round_robin_gradients)

    def zero_parameter_alignment(self) -> bool:
        return bool(self._zc().parameter_alignment)

    def zero_hpz_partition_size(self) -> int:
        return int(self._zc().zero_hpz_partition_size)

    def zero_quantized_weights(self) -> bool:
        return bool(self._zc().zero_quantized_weights)

    def zero_quantized_nontrainable_weights(self) -> bool:
        return bool(self._zc().zero_quantized_nontrainable_weights)

    def zero_quantized_gradients(self) -> bool:
        return bool(self._zc().zero_quantized_gradients)

    def aio_config(self) -> dict[str, Any]:
        return self._config.aio.model_dump()

    # --- precision --------------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self._engine.precision.name == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self._engine.precision.name == "bf16"

    def amp_enabled(self) -> bool:
        return bool(self._config.amp.enabled)

    def amp_params(self) -> dict[str, Any] | bool:
        """The ``amp`` section without ``enabled`` (False when there is none, as DeepSpeed returns)."""
        return self._config.amp.params if "amp" in self._config.model_fields_set else False

    def fp16_master_weights_and_gradients(self) -> bool:
        return bool(self.fp16_enabled() and self._config.fp16.fp16_master_weights_and_grads)

    def fp16_auto_cast(self) -> bool | None:
        return bool(self._config.fp16.auto_cast) if self.fp16_enabled() else None

    def torch_autocast_enabled(self) -> bool:
        return bool(self._config.torch_autocast.enabled)

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """``torch_autocast.dtype`` as a torch dtype (None: the device's autocast default)."""
        name = self._config.torch_autocast.dtype
        return None if name is None else _DTYPES[name]

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        from dsrun.precision.torch_autocast import get_default_autocast_lower_precision_modules
        names = self._config.torch_autocast.lower_precision_safe_modules
        return get_default_autocast_lower_precision_modules() if names is None else list(names)

    def loss_scale(self) -> float:
        """The configured static loss scale (``fp16.loss_scale``; 0 = dynamic; 1.0 with bf16). The scale in
        use now is :attr:`cur_scale`."""
        if self.fp16_enabled():
            return float(self._config.fp16.loss_scale)
        return 1.0 if self.bfloat16_enabled() else 0.0

    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale() == 0

    def initial_dynamic_scale(self) -> float:
        if self.fp16_enabled():
            return float(2 ** self._config.fp16.initial_scale_power)
        return 1.0 if self.bfloat16_enabled() else float(2 ** 16)

    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        """DeepSpeed's dynamic scaler arguments when the fp16 section sets any of them, else None."""
        fp16 = self._config.fp16
        keys = {"initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis", "consecutive_hysteresis"}
        if not self.fp16_enabled() or not keys & fp16.model_fields_set:
            return None
        return {"init_scale": 2 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)``."""
        return self._engine.precision.model_dtype, _DTYPES[self._config.resolved_grad_accum_dtype]

    # --- checkpoints ------------------------------------------------------------------------------------
    def checkpoint_tag_validation_enabled(self) -> bool:
        return str(self._config.checkpoint.tag_validation) != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return str(self._config.checkpoint.tag_validation) == "Fail"

    def use_node_local_storage(self) -> bool:
        return bool(self._config.checkpoint.use_node_local_storage)

    def load_universal_checkpoint(self) -> bool:
        return bool(self._config.checkpoint.load_universal)

    # --- elasticity and eigenvalue --------------------------------------------------------------------
    def elasticity_enabled(self) -> bool:
        return bool(self._config.elasticity.enabled)

    def is_elastic_model_parallel_supported(self) -> bool | None:
        """With elasticity on: whether ``num_gpus_per_node`` is a multiple of ``model_parallel_size``."""
        if not self.elasticity_enabled():
            return None
        el = self._config.elasticity
        return el.num_gpus_per_node % el.model_parallel_size == 0

    def eigenvalue_enabled(self) -> bool:
        return bool(self._config.eigenvalue.enabled)

    def eigenvalue_verbose(self) -> bool:
        return bool(self._config.eigenvalue.verbose)

    def eigenvalue_max_iter(self) -> int:
        return int(self._config.eigenvalue.max_iter)

    def eigenvalue_tol(self) -> float:
        return float(self._config.eigenvalue.tol)

    def eigenvalue_stability(self) -> float:
        return float(self._config.eigenvalue.stability)

    def eigenvalue_gas_boundary_resolution(self) -> int:
        return int(self._config.eigenvalue.gas_boundary_resolution)

    def eigenvalue_layer_name(self) -> str:
        return str(self._config.eigenvalue.layer_name)

    def eigenvalue_layer_num(self) -> int:
        return int(self._config.eigenvalue.layer_num)
