"""Validation of a whole composed RunSpec, and the ``train`` section's type.

``ds`` is validated by the DeepSpeed schema (:mod:`dsrun.config`); ``launcher`` by planning the launch
(:func:`dsrun.launcher.plan_from_mapping`), which also gives the world size the batch sizes resolve for;
``train`` by :class:`TrainSpec`; ``model`` and ``data`` are ``_target_`` mappings whose keyword arguments
their classes check when built. Every problem in every section is reported at once, each naming its key path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field

from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.suggest import did_you_mean

if TYPE_CHECKING:  # imported where used: the CLI loads this module without them
    from dsrun.config import DSConfig
    from dsrun.launcher import LaunchPlan
    from dsrun.launcher.outer import OuterRank


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PreemptionSpec(_Section):
    """``train.preemption:`` — what a run does on SIGTERM or SIGUSR1 (a scheduler taking its machines back):
    every rank finishes its step and saves a checkpoint there, even with ``train.save_interval=0``, then exits
    with 138 (docs/cluster.md)."""

    grace_s: float = Field(120.0, gt=0, description="seconds from the signal to the checkpoint being saved; a "
                           "rank that is not done by then says so and exits without it (set it at most the "
                           "scheduler's notice: Kubernetes' terminationGracePeriodSeconds, Slurm's --signal=USR1@N)")


class TrainSpec(_Section):
    """``train:`` — the training loop's budget and bookkeeping."""

    max_steps: int = Field(300, ge=1, description="optimizer steps to run")
    max_tokens: int | None = Field(None, ge=1, description="stop after this many training tokens, all ranks")
    seed: int = Field(1234, description="seed for the model, data order and dropout")
    eval_interval: int = Field(100, ge=0, description="optimizer steps between evaluations (0: at the end)")
    eval_iters: int = Field(10, ge=1, description="eval batches per evaluation")
    save_interval: int = Field(0, ge=0, description="optimizer steps between checkpoints, and one at the last step (0: none)")
    resume: str | None = Field(None, description="null, 'auto' (latest checkpoint of the run) or a directory")
    keep_last: int = Field(2, ge=0, description="checkpoints kept (0: all)")
    teacher: str | None = Field(None, description="a finished run directory whose model teaches this one: "
                                "layer reduction starts from its layers and the loss adds distillation")
    kd_weight: float = Field(1.0, ge=0, description="weight of the distillation term (with teacher)")
    kd_temperature: float = Field(1.0, gt=0, description="softmax temperature of the distillation term")
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec,
                                       description="SIGTERM/SIGUSR1: save where the ranks stop, within grace_s")


def _section(cfg: DictConfig, key: str) -> Mapping[str, Any]:
    node = cfg.get(key)
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else (node or {})


WORKER_MODULE = "dsrun.worker"


@dataclass(frozen=True)
class ResolvedRun:
    """A validated RunSpec: the composed config, its typed train section, the launch plan and the resolved
    DeepSpeed config."""

    runspec: DictConfig
    train: TrainSpec
    plan: LaunchPlan  # for the worker (its target arguments are filled in at launch)
    ds: DSConfig
    ds_source: object = field(default=None, compare=False, repr=False)  # what ds was parsed from (resolve_run's reuse)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def world_size_source(self) -> str:
        return describe_world(self.plan)

    def ds_dict(self) -> dict[str, Any]:
        return self.ds.to_ds_dict()


def describe_world(plan: LaunchPlan) -> str:
    """Where the world size came from, for the batch-size explanation."""
    if plan.outer:
        return plan.outer
    if plan.hostfile:
        slots = " + ".join(str(len(s)) for s in plan.hosts.values())
        return f"{len(plan.hosts)} host(s) of {plan.hostfile} after filters: {slots} slots"
    return f"launcher.num_procs={plan.world_size} on this machine"


