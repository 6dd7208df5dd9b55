"""What :func:`configure` set: the ``activation_checkpointing`` keys and the model-parallel group.

DeepSpeed keeps these as module globals of ``deepspeed.checkpointing``; dsrun keeps them in one
:data:`STATE` object so the checkpoint functions, the engine and the tests read the same thing. Every call to
:func:`configure` starts again from the defaults (as DeepSpeed's does); explicit arguments win over the config.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, Union

from dsrun.features import Feature
from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup

    from dsrun.config import ConfigSource, DSConfig

SECTION = "activation_checkpointing"


class _ModelParallelNames(Protocol):
    def get_model_parallel_group(self) -> ProcessGroup | None: ...
    def get_model_parallel_rank(self) -> int: ...
    def get_model_parallel_world_size(self) -> int: ...


class _TensorParallelNames(Protocol):
    def get_tensor_model_parallel_group(self) -> ProcessGroup | None: ...
    def get_tensor_model_parallel_rank(self) -> int: ...
    def get_tensor_model_parallel_world_size(self) -> int: ...


Mpu = Union[_ModelParallelNames, _TensorParallelNames]  # a Megatron-style mpu, by either family of names


@dataclass(frozen=True)
class CheckpointingSettings:
    """The ``activation_checkpointing`` section, by its DeepSpeed key names."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def problems(self, prefix: str = SECTION) -> list[Problem]:
        """What DeepSpeed refuses (the config schema's own check)."""
        from dsrun.config.misc import ActivationCheckpointingConfig

        return ActivationCheckpointingConfig(**asdict(self)).problems(prefix)

    def enabled_keys(self) -> list[str]:
        """The keys set away from their defaults."""
        default = CheckpointingSettings()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]


@dataclass(frozen=True)
class ModelParallel:
    """The group partitioned activations are split over (``mpu``'s model-parallel group)."""

    group: ProcessGroup | None = None
    rank: int = 0
    world_size: int = 1


@dataclass
class _State:
    settings: CheckpointingSettings = field(default_factory=CheckpointingSettings)
    configured: bool = False
    mpu: Mpu | None = None
    model_parallel: ModelParallel = field(default_factory=ModelParallel)
    said: set[str] = field(default_factory=set)
    # checkpoint calls since the last backward began: the profile's numbering, the contiguous buffer's slot
    calls: int = 0
    in_backward: bool = False
    recomputing: int = 0  # > 0 while a checkpoint recomputes (nested checkpoints there neither count nor use buffers)
    # contiguous_memory_optimization: one flat buffer per input position, number_checkpoints slots each
    buffers: dict[int, Any] = field(default_factory=dict)

    def reset_buffers(self) -> None:
        self.buffers = {}
        self.calls = 0


STATE = _State()


def say_once(key: str, message: str) -> None:
    """Warn once per process (a setting that cannot act here says so, but not on every checkpoint call)."""
    if key not in STATE.said:
        STATE.said.add(key)
        warnings.warn(message, stacklevel=3)


def model_parallel_of(mpu: Mpu | None) -> ModelParallel:
    """The model-parallel group of a Megatron-style ``mpu`` (tensor-parallel names first, as DeepSpeed)."""
    if mpu is None:
        return ModelParallel()
    for prefix in ("get_tensor_model_parallel", "get_model_parallel"):
        if hasattr(mpu, f"{prefix}_group"):
            return ModelParallel(group=getattr(mpu, f"{prefix}_group")(), rank=int(getattr(mpu, f"{prefix}_rank")()),
                                 world_size=int(getattr(mpu, f"{prefix}_world_size")()))
    raise ConfigError(Problem("configure(mpu_=...)", f"{type(mpu).__name__} has no get_model_parallel_group "
                              "(or get_tensor_model_parallel_group)", "pass a Megatron-style mpu or None"))


