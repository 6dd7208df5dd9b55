"""The ``pipeline`` config section against the PipelineModule it drives: which schedule runs, and the checks
that keep a setting from being silently ignored.

``schedule`` picks the training schedule (``1f1b``, ``gpipe``, ``interleaved`` with ``virtual_stages``,
``zero_bubble``). ``stages``, ``partition``, ``seed_layers`` and ``activation_checkpoint_interval`` describe
how the module is built: dsrun's own pipeline models are built from them (:mod:`dsrun.workloads.pipeline`);
for a user's module, which is built before the config is read, they must agree with it or the engine
refuses to start. ``pipe_partitioned`` and ``grad_partitioned`` split each message over the model-parallel
ranks (they only act with a ``model`` axis, see :mod:`dsrun.pipe.p2p`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from dsrun.utils.errors import ConfigError, Problem

from dsrun.pipe.schedule import InferenceSchedule, PipeSchedule, TrainSchedule
from dsrun.pipe.timed import GPipeSchedule, InterleavedSchedule, TimedSchedule, ZeroBubbleSchedule

if TYPE_CHECKING:
    from dsrun.config import DSConfig

TRAIN_SCHEDULES: dict[str, type[PipeSchedule]] = {"1f1b": TrainSchedule, "gpipe": GPipeSchedule,
                                                  "interleaved": InterleavedSchedule,
                                                  "zero_bubble": ZeroBubbleSchedule}
PARTITION_ALIASES = {"best": "parameters"}


class BuiltPipeline(Protocol):
    """What the config is checked against: how the PipelineModule was built (a Protocol: the module imports
    the engine, which imports these settings)."""

    num_stages: int
    partition_method: str
    seed_layers: bool
    activation_checkpoint_interval: int
    tied_comms: dict[str, dict[str, Any]]


class ForwardSchedule(TimedSchedule):
    """Forward only over virtual stages (evaluation with the interleaved schedule)."""

    trains = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1):
        super().__init__(micro_batches, stages, stage_id)
        self.virtual_stages = virtual_stages

    @classmethod
    def compute_orders(cls, micro_batches: int, stages: int, virtual_stages: int) -> list[list[tuple[str, int, int]]]:
        return [[("F", c * stages + d, j) for j in range(micro_batches) for c in range(virtual_stages)]
                for d in range(stages)]


def train_schedule(config: DSConfig, micro_batches: int, stages: int, stage_id: int) -> PipeSchedule:
    pipe = config.pipeline
    if pipe.schedule == "interleaved":
        return InterleavedSchedule(micro_batches, stages, stage_id, virtual_stages=pipe.virtual_stages)
    return TRAIN_SCHEDULES[pipe.schedule](micro_batches, stages, stage_id)


def eval_schedule(config: DSConfig, micro_batches: int, stages: int, stage_id: int) -> PipeSchedule:
    virtual = config.pipeline.virtual_stages if config.pipeline.schedule == "interleaved" else 1
    if virtual > 1:
        return ForwardSchedule(micro_batches, stages, stage_id, virtual_stages=virtual)
    return InferenceSchedule(micro_batches, stages, stage_id)


def partition_method(config: DSConfig) -> str:
    """The partition method ``pipeline.partition`` names (``best``: parameters)."""
    name = str(config.pipeline.partition)
    return PARTITION_ALIASES.get(name.lower(), name)


def check_module(module: BuiltPipeline, config: DSConfig) -> None:
    """Refuse a config whose pipeline settings disagree with the module, or that the engine cannot run."""
    pipe, given = config.pipeline, config.pipeline.model_fields_set
    problems: list[Problem] = []
    if pipe.stages != "auto" and int(pipe.stages) != module.num_stages:
        problems.append(Problem("pipeline.stages", f"got {pipe.stages}; the PipelineModule has {module.num_stages} "
                                "stages", "set pipeline.stages to 'auto' or to the module's num_stages"))
    if pipe.partition != "best" and partition_method(config).lower() != str(module.partition_method).lower():
        problems.append(Problem("pipeline.partition", f"got {pipe.partition!r}; the PipelineModule was cut with "
                                f"partition_method={module.partition_method!r}",
                                "build the module with that partition_method, or drop the key"))
    for key in ("seed_layers", "activation_checkpoint_interval"):
        if key in given and getattr(pipe, key) != getattr(module, key):
            problems.append(Problem(f"pipeline.{key}", f"got {getattr(pipe, key)!r}; the PipelineModule has "
                                    f"{getattr(module, key)!r}", f"pass {key}= to the PipelineModule, or drop the key"))
    stage = int(config.zero_optimization.stage)
    if stage == 3:
        problems.append(Problem("zero_optimization.stage", "got 3; ZeRO-3 partitions the parameters a pipeline "
                                "stage needs whole", "use stage 0, 1 or 2 with a PipelineModule"))
    if stage == 2 and module.tied_comms:
        problems.append(Problem("zero_optimization.stage", "got 2 with weights tied across pipeline stages "
                                f"({', '.join(module.tied_comms)}): ZeRO-2 reduces each gradient as backward "
                                "makes it, before the tied copies are summed", "use stage 0 or 1"))
    if pipe.schedule == "interleaved" and module.num_stages < 2:
        problems.append(Problem("pipeline.schedule", "interleaved needs at least 2 pipeline stages (the chunks "
                                "of one rank hand their activations around the ring of stages)", "use 1f1b"))
    if pipe.schedule == "zero_bubble" and module.activation_checkpoint_interval:
        problems.append(Problem("pipeline.schedule", "zero_bubble splits backward in two passes over a kept "
                                "graph; activation checkpointing recomputes that graph",
                                "use 1f1b with activation checkpointing, or set activation_checkpoint_interval=0"))
    if problems:
        raise ConfigError(problems)
