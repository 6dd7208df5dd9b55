"""Data-efficiency sections: ``data_efficiency`` (curriculum data sampling and random-LTD routing), the
legacy top-level ``curriculum_learning``, and ``progressive_layer_drop``.

``curriculum_metrics`` is an open dict: its keys are metric names the user chooses (e.g.
``vocabularyrarity``), each holding a typed metric section. Which ``schedule_config`` keys a schedule needs
depends on ``schedule_type``; :func:`check_schedule` enforces that (config-keys.md §3 rule 31).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from dsrun.utils.errors import Problem

from .base import NonNegInt, PosInt, Section

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]


class CurriculumScheduleConfig(Section):
    """``schedule_config`` of a curriculum: fixed_linear needs ``total_curriculum_step`` and
    ``difficulty_step``; fixed_root also ``root_degree``; fixed_discrete needs ``difficulty`` and
    ``max_step`` (parallel lists, one fewer max_step than difficulties). ``difficulty_step`` should be a
    multiple of 8 (fp16) or 16 (int8) for Tensor Cores."""

    total_curriculum_step: PosInt | None = None
    difficulty_step: PosInt | None = None
    root_degree: PosInt | None = None
    difficulty: list[int] | None = None
    max_step: list[int] | None = None


_REQUIRED_BY_SCHEDULE = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


def check_schedule(schedule_type: str | None, config: CurriculumScheduleConfig | None, path: str) -> list[Problem]:
    """The ``schedule_config`` keys ``schedule_type`` needs, each missing one a problem."""
    if schedule_type is None:
        return []
    problems: list[Problem] = []
    needed = _REQUIRED_BY_SCHEDULE.get(schedule_type, ())
    for key in needed:
        if config is None or getattr(config, key) is None:
            problems.append(Problem(f"{path}.schedule_config.{key}",
                                    f"required when schedule_type is {schedule_type!r}"))
    if schedule_type == "fixed_discrete" and config is not None and config.difficulty and config.max_step is not None:
        if len(config.max_step) != len(config.difficulty) - 1:
            problems.append(Problem(
                f"{path}.schedule_config.max_step",
                f"has {len(config.max_step)} entries; fixed_discrete needs len(difficulty) - 1 = "
                f"{len(config.difficulty) - 1} (the step at which each next difficulty starts)",
            ))
    return problems


class CurriculumLearningConfig(Section):
    """Legacy top-level ``curriculum_learning`` (still supported; the Data Efficiency Library is preferred).
    When enabled, ``curriculum_type`` (only ``seqlen``), ``min_difficulty``, ``max_difficulty`` and
    ``schedule_type`` are required; ``custom`` (DeepSpeed's scheduler accepts it here too) takes its pacing
    function from ``engine.set_custom_curriculum_learning_schedule``."""

    enabled: bool = False
    curriculum_type: Literal["seqlen"] | None = None
    min_difficulty: NonNegInt | None = None
    max_difficulty: NonNegInt | None = None
    schedule_type: ScheduleType | None = None
    schedule_config: CurriculumScheduleConfig | None = None


class CurriculumMetricConfig(Section):
    """One metric under ``data_sampling.curriculum_learning.curriculum_metrics.<name>``."""

    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    difficulty_type: Literal["value", "percentile"] | None = None
    clustering_type: Literal["schedule_based", "single_cluster"] | None = None
    min_difficulty: NonNegInt | None = None
    max_difficulty: NonNegInt | None = None
    schedule_type: ScheduleType | None = None
    schedule_config: CurriculumScheduleConfig | None = None


class DataCurriculumConfig(Section):
    """``data_sampling.curriculum_learning``: ``curriculum_metrics`` is required when enabled."""

    enabled: bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, CurriculumMetricConfig] | None = None


class DynamicBatchingConfig(Section):
    """``data_sampling.dynamic_batching`` (DeepSpeed after 0.14): batches packed to ``max_tokens`` summed sequence
    length and the LR scaled to each batch's size, by the loader and scheduler that
    ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`` builds
    (:mod:`dsrun.data_efficiency.data_sampling.variable_batch_size_and_lr`). ``max_tokens`` is required when
    enabled; ``metrics_path`` is where the Data Analyzer's ``seqlen`` metric is read (or written)."""

    enabled: bool = False
    metrics_path: str | None = None
    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    min_batch_size: PosInt = 1
    max_batch_size: PosInt | None = None
    sequence_picking_order: Literal["dataloader", "random", "seqlen"] = "dataloader"
    max_tokens: PosInt | None = None
    verbose: bool = False


class DataSamplingConfig(Section):
    """``data_efficiency.data_sampling``: ``num_epochs`` default 1000, ``num_workers`` 0."""

    enabled: bool = False
    num_epochs: PosInt = 1000
    num_workers: NonNegInt = 0
    pin_memory: bool = False
    curriculum_learning: DataCurriculumConfig = Field(default_factory=DataCurriculumConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)


class RandomLTDScheduleConfigValues(Section):
    """``random_ltd_schedule.schedule_config``: ``require_steps`` to go from min to max, and
    ``seq_per_step`` (the kept length is always a multiple of it; 8 for fp16 or 16 for int8 suit
    Tensor Cores)."""

    require_steps: PosInt | None = None
    seq_per_step: PosInt | None = None


class RandomLTDSchedule(Section):
    """``random_ltd_schedule``: effective sequence length from ``min_value`` to ``max_value``; only the
    ``fixed_linear`` schedule exists."""

    min_value: PosInt | None = None
    max_value: PosInt | None = None
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleConfigValues = Field(default_factory=RandomLTDScheduleConfigValues)


class LayerTokenLRSchedule(Section):
    """``random_ltd.layer_token_lr_schedule`` (read by DeepSpeed; off by default)."""

    enabled: bool = False
    total_layer_tokens: PosInt | None = None
    warmup_type: Literal["linear", "log"] | None = None
    warmup_layer_tokens: NonNegInt | None = None


class RandomLTDConfig(Section):
    """``data_routing.random_ltd``: skip tokens in the middle layers. ``random_ltd_layer_id`` has
    ``random_ltd_layer_num`` entries; ``model_mask_name`` is the forward's attention-mask argument (leave it
    out for a model without one, as DeepSpeed's ViT example does)."""

    enabled: bool = False
    total_layer_num: PosInt | None = None
    random_ltd_layer_num: PosInt | None = None
    random_ltd_layer_id: list[NonNegInt] | None = None
    model_mask_name: str | None = None
    model_type: Literal["decoder", "encoder"] | None = None
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] | None = None
    random_ltd_schedule: RandomLTDSchedule | None = None
    layer_token_lr_schedule: LayerTokenLRSchedule = Field(default_factory=LayerTokenLRSchedule)