def resolve_run(cfg: DictConfig, reuse: ResolvedRun | None = None, outer: OuterRank | None = None) -> ResolvedRun:
    """Validate every section of a composed RunSpec; raise :class:`ConfigError` listing all problems.

    ``reuse``: a run resolved before in this process (``dsrun train`` checks the run before Hydra composes it
    again); its DeepSpeed config is taken as is when it was parsed from the same section for the same world,
    so the launching process parses the config once. ``outer``: the rank an outer launcher (torchrun, srun,
    mpirun) made this process; the world is then the outer launcher's and the ``launcher`` keys that conflict
    with it are problems (:mod:`dsrun.launcher.outer`)."""
    from dsrun.config import load_ds_config
    from dsrun.config.problems import validate_model
    from dsrun.launcher import plan_from_mapping
    from dsrun.utils.errors import UserError

    problems: list[Problem] = []
    # `tune` (a recipe's search space for `dsrun tune`, docs/autotuning.md) is read by the tuner only
    unknown = [k for k in cfg if k not in ("model", "data", "train", "launcher", "ds", "ds_config", "tune")]
    problems += [Problem(str(k), "unknown top-level key of the RunSpec",
                         did_you_mean(str(k), ["model", "data", "train", "launcher", "ds"]) or
                         "the RunSpec has model, data, train, launcher and ds") for k in unknown]
    for key in ("model", "data"):
        node = cfg.get(key)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            problems.append(Problem(f"{key}._target_", "missing", f"pick a {key} config group, e.g. {key}=..."))
    problems += _unread_sparse_attention(cfg)
    problems += _unmatched_sequence_parallel(cfg)
    train, train_problems = validate_model(TrainSpec, _section(cfg, "train"), "train")
    problems += train_problems
    plan = None
    try:
        plan = plan_from_mapping(_section(cfg, "launcher"), WORKER_MODULE, module=True, outer=outer)
    except UserError as err:
        problems += err.problems
    ds = None
    world, source = (plan.world_size, describe_world(plan)) if plan else (1, "launcher (invalid, assumed 1)")
    stages = OmegaConf.select(cfg, "model.pipeline_stages") or 1
    if isinstance(stages, int) and stages > 1:  # a pipeline: the batch sizes count data-parallel ranks only
        if world % stages:
            problems.append(Problem("model.pipeline_stages", f"{stages} stages do not divide the {world} ranks",
                                    "launch a multiple of model.pipeline_stages ranks"))
        world, source = max(1, world // stages), f"{source}, divided by model.pipeline_stages={stages}"
    tp = OmegaConf.select(cfg, "ds.tensor_parallel.autotp_size") or 1
    if isinstance(tp, int) and tp > 1:  # AutoTP: a tensor-parallel group's ranks share their samples too
        if world % tp:
            problems.append(Problem("ds.tensor_parallel.autotp_size", f"{tp} does not divide the {world} ranks",
                                    "launch a multiple of autotp_size ranks"))
        world, source = max(1, world // tp), f"{source}, divided by ds.tensor_parallel.autotp_size={tp}"
    ds_source = (_section(cfg, "ds"), world, source, _auto_values(cfg))
    if reuse is not None and reuse.ds is not None and reuse.ds_source == ds_source:
        ds = reuse.ds
    else:
        try:
            ds = load_ds_config(ds_source[0], world_size=world, world_size_source=source,
                                auto_values=ds_source[3], path_prefix="ds")
        except ConfigError as err:
            problems += err.problems
    if plan is not None and plan.options.elastic_training:
        problems += _elastic_problems(train, ds)
    if ds is not None and ds.pipeline.stages != "auto" and ds.pipeline.stages != stages:
        problems.append(Problem("ds.pipeline.stages", f"got {ds.pipeline.stages}; model.pipeline_stages is {stages}",
                                "set model.pipeline_stages (dsrun's GPT is cut into that many stages)"))
    if ds is not None and train is not None and ds.compression_training.layer_reduction.enabled and not train.teacher:
        problems.append(Problem("train.teacher", "compression_training.layer_reduction needs a teacher: a finished "
                                "run of the full-depth model", "train it with train.save_interval > 0, then pass "
                                "train.teacher=ITS_RUN_DIR (docs/compression.md)"))
    if train is not None and train.teacher and isinstance(stages, int) and stages > 1:
        problems.append(Problem("train.teacher", "layer reduction and distillation run on the whole GPT, not on a "
                                "pipelined one", "set model.pipeline_stages=1 for the distillation run"))
    if problems:
        raise ConfigError(problems)
    return ResolvedRun(cfg, train, plan, ds, ds_source)


def _elastic_problems(train: TrainSpec | None, ds: DSConfig | None) -> list[Problem]:
    """An elastic job's ranks restart at each membership change, at another world size: they must resume
    from the run's checkpoints, and the batch sizes must come from ``ds.elasticity`` (numbers resolved for
    one world size do not fit another)."""
    found = []
    if ds is not None and not ds.elasticity.enabled:
        found.append(Problem("ds.elasticity.enabled", "launcher.elastic_training restarts the ranks at other world "
                             "sizes, and batch sizes resolved for this one do not fit those",
                             "enable ds.elasticity (max_train_batch_size, micro_batch_sizes; the gpt_elastic "
                             "recipe does)"))
    if train is not None and (str(train.resume).lower() != "auto" or not train.save_interval):
        found.append(Problem("train.resume", f"is {train.resume or 'null'} with save_interval {train.save_interval}, but "
                             "a restarted rank of an elastic job resumes from the run's newest checkpoint",
                             "set train.resume=auto and train.save_interval=N (the gpt_elastic recipe does)"))
    return found


def _unread_sparse_attention(cfg: DictConfig) -> list[Problem]:
    """``ds.sparse_attention`` acts on the built-in GPT through ``model.attention=sparse``; refuse it when the GPT
    would not read it. (Your own model reads the section itself, as DeepSpeed models do.)"""
    model, ds = cfg.get("model"), cfg.get("ds")
    if not isinstance(model, DictConfig) or not isinstance(ds, DictConfig) or ds.get("sparse_attention") is None:
        return []
    # the string, not dsrun.models.registry.GPT_TARGET: importing dsrun.models would load torch into the CLI
    if model.get("_target_") != "dsrun.models.gpt.GPT" or model.get("attention", "dense") == "sparse":
        return []
    return [Problem("ds.sparse_attention", "is set but model.attention is 'dense', so the GPT would ignore it",
                    "add attention=sparse (it passes the section to the model) or remove ds.sparse_attention")]


def _unmatched_sequence_parallel(cfg: DictConfig) -> list[Problem]:
    """Ulysses needs both halves: ``ds.sequence_parallel_size`` builds the groups and gives a group the same
    samples, ``model.sequence_parallel`` makes the built-in GPT take its slice of them; either alone would
    leave the other doing nothing."""
    model, ds = cfg.get("model"), cfg.get("ds")
    if not isinstance(model, DictConfig) or not str(model.get("_target_", "")).startswith("dsrun.models."):
        return []  # your own model shards its sequence itself (DeepSpeed's contract)
    size = ds.get("sequence_parallel_size", 1) if isinstance(ds, DictConfig) else 1
    sharded = bool(model.get("sequence_parallel", False))
    if isinstance(size, int) and size > 1 and not sharded:
        return [Problem("model.sequence_parallel", f"is off, but ds.sequence_parallel_size={size} gives each group of "
                        f"{size} ranks the same samples, which the GPT would then process whole on every rank",
                        "set model.sequence_parallel=true (the gpt_ulysses recipe does)")]
    if sharded and size == 1:
        return [Problem("model.sequence_parallel", "is on, but ds.sequence_parallel_size is 1, so there is no "
                        "sequence group to shard over", "set ds.sequence_parallel_size (e.g. +ds.sequence_parallel_size=2)")]
    return []


def _auto_values(cfg: DictConfig) -> dict[str, Any]:
    """Values the RunSpec knows for DeepSpeed keys a Hugging Face-style config may leave as "auto"."""
    values: dict[str, Any] = {}
    steps = OmegaConf.select(cfg, "train.max_steps")
    if steps is not None:
        values["scheduler.params.total_num_steps"] = steps
    return values
