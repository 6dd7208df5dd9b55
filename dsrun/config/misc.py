"""The remaining sections: ``activation_checkpointing``, ``sparse_attention``, ``autotuning``,
``elasticity``, ``checkpoint``, ``eigenvalue``, ``pipeline`` and the undocumented ``hybrid_engine``,
``compile``, ``timers`` and ``nebula``.

Defaults that follow DeepSpeed rather than the documentation (config-keys.md §6):

* D7: ``autotuning.overwrite`` is True, ``tuner_type`` ``gridsearch`` and ``metric`` values are lower
  case (``flops``); the names are accepted in any case and stored lower-cased.
* D9: ``elasticity.prefer_larger_batch`` is the key DeepSpeed reads (see :mod:`.migrate` for the
  documented spelling).
* D11: ``sparse_attention.num_different_global_patterns`` defaults to 1.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from dsrun.utils.errors import Problem

from .base import NonNegFloat, NonNegInt, OpenDict, PosInt, RawValue, Section, lower_text
from .recent import CheckpointWriterConfig


def _capitalise(value: RawValue) -> RawValue:
    return value.capitalize() if isinstance(value, str) else value


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing`` (what ``dsrun.checkpointing`` does with each key:
    docs/activation_checkpointing.md). ``number_checkpoints`` sizes the buffer of
    ``contiguous_memory_optimization``, which holds partitioned activations."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: PosInt | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def problems(self, prefix: str = "activation_checkpointing") -> list[Problem]:
        """What DeepSpeed refuses (an assertion in its ``configure``)."""
        found = []
        if self.contiguous_memory_optimization and not self.partition_activations:
            found.append(Problem(f"{prefix}.contiguous_memory_optimization",
                                 "needs partition_activations: the contiguous buffer holds the partitioned "
                                 "activations", "set partition_activations: true, or turn it off"))
        if self.contiguous_memory_optimization and not self.number_checkpoints:
            found.append(Problem(f"{prefix}.number_checkpoints",
                                 "is required with contiguous_memory_optimization (it sizes the buffer)",
                                 "set it to the checkpoint calls of one forward, e.g. the number of layers"))
        return found


SparseMode = Literal["dense", "fixed", "bigbird", "bslongformer", "variable"]

# Keys each sparse-attention mode reads besides block and different_layout_per_head (§3 rule 28).
SPARSE_MODE_KEYS: dict[str, frozenset[str]] = {
    "dense": frozenset(),
    "fixed": frozenset({"num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
                        "num_different_global_patterns"}),
    "bigbird": frozenset({"num_global_blocks", "num_random_blocks", "num_sliding_window_blocks"}),
    "bslongformer": frozenset({"global_block_indices", "global_block_end_indices", "num_sliding_window_blocks"}),
    "variable": frozenset({"num_random_blocks", "local_window_blocks", "global_block_indices",
                           "global_block_end_indices", "attention", "horizontal_global_attention"}),
}


class SparseAttentionConfig(Section):
    """``sparse_attention``: block-sparse attention layouts. Which keys matter depends on ``mode``
    (:data:`SPARSE_MODE_KEYS`); ``horizontal_global_attention`` needs bidirectional attention and
    ``global_block_end_indices`` must match ``global_block_indices`` in length."""

    mode: SparseMode = "fixed"
    block: PosInt = 16
    different_layout_per_head: bool = False
    num_local_blocks: PosInt = 4
    num_global_blocks: PosInt = 1
    attention: Literal["unidirectional", "bidirectional"] = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: PosInt = 1
    num_random_blocks: NonNegInt = 0
    local_window_blocks: list[PosInt] = Field(default_factory=lambda: [4])
    global_block_indices: list[NonNegInt] = Field(default_factory=lambda: [0])
    global_block_end_indices: list[NonNegInt] | None = None
    num_sliding_window_blocks: PosInt = 3


class ModelInfo(Section):
    """``autotuning.model_info`` (undocumented): model facts that spare the profiling run."""

    profile: bool = False
    num_params: PosInt | None = None
    hidden_size: PosInt | None = None
    num_layers: PosInt | None = None


class AutotuningConfig(Section):
    """``autotuning``: profile steps ``start_profile_step``..``end_profile_step`` of each experiment;
    ``fast`` tunes only the ZeRO stage and micro batch size. Defaults per DeepSpeed (D7)."""

    enabled: bool = False
    fast: bool = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    metric: Annotated[Literal["latency", "throughput", "flops"], BeforeValidator(lower_text)] = "throughput"
    metric_path: str | None = None
    start_profile_step: NonNegInt = 3
    end_profile_step: NonNegInt = 5
    max_train_batch_size: PosInt | None = None
    min_train_batch_size: PosInt = 1
    max_train_micro_batch_size_per_gpu: PosInt = 1024
    min_train_micro_batch_size_per_gpu: PosInt = 1
    num_tuning_micro_batch_sizes: PosInt = 3
    mp_size: PosInt = 1
    tuner_type: Annotated[Literal["gridsearch", "random", "model_based"], BeforeValidator(lower_text)] = "gridsearch"
    tuner_early_stopping: PosInt = 5
    tuner_num_trials: PosInt = 50
    arg_mappings: dict[str, str] | None = None
    model_info: ModelInfo | None = None
    model_info_path: str | None = None


class ElasticitySection(Section):
    """``elasticity``: pick a global batch size that works for many GPU counts. When enabled,
    ``max_train_batch_size`` and ``micro_batch_sizes`` are required (as in DeepSpeed), and unless
    ``ignore_non_elastic_batch_info`` the top-level batch keys must be absent. ``min_time`` applies to
    version 0.1 only; ``num_gpus_per_node`` and ``model_parallel_size`` to version 0.2 only."""

    enabled: bool = False
    max_train_batch_size: PosInt | None = None
    micro_batch_sizes: list[PosInt] | None = None
    min_gpus: PosInt = 1
    max_gpus: PosInt = 10000
    min_time: NonNegInt = 0
    prefer_larger_batch: bool = True
    version: float = 0.2
    ignore_non_elastic_batch_info: bool = False
    num_gpus_per_node: PosInt = 1
    model_parallel_size: PosInt = 1


class ParallelWriteConfig(Section):
    pipeline_stage: bool = False


class CheckpointConfig(Section):
    """``checkpoint``: ``tag_validation`` (Ignore/Warn/Fail, any case) checks tags agree across ranks."""

    tag_validation: Annotated[Literal["Ignore", "Warn", "Fail"], BeforeValidator(_capitalise)] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: CheckpointWriterConfig | None = None


class EigenvalueConfig(Section):
    """``eigenvalue`` (undocumented; referenced by the monitor docs): power iteration on block Hessians."""

    enabled: bool = False
    verbose: bool = False
    max_iter: PosInt = 100
    tol: NonNegFloat = 1e-2
    stability: NonNegFloat = 1e-6
    gas_boundary_resolution: PosInt = 1
    layer_name: str = "bert.encoder.layer"
    layer_num: NonNegInt = 0


PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero_bubble")


class PipelineConfig(Section):
    """``pipeline`` (undocumented in DeepSpeed; read by its pipeline engine), for a ``PipelineModule``.
    ``stages`` is an int or the literal ``"auto"`` (the module's count; a real value here, not a Hugging
    Face placeholder); ``partition`` (``best`` = ``parameters``), ``seed_layers`` and
    ``activation_checkpoint_interval`` are what dsrun builds its own pipeline models with, and must agree
    with a user's module. dsrun adds ``schedule`` (``1f1b``: DeepSpeed's TrainSchedule, ``gpipe``,
    ``interleaved`` with ``virtual_stages`` chunks per rank, ``zero_bubble``: ZB-H1). See docs/pipeline.md."""

    stages: PosInt | Literal["auto"] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: NonNegInt = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    schedule: Annotated[Literal["1f1b", "gpipe", "interleaved", "zero_bubble"], BeforeValidator(lower_text)] = "1f1b"
    virtual_stages: PosInt = 1


class HybridEngineConfig(Section):
    """``hybrid_engine`` (undocumented; DeepSpeed-Chat's train/generate engine)."""

    enabled: bool = False
    max_out_tokens: PosInt = 512
    inference_tp_size: PosInt = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: PosInt = 8
    enable_cuda_graph: bool = False


class CompileConfig(Section):
    """``compile`` (undocumented): ``torch.compile`` the engine's module with ``backend`` and ``kwargs``."""

    # DeepSpeed's way is engine.compile() with deepcompile and enabled unset: its keys count then too
    also_enabled_by: ClassVar[tuple[str, ...]] = ("deepcompile",)
    enabled: bool = False
    backend: str = "inductor"
    kwargs: OpenDict = Field(default_factory=dict)
    # DeepCompile (DeepSpeed 0.17+): compiler passes for ZeRO; defaults are DeepSpeed's
    deepcompile: bool = False
    autoep_non_moe: bool = False
    free_activation: bool = False
    free_activation_threshold: NonNegInt = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None  # DeepSpeed's pass names


class ThroughputTimerConfig(Section):
    enabled: bool = True
    synchronized: bool = True


class TimersConfig(Section):
    """``timers`` (undocumented): the throughput timer."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class NebulaConfig(Section):
    """``nebula`` (undocumented): Azure Nebula checkpoint service."""

    enabled: bool = False
    load_path: str | None = None
    enable_nebula_load: bool = True
    persistent_storage_path: str | None = None
    persistent_time_interval: PosInt = 100
    num_of_version_in_retention: PosInt = 2


class QuantizeBits(Section):
    start_bits: PosInt = 16
    target_bits: PosInt = 8


class QuantizeSchedule(Section):
    quantize_period: NonNegInt = 1000
    schedule_offset: NonNegInt = 1000


class QuantizeAlgo(Section):
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    rounding: Literal["nearest", "stochastic"] = "nearest"


class FP16MixedQuantizeLegacy(Section):
    enabled: bool = False
    quantize_change_ratio: NonNegFloat = 0.001


class QuantizeTrainingConfig(Section):
    """``quantize_training`` (MoQ, the pre-compression-library quantizer; undocumented in the config page
    but defined by DeepSpeed and used by the MoQ example): bits go from ``quantize_bits.start_bits`` to
    ``target_bits``, one step every ``quantize_schedule.quantize_period`` steps."""

    enabled: bool = False
    quantize_verbose: bool = False
    quantizer_kernel: bool = False
    quantize_bits: QuantizeBits = Field(default_factory=QuantizeBits)
    quantize_schedule: QuantizeSchedule = Field(default_factory=QuantizeSchedule)
    quantize_groups: PosInt = 1
    quantize_algo: QuantizeAlgo = Field(default_factory=QuantizeAlgo)
    fp16_mixed_quantize: FP16MixedQuantizeLegacy = Field(default_factory=FP16MixedQuantizeLegacy)


def _empty_is_unset(value: RawValue) -> RawValue:
    return None if value == {} else value  # DeepSpeed's default for quantized_initialization is {}: off


class GroupWiseQuantRule(Section):
    """One group-wise weight quantization rule of ``weight_quantization`` (DeepSpeed supports asymmetric
    quantization only). Each group of ``group_size`` values along ``group_dim`` of a weight gets its own minimum and
    scale. DeepSpeed's quantizer needs ``group_dim`` too (a KeyError without it); dsrun defaults it to 1, a
    weight's last dimension (along its input features), which DeepSpeed's examples use and its CUDA kernel needs."""

    num_bits: Literal[4, 8]
    group_size: PosInt
    group_dim: NonNegInt = 1
    symmetric: Literal[False] = False


class WeightQuantConfig(Section):
    """``weight_quantization`` (DeepSpeed's ``WeightQuantConfig``, ZeRO-Inference's weight quantization; what each
    key does: docs/inference.md). ``quantized_initialization``: every ``nn.Linear``/``nn.Embedding`` weight is
    stored quantized from the moment it is built (``zero.Init`` with this config, before partitioning) or, for a
    model built without it, when ``dsrun.initialize`` takes the model. ``post_init_quant``: the layers whose name
    contains a key are replaced by quantized layers (``_init_group_wise_weight_quantization``; ``dsrun.initialize``
    applies it too). ``enabled: false`` turns both off (DeepSpeed does not read it). The section's own ``num_bits``/``q_type``/
    ``q_groups`` (DeepSpeed's ``BaseQuantConfig``) are accepted and, as in DeepSpeed, act nowhere: the rules' keys
    do."""

    enabled: bool = True
    # BaseQuantConfig's: DeepSpeed reads them into this section and uses them nowhere (each rule has its own)
    num_bits: PosInt = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: PosInt = 1
    quantized_initialization: Annotated[GroupWiseQuantRule | None, BeforeValidator(_empty_is_unset)] = None
    post_init_quant: dict[str, GroupWiseQuantRule] = Field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.enabled and (self.quantized_initialization is not None or bool(self.post_init_quant))

    def to_ds_dict(self) -> dict[str, Any]:
        out = super().to_ds_dict()
        if "quantized_initialization" in out and out["quantized_initialization"] is None:
            out["quantized_initialization"] = {}  # DeepSpeed's "off" (its field is a dict: null fails there)
        return out