class DataRoutingConfig(Section):
    """``data_efficiency.data_routing``."""

    enabled: bool = False
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)


class DataEfficiencyConfig(Section):
    """``data_efficiency``: the Data Efficiency Library (curriculum data sampling and random-LTD)."""

    enabled: bool = False
    seed: int = 1234
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)


class ProgressiveLayerDropConfig(Section):
    """``progressive_layer_drop`` (undocumented in the config page, described in the PLD tutorial): keep
    probability ``theta`` approached with rate ``gamma``."""

    enabled: bool = False
    theta: float = Field(default=1.0, ge=0.0, le=1.0)
    gamma: float = Field(default=0.001, ge=0.0)


def check_data_efficiency(de: DataEfficiencyConfig, legacy: CurriculumLearningConfig, prefix: str) -> list[Problem]:
    """Required keys of enabled curriculum / random-LTD sections and their schedules."""
    problems: list[Problem] = []
    base = f"{prefix}curriculum_learning"
    if legacy.enabled:
        for key in ("curriculum_type", "min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(legacy, key) is None:
                problems.append(Problem(f"{base}.{key}", "required when curriculum_learning is enabled"))
        problems += check_schedule(legacy.schedule_type, legacy.schedule_config, base)
        problems += _min_max(legacy.min_difficulty, legacy.max_difficulty, base)

    curriculum = de.data_sampling.curriculum_learning
    cbase = f"{prefix}data_efficiency.data_sampling.curriculum_learning"
    if curriculum.enabled and not curriculum.curriculum_metrics:
        problems.append(Problem(f"{cbase}.curriculum_metrics", "required (at least one metric) when curriculum "
                                "learning is enabled", "e.g. {\"seqlen\": {...}}"))
    if curriculum.enabled:
        for name, metric in (curriculum.curriculum_metrics or {}).items():
            mbase = f"{cbase}.curriculum_metrics.{name}"
            for key in ("difficulty_type", "min_difficulty", "max_difficulty", "schedule_type"):
                if getattr(metric, key) is None:
                    problems.append(Problem(f"{mbase}.{key}", "required for every curriculum metric"))
            problems += check_schedule(metric.schedule_type, metric.schedule_config, mbase)
            problems += _min_max(metric.min_difficulty, metric.max_difficulty, mbase)
            if metric.difficulty_type == "percentile":
                for key in ("min_difficulty", "max_difficulty"):
                    value = getattr(metric, key)
                    if value is not None and value > 100:
                        problems.append(Problem(f"{mbase}.{key}", f"got {value}; a percentile is 0..100"))

    batching = de.data_sampling.dynamic_batching
    bbase = f"{prefix}data_efficiency.data_sampling.dynamic_batching"
    if batching.enabled and batching.max_tokens is None:
        problems.append(Problem(f"{bbase}.max_tokens", "required when dynamic batching is enabled (the most summed "
                                "sequence length a micro-batch holds)", "e.g. max_tokens: 4096"))
    problems += _min_max(batching.min_batch_size, batching.max_batch_size, bbase, ("min_batch_size", "max_batch_size"))

    ltd = de.data_routing.random_ltd
    lbase = f"{prefix}data_efficiency.data_routing.random_ltd"
    if ltd.enabled:
        for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_type",
                    "hidden_state_order", "random_ltd_schedule"):
            if getattr(ltd, key) is None:
                problems.append(Problem(f"{lbase}.{key}", "required when random_ltd is enabled"))
        if ltd.random_ltd_layer_id is not None and ltd.random_ltd_layer_num is not None \
                and len(ltd.random_ltd_layer_id) != ltd.random_ltd_layer_num:
            problems.append(Problem(f"{lbase}.random_ltd_layer_id",
                                    f"has {len(ltd.random_ltd_layer_id)} ids but random_ltd_layer_num is "
                                    f"{ltd.random_ltd_layer_num}; they must match"))
        if ltd.random_ltd_layer_id and ltd.total_layer_num is not None:
            bad = [i for i in ltd.random_ltd_layer_id if i >= ltd.total_layer_num]
            if bad:
                problems.append(Problem(f"{lbase}.random_ltd_layer_id",
                                        f"ids {bad} are >= total_layer_num {ltd.total_layer_num}"))
        schedule = ltd.random_ltd_schedule
        if schedule is not None:
            sbase = f"{lbase}.random_ltd_schedule"
            for key in ("min_value", "max_value"):
                if getattr(schedule, key) is None:
                    problems.append(Problem(f"{sbase}.{key}", "required when random_ltd is enabled"))
            for key in ("require_steps", "seq_per_step"):
                if getattr(schedule.schedule_config, key) is None:
                    problems.append(Problem(f"{sbase}.schedule_config.{key}", "required when random_ltd is enabled"))
            problems += _min_max(schedule.min_value, schedule.max_value, sbase, ("min_value", "max_value"))
    return problems


def _min_max(low: int | None, high: int | None, base: str,
             names: tuple[str, str] = ("min_difficulty", "max_difficulty")) -> list[Problem]:
    if low is not None and high is not None and low > high:
        return [Problem(f"{base}.{names[1]}", f"got {high}; must be >= {names[0]} ({low})")]
    return []
