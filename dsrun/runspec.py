"""The RunSpec's own sections, typed, and validation of a whole composed RunSpec.

``ds`` is validated by the DeepSpeed schema (:mod:`dsrun.config`); ``train`` and ``launcher`` by the models
here; ``model`` and ``data`` are ``_target_`` mappings whose keyword arguments their classes check when built.
Every problem in every section is reported at once, each naming its key path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsrun.utils.errors import ConfigError, Problem, show
from dsrun.utils.suggest import did_you_mean


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainSpec(_Section):
    """``train:`` — the training loop's budget and bookkeeping."""

    max_steps: int = Field(300, ge=1, description="optimizer steps to run")
    max_tokens: int | None = Field(None, ge=1, description="stop after this many training tokens, all ranks")
    seed: int = Field(1234, description="seed for the model, data order and dropout")
    eval_interval: int = Field(100, ge=0, description="optimizer steps between evaluations (0: at the end)")
    eval_iters: int = Field(10, ge=1, description="eval batches per evaluation")
    save_interval: int = Field(0, ge=0, description="optimizer steps between checkpoints (0: none)")
    resume: str | None = Field(None, description="null, 'auto' (latest checkpoint of the run) or a directory")
    keep_last: int = Field(2, ge=0, description="checkpoints kept (0: all)")


Runner = Literal["local", "ssh", "pdsh", "no_ssh", "slurm", "openmpi", "mpich"]


class LauncherSpec(_Section):
    """``launcher:`` — where ranks run. The same options as ``dsrun launch``'s flags."""

    runner: Runner = "local"
    num_procs: int | None = Field(2, ge=1, description="ranks per node (default: accelerators, or 1 on CPU)")
    num_nodes: int | None = Field(1, ge=1)
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    master_addr: str | None = "127.0.0.1"
    master_port: int = Field(29500, ge=1, le=65535)
    node_rank: int | None = Field(0, ge=0)
    ssh_port: int | None = Field(None, ge=1, le=65535)
    launcher_args: str = ""
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    max_restarts: int = Field(0, ge=0)
    log_dir: str | None = None


def pydantic_problems(err: ValidationError, prefix: str) -> list[Problem]:
    """One :class:`Problem` per pydantic error, with a dotted key path under ``prefix``."""
    problems = []
    for item in err.errors():
        loc = [str(part) for part in item["loc"]]
        path = ".".join([prefix, *loc]) if prefix else ".".join(loc)
        if item["type"] == "extra_forbidden":
            siblings = _known_fields(err)
            problems.append(Problem(path, "unknown key", did_you_mean(loc[-1], siblings) or
                                    (f"known keys: {', '.join(sorted(siblings))}" if siblings else "")))
        else:
            problems.append(Problem(path, f"got {show(item.get('input'))}; {item['msg'].lower()}"))
    return problems


def _known_fields(err: ValidationError) -> list[str]:
    for model in (TrainSpec, LauncherSpec):
        if model.__name__ == err.title:
            return list(model.model_fields)
    return []


def _section(cfg: DictConfig, key: str) -> Mapping[str, Any]:
    node = cfg.get(key)
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else (node or {})


@dataclass(frozen=True)
class ResolvedRun:
    """A validated RunSpec: the composed config, its typed sections and the resolved DeepSpeed config."""

    runspec: DictConfig
    train: TrainSpec
    launcher: LauncherSpec
    ds: Any  # dsrun.config.DeepSpeedConfig
    world_size: int
    world_size_source: str

    def ds_dict(self) -> dict[str, Any]:
        return self.ds.to_ds_dict()


def world_size_of(launcher: LauncherSpec) -> tuple[int, str]:
    """World size of the launch plan and a phrase saying where it came from."""
    if launcher.runner == "local" or not launcher.hostfile:
        procs = launcher.num_procs or 1
        return procs, f"launcher.num_procs={procs} on this machine"
    raise ConfigError(Problem("launcher.runner", f"runner {launcher.runner!r} is not available yet",
                              "use launcher=local"))


def resolve_run(cfg: DictConfig) -> ResolvedRun:
    """Validate every section of a composed RunSpec; raise :class:`ConfigError` listing all problems."""
    from dsrun.config import load_ds_config

    problems: list[Problem] = []
    unknown = [k for k in cfg if k not in ("model", "data", "train", "launcher", "ds", "ds_config")]
    problems += [Problem(str(k), "unknown top-level key of the RunSpec",
                         did_you_mean(str(k), ["model", "data", "train", "launcher", "ds"]) or
                         "the RunSpec has model, data, train, launcher and ds") for k in unknown]
    for key in ("model", "data"):
        node = cfg.get(key)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            problems.append(Problem(f"{key}._target_", "missing", f"pick a {key} config group, e.g. {key}=..."))
    parsed: dict[str, Any] = {}
    for key, model in (("train", TrainSpec), ("launcher", LauncherSpec)):
        try:
            parsed[key] = model.model_validate(_section(cfg, key))
        except ValidationError as err:
            problems += pydantic_problems(err, key)
    world_size, source = 1, "default"
    if "launcher" in parsed:
        try:
            world_size, source = world_size_of(parsed["launcher"])
        except ConfigError as err:
            problems += err.problems
    ds = None
    try:
        ds = load_ds_config(_section(cfg, "ds"), world_size=world_size, world_size_source=source,
                            auto_values=_auto_values(cfg), path_prefix="ds")
    except ConfigError as err:
        problems += err.problems
    if problems:
        raise ConfigError(problems)
    return ResolvedRun(cfg, parsed["train"], parsed["launcher"], ds, world_size, source)


def _auto_values(cfg: DictConfig) -> dict[str, Any]:
    """Values the RunSpec knows for DeepSpeed keys a Hugging Face-style config may leave as "auto"."""
    values: dict[str, Any] = {}
    steps = OmegaConf.select(cfg, "train.max_steps")
    if steps is not None:
        values["scheduler.params.total_num_steps"] = steps
    return values
