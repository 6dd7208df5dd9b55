"""The top-level DeepSpeed config model: batch keys, communication keys, logging keys and every section.

Attribute names are exactly DeepSpeed's keys. After :func:`dsrun.config.load_ds_config` the three batch
numbers are resolved ints and :attr:`DSConfig.batch_explanation` says where each came from.

Defaults that follow DeepSpeed's behaviour rather than the documentation (config-keys.md §6; the list, with
the reasons, is docs/config.md "Defaults that follow today's DeepSpeed"):

* D1: ``gradient_clipping`` defaults to 1.0, as documented and as DeepSpeed does since 0.19 (0.14 did not clip);
  0.0 turns clipping off.
* D2: ``communication_data_type`` is a string ``fp16``/``bf16``/``fp32`` (case-insensitive), not a bool;
  None means "follow the precision mode" (:attr:`DSConfig.resolved_communication_data_type`).
* ``wall_clock_breakdown`` reads True whenever ``flops_profiler.enabled`` is, as DeepSpeed's getter does.
* ``steps_per_print`` defaults to None as in DeepSpeed 0.19 (0.14: 10): no ``step=`` progress line.
"""
from __future__ import annotations

import math
import sys
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, model_validator

from .base import DTypeName, NonNegFloat, PosInt, RawValue, Section, lower_text
from .misc import (
    ActivationCheckpointingConfig,
    AutotuningConfig,
    CheckpointConfig,
    CompileConfig,
    EigenvalueConfig,
    ElasticitySection,
    HybridEngineConfig,
    NebulaConfig,
    PipelineConfig,
    QuantizeTrainingConfig,
    SparseAttentionConfig,
    TimersConfig,
    WeightQuantConfig,
)
from .compression import CompressionConfig
from .data_efficiency import CurriculumLearningConfig, DataEfficiencyConfig, ProgressiveLayerDropConfig
from .monitoring import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    MLflowConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .optim import OptimizerConfig, SchedulerConfig
from .precision import AMPConfig, BF16Config, DataTypesConfig, FP16Config
from .recent import TensorParallelConfig, TorchAutocastConfig
from .zero import AIOConfig, ZeroConfig


def _section(model: type[Section]) -> Any:
    return Field(default_factory=model)


def _allreduce_op_name(value: str) -> str:
    """``mean`` or ``sum`` (DeepSpeed's words for a bad one: "Invalid gradient_allreduce_op")."""
    if value not in ("mean", "sum"):
        raise ValueError("Invalid gradient_allreduce_op: expected 'mean' or 'sum'")
    return value


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _logging_level_name(value: str | None) -> str | None:
    """A logging level's name in any case, kept as written."""
    if value is not None and value.lower() not in _LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(_LOG_LEVELS)} (in any case)")
    return value


def _never_as_max_steps(value: RawValue) -> RawValue:
    return sys.maxsize if isinstance(value, float) and value == math.inf else value


