"""ZeRO sections: ``zero_optimization`` with its ``offload_param`` / ``offload_optimizer``, and ``aio``.

Defaults follow DeepSpeed's behaviour where it differs from the documentation (config-keys.md §6):

* D4: ``stage3_prefetch_bucket_size`` is 5e7 and ``sub_group_size`` 1e9 (docs: 5e8 and an example 1e12).
* D5: ``overlap_comm`` left unset becomes ``True`` at stage 3 and ``False`` otherwise (docs: ``False``).
* D6: an offload ``device`` left unset is ``"none"`` (no offload) and ``nvme_path`` is ``None`` (docs:
  ``cpu`` and ``/local_nvme``); ``device: nvme`` without ``nvme_path`` is an error (DeepSpeed would fail
  later, when it first swaps).
* D12: ``stage3_param_persistence_threshold`` is 1e5. D13: ``ignore_unused_parameters`` is ``True``.

One default is dsrun's own: ``stage3_allgather_sequential`` left unset is ``false`` (DeepSpeed's: one coalesced
all-gather per fetch) on CUDA, but ``true`` (one per parameter) when ZeRO-3 runs on the CPU, where coalescing
measured no faster over gloo and raised a rank's peak (the flat output and its copy-out; docs/zero3.md). Set,
it acts as written on either device.

DeepSpeed also accepts the stage-3 keys without their ``stage3_`` prefix (``prefetch_bucket_size``...);
:mod:`.migrate` renames them to the documented names, which are the attribute names here.
"""
from __future__ import annotations

import sys
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from dsrun.utils.errors import Problem

from .base import Fraction, NonNegInt, OpenDict, RawValue, Section
from .recent import LeafModuleConfig, ZenFlowConfig

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param``: parameters to CPU or NVMe (ZeRO stage 3 only).

    ``buffer_count``, ``buffer_size`` and ``max_in_cpu`` matter only for NVMe. ``pin_memory`` defaults to True
    as in DeepSpeed since 0.19 (0.14 and the documentation: False); it acts only with a CUDA device.
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: NonNegInt = 5
    buffer_size: NonNegInt = 100_000_000
    max_in_cpu: NonNegInt = 1_000_000_000


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: optimizer state to CPU (stages 1-3) or NVMe (stage 3).

    The optimizer step runs on the CPU whatever the device. ``ratio`` < 1 (partial offload) needs stage 3.
    ``buffer_count`` should be at least the optimizer's states per parameter (Adam: 4). ``pin_memory``: True, as
    for ``offload_param``.
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    ratio: Fraction = 1.0
    buffer_count: NonNegInt = 4
    fast_init: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    super_offload: bool = False
    cpuadam_cores_perc: Fraction = 0.8

    @property
    def pipeline(self) -> bool:
        """Tile-based optimizer step overlaps reads or writes with compute."""
        return self.pipeline_read or self.pipeline_write


ZeroStage = Annotated[int, Field(ge=0, le=3)]


def _none_as_empty(value: RawValue) -> RawValue:
    return {} if value is None else value


class ZeroConfig(Section):
    """``zero_optimization``: the ZeRO stages 0 (off) to 3 and their tuning keys.

    The legacy boolean form (``"zero_optimization": true``) and the deprecated keys ``cpu_offload``,
    ``cpu_offload_param(s)``, ``cpu_offload_use_pin_memory`` and ``stage3_gather_fp16_weights_on_model_save``
    are migrated by :mod:`.migrate` before this model sees them.
    ``grad_hooks`` is documented (stage 1) but has no effect in current DeepSpeed; it is accepted.
    """

    stage: ZeroStage = 0
    allgather_partitions: bool = True
    allgather_bucket_size: NonNegInt = 500_000_000
    overlap_comm: bool | None = None
    reduce_scatter: bool = True
    reduce_bucket_size: NonNegInt = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    contiguous_gradients: bool = True
    load_from_fp32_weights: bool = True
    grad_hooks: bool = True
    round_robin_gradients: bool = False
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    sub_group_size: NonNegInt = 1_000_000_000
    # Always present (device "none" when not configured), so callers can read .device directly; an
    # explicit null (which DeepSpeed accepts) means the same as an absent section.
    offload_param: Annotated[OffloadParamConfig, BeforeValidator(_none_as_empty)] = Field(
        default_factory=OffloadParamConfig)
    offload_optimizer: Annotated[OffloadOptimizerConfig, BeforeValidator(_none_as_empty)] = Field(
        default_factory=OffloadOptimizerConfig)
    stage3_max_live_parameters: NonNegInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_model_persistence_threshold: NonNegInt = sys.maxsize
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_module_granularity_threshold: NonNegInt = 0
    zero_hpz_partition_size: NonNegInt = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: OpenDict | None = None
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    # DeepSpeed 0.15-0.19
    compute_grad_norm: bool = True
    stage3_allgather_sequential: bool | None = None  # unset: false on CUDA, true on the CPU (module docstring)
    parameter_alignment: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    zenflow: ZenFlowConfig | None = None

    @model_validator(mode="after")
    def _dynamic_overlap_comm(self) -> "ZeroConfig":
        # DeepSpeed's behaviour (D5): unset overlap_comm means "on for stage 3 only".
        # Written through __dict__ so the key still counts as unset (to_ds_dict leaves it to DeepSpeed).
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = self.stage == 3
        return self

    @property
    def enabled(self) -> bool:
        return self.stage > 0

    @property
    def offload_optimizer_device(self) -> str:
        return self.offload_optimizer.device

    @property
    def offload_param_device(self) -> str:
        return self.offload_param.device

    # grad_hooks is documented but DeepSpeed's ZeRO model forbids it; it is accepted and not written.
    not_written_keys: ClassVar[frozenset[str]] = frozenset({"grad_hooks"})


class AIOConfig(Section):
    """``aio``: libaio settings for NVMe offload (``block_size`` bytes, queue depth, threads per request)."""

    block_size: NonNegInt = 1_048_576
    queue_depth: NonNegInt = 8
    thread_count: NonNegInt = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


def shard_size_problem(key: str, size: int, data_parallel: int) -> Problem | None:
    """MiCS's ``mics_shard_size`` and hpZ's ``zero_hpz_partition_size`` cut the data-parallel group into groups
    of ``size`` ranks: it must divide it. One rule for the config check and the engine's sharding."""
    if size > 0 and data_parallel % size:
        return Problem(key, f"got {size}; it must divide the data-parallel size {data_parallel}",
                       f"use a divisor of {data_parallel}")
    return None


def shard_problems(zero: ZeroConfig, data_parallel: int, prefix: str = "") -> list[Problem]:
    """:func:`shard_size_problem` for a stage-3 config's MiCS and hpZ sizes at ``data_parallel`` ranks."""
    if int(zero.stage) != 3:
        return []
    sizes = ((f"{prefix}zero_optimization.mics_shard_size", int(zero.mics_shard_size)),
             (f"{prefix}zero_optimization.zero_hpz_partition_size", int(zero.zero_hpz_partition_size)
              if int(zero.zero_hpz_partition_size) > 1 else 0))
    return [p for p in (shard_size_problem(key, size, data_parallel) for key, size in sizes) if p is not None]