def settings_from_config(deepspeed_config: ConfigSource | DSConfig) -> CheckpointingSettings:
    """The section of a DeepSpeed config: a loaded :class:`dsrun.config.DSConfig`, a dict, or anything
    :func:`dsrun.config.read_config_source` reads (a path, JSON text). Only this section is validated, so
    a config without batch sizes works too."""
    section = getattr(deepspeed_config, SECTION, None)
    if section is None:
        from dsrun.config import read_config_source
        from dsrun.config.misc import ActivationCheckpointingConfig
        from dsrun.config.problems import validate_model

        raw = read_config_source(deepspeed_config).get(SECTION) or {}
        section, problems = validate_model(ActivationCheckpointingConfig, raw, SECTION)
        if problems:
            raise ConfigError(problems)
    return CheckpointingSettings(**{f.name: getattr(section, f.name) for f in fields(CheckpointingSettings)})


def configure(mpu_: Mpu | None = None, deepspeed_config: ConfigSource | DSConfig | None = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Configure activation checkpointing (DeepSpeed's ``deepspeed.checkpointing.configure``).

    ``mpu_``: an object with ``get_model_parallel_rank/group/world_size`` (or the ``tensor_model_parallel``
    names); partitioned activations are split over its group. ``deepspeed_config``: a DeepSpeed config (path,
    dict or loaded) whose ``activation_checkpointing`` section is read. The other arguments override that
    section: ``partition_activations``, ``contiguous_checkpointing`` (``contiguous_memory_optimization``),
    ``num_checkpoints`` (``number_checkpoints``), ``checkpoint_in_cpu`` (``cpu_checkpointing``),
    ``synchronize`` (``synchronize_checkpoint_boundary``), ``profile``. Raises ConfigError for a contiguous
    buffer without partitioning or without ``num_checkpoints``.
    """
    base = settings_from_config(deepspeed_config) if deepspeed_config is not None else CheckpointingSettings()
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = CheckpointingSettings(**values)
    problems = settings.problems()
    if problems:
        raise ConfigError(problems)
    STATE.mpu = mpu_ if mpu_ is not None else STATE.mpu
    STATE.model_parallel = model_parallel_of(STATE.mpu)
    STATE.settings = settings
    STATE.configured = True
    STATE.reset_buffers()


def is_configured() -> bool:
    """True once :func:`configure` has been called."""
    return STATE.configured


def reset_configuration() -> None:
    """Back to the state before any :func:`configure` (tests; a fresh engine in the same process)."""
    STATE.settings = CheckpointingSettings()
    STATE.configured = False
    STATE.mpu = None
    STATE.model_parallel = ModelParallel()
    STATE.reset_buffers()


def configure_from_engine(module: nn.Module, ds_config: DSConfig, mpu: Mpu | None = None) -> None:
    """What ``dsrun.initialize`` does: a config with an ``activation_checkpointing`` section configures
    checkpointing (DeepSpeed leaves that call to the user; calling it again overrides). A dsrun GPT that
    checkpoints no block is told the section has nothing to act on."""
    if SECTION not in getattr(ds_config, "model_fields_set", ()):
        return
    configure(mpu, deepspeed_config=ds_config)
    keys = STATE.settings.enabled_keys()
    mode = getattr(getattr(module, "activation_checkpointing", None), "mode", None)
    if keys and mode is not None and not mode.enabled:
        say_once("section-without-checkpoints", f"{SECTION}.{', '.join(keys)} configure dsrun.checkpointing, "
                 "but model.activation_checkpointing is none, so no block is checkpointed and they do nothing "
                 "(set model.activation_checkpointing to full, every_N or selective)")


class _Engine(Protocol):
    """What the feature reads of the engine it attaches to."""

    module: nn.Module
    mpu: Mpu | None


class ActivationCheckpointingFeature(Feature):
    """The config's ``activation_checkpointing`` section, configured once the engine is built (an engine
    feature, :mod:`dsrun.features`); off without the section."""

    name = SECTION

    def __init__(self, ds_config: DSConfig):
        self.config = ds_config

    @classmethod
    def build(cls, config: DSConfig) -> "ActivationCheckpointingFeature | None":
        return cls(config) if SECTION in getattr(config, "model_fields_set", ()) else None

    def attach(self, engine: _Engine) -> None:
        configure_from_engine(engine.module, self.config, engine.mpu)