class DSConfig(Section):
    """A whole DeepSpeed config: one typed model per section; unknown keys are errors at every level.

    Undocumented keys DeepSpeed reads are accepted with DeepSpeed's defaults (``zero_allow_untested_optimizer``,
    ``zero_force_ds_cpu_optimizer``, ``memory_breakdown``, ``disable_allgather``, ``dataloader_drop_last``,
    ``vocabulary_size``, ``seq_parallel_comm_data_type``, ``graph_harvesting``,
    ``use_data_before_expert_parallelism``, and the sections ``eigenvalue``, ``progressive_layer_drop``,
    ``pipeline``, ``quantize_training``, ``hybrid_engine``, ``compile``, ``timers``, ``nebula``, ``weight_quantization``;
    the last is None unless the config has it, like ``sparse_attention``).
    ``mlflow`` is dsrun's own monitor section and ``dsrun_allow_unimplemented`` dsrun's own key; both are left
    out of :meth:`to_ds_dict` unless set (DeepSpeed ignores unknown top-level keys).
    """

    # batch (resolved by load_ds_config)
    train_batch_size: PosInt | None = None
    train_micro_batch_size_per_gpu: PosInt | None = None
    gradient_accumulation_steps: PosInt | None = None
    # Ulysses: ranks sharing one sample's sequence; the batch counts world / sequence_parallel_size replicas
    sequence_parallel_size: PosInt = 1
    # DeepSpeed's data x sequence mesh: with sequence_parallel_size, the data-parallel replicas (world / sp)
    data_parallel_size: PosInt | None = None

    # Always present (type None when the config has no such section), so callers can read .type/.params.
    optimizer: OptimizerConfig = _section(OptimizerConfig)
    scheduler: SchedulerConfig = _section(SchedulerConfig)

    # communication
    communication_data_type: DTypeName | None = None
    seq_parallel_comm_data_type: DTypeName = "fp32"
    prescale_gradients: bool = False
    gradient_predivide_factor: NonNegFloat = 1.0
    sparse_gradients: bool = False
    disable_allgather: bool = False
    gradient_allreduce_op: Annotated[str, BeforeValidator(lower_text), AfterValidator(_allreduce_op_name)] = "mean"

    # precision
    fp16: FP16Config = _section(FP16Config)
    bf16: BF16Config = _section(BF16Config)
    amp: AMPConfig = _section(AMPConfig)
    data_types: DataTypesConfig = _section(DataTypesConfig)
    torch_autocast: TorchAutocastConfig = _section(TorchAutocastConfig)
    gradient_clipping: NonNegFloat = 1.0

    # ZeRO
    zero_optimization: ZeroConfig = _section(ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    aio: AIOConfig = _section(AIOConfig)

    # logging
    # Hugging Face's accelerate passes float("inf") (never print); it becomes the largest step count.
    # None (DeepSpeed 0.19's default; 0.14: 10): no progress line, wall-clock means every step
    steps_per_print: Annotated[PosInt | None, BeforeValidator(_never_as_max_steps)] = None
    wall_clock_breakdown: bool = False
    dump_state: bool = False
    memory_breakdown: bool = False
    # kept as written ("ERROR"): DeepSpeed's engine.log_level() returns it so; compared case-insensitively
    log_level: Annotated[str | None, AfterValidator(_logging_level_name)] = None

    # monitors and profilers
    tensorboard: TensorBoardConfig = _section(TensorBoardConfig)
    wandb: WandbConfig = _section(WandbConfig)
    comet: CometConfig = _section(CometConfig)
    csv_monitor: CSVMonitorConfig = _section(CSVMonitorConfig)
    mlflow: MLflowConfig = _section(MLflowConfig)
    comms_logger: CommsLoggerConfig = _section(CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = _section(FlopsProfilerConfig)

    # training techniques
    activation_checkpointing: ActivationCheckpointingConfig = _section(ActivationCheckpointingConfig)
    sparse_attention: SparseAttentionConfig | None = None
    data_efficiency: DataEfficiencyConfig = _section(DataEfficiencyConfig)
    curriculum_learning: CurriculumLearningConfig = _section(CurriculumLearningConfig)
    progressive_layer_drop: ProgressiveLayerDropConfig = _section(ProgressiveLayerDropConfig)
    compression_training: CompressionConfig = _section(CompressionConfig)
    eigenvalue: EigenvalueConfig = _section(EigenvalueConfig)
    quantize_training: QuantizeTrainingConfig = _section(QuantizeTrainingConfig)

    # tooling
    autotuning: AutotuningConfig = _section(AutotuningConfig)
    elasticity: ElasticitySection = _section(ElasticitySection)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    pipeline: PipelineConfig = _section(PipelineConfig)
    hybrid_engine: HybridEngineConfig = _section(HybridEngineConfig)
    compile: CompileConfig = _section(CompileConfig)
    timers: TimersConfig = _section(TimersConfig)
    nebula: NebulaConfig = _section(NebulaConfig)
    weight_quantization: WeightQuantConfig | None = None
    dataloader_drop_last: bool = False
    vocabulary_size: PosInt | None = None
    graph_harvesting: bool = False
    use_data_before_expert_parallelism: bool = False
    # DeepSpeed 0.15-0.19 keys (dsrun/config/recent.py; the ledger says which act)
    managed_gradient_accumulation: bool = True
    disable_python_gc: bool = False
    tensor_parallel: TensorParallelConfig = _section(TensorParallelConfig)
    expert_parallel: dict[str, Any] | None = None
    datastates_ckpt: dict[str, Any] | bool | None = None
    # dsrun's own: run a config that enables not-implemented features, with a warning line per key
    dsrun_allow_unimplemented: bool = False

    _batch_explanation: str = PrivateAttr(default="")
    _world_size: int = PrivateAttr(default=1)
    _world_size_source: str = PrivateAttr(default="default")
    _warnings: list[str] = PrivateAttr(default_factory=list)
    _unimplemented: list[tuple[str, str]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _profiler_implies_timing(self) -> "DSConfig":
        # DeepSpeed's wall_clock_breakdown() is "wall_clock_breakdown or flops_profiler.enabled".
        if self.flops_profiler.enabled and not self.wall_clock_breakdown:
            self.__dict__["wall_clock_breakdown"] = True
        return self

    def __eq__(self, other: object) -> bool:
        # Equal when every setting is equal; how the batch numbers were found (the explanation) and the
        # load notes do not count, so a config equals the one loaded back from its to_ds_dict().
        if not isinstance(other, DSConfig):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    # --- derived values ----------------------------------------------------------------------------

    @property
    def batch_explanation(self) -> str:
        """Where each batch number came from, with the world size and its source."""
        return self._batch_explanation

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def world_size_source(self) -> str:
        return self._world_size_source

    @property
    def warnings(self) -> list[str]:
        """Texts of the migration warnings raised while loading this config."""
        return list(self._warnings)

    @property
    def unimplemented(self) -> list[str]:
        """Key paths this config enables that dsrun does not implement (non-empty only when
        ``dsrun_allow_unimplemented`` let it load; see :mod:`dsrun.config.support`)."""
        return [path for path, _ in self._unimplemented]

    @property
    def unimplemented_warnings(self) -> list[str]:
        """One ``warning: ...`` line per :attr:`unimplemented` key (:func:`dsrun.config.announce` prints them)."""
        return [line for _, line in self._unimplemented]

    @property
    def precision(self) -> str:
        """``fp16``, ``bf16``, ``amp`` or ``fp32``: the single precision mode the rules allow."""
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        if self.amp.enabled:
            return "amp"
        return "fp32"

    @property
    def resolved_communication_data_type(self) -> str:
        """``communication_data_type``, or DeepSpeed's choice when unset: the precision's dtype."""
        if self.communication_data_type is not None:
            return self.communication_data_type
        return {"fp16": "fp16", "bf16": "bf16"}.get(self.precision, "fp32")

    @property
    def resolved_grad_accum_dtype(self) -> str:
        """``data_types.grad_accum_dtype``, or DeepSpeed's choice: fp32 for bf16 without ZeRO, else the
        model dtype."""
        if self.data_types.grad_accum_dtype is not None:
            return self.data_types.grad_accum_dtype
        if self.precision == "bf16" and not self.zero_optimization.enabled:
            return "fp32"
        return {"fp16": "fp16", "bf16": "bf16"}.get(self.precision, "fp32")

    @property
    def native_grad_accum_dtype(self) -> str:
        """The dtype dsrun accumulates gradients in over micro-steps when ``data_types.grad_accum_dtype`` is unset:
        the model's at stages 0-1 (autograd adds into the flat ``.grad`` buffers), the masters' at stages 2-3 (the
        partition accumulators: fp32, or bf16 with bf16 master state). A set key that names another dtype makes
        the ZeRO strategy accumulate in that one (``dsrun/zero/grad_accum.py``, docs/precision.md)."""
        stage = self.zero_optimization.stage
        if self.bf16.enabled and self.bf16.bf16_master_weights_and_grads and stage >= 1:
            return "bf16"
        if stage >= 2:
            return "fp32"
        return {"fp16": "fp16", "bf16": "bf16"}.get(self.precision, "fp32")

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization.stage > 0

    def to_ds_dict(self) -> dict[str, Any]:
        """The resolved DeepSpeed JSON: batch triad filled, legacy keys migrated, "auto" resolved or dropped.

        Keys the user did not set are left to DeepSpeed's defaults (which dsrun's match). dsrun's own
        ``mlflow`` section is written only when set; DeepSpeed ignores unknown top-level keys.
        With elasticity enabled (and ``ignore_non_elastic_batch_info`` false) the batch keys are left out:
        DeepSpeed refuses them there and computes the same numbers from the ``elasticity`` section.
        """
        out = super().to_ds_dict()
        if self.elasticity.enabled and not self.elasticity.ignore_non_elastic_batch_info:
            for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
                out.pop(key, None)
        return out
