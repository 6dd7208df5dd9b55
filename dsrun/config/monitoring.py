"""Monitor and profiler sections: ``tensorboard``, ``wandb``, ``comet``, ``csv_monitor``, dsrun's own
``mlflow``, ``comms_logger`` and ``flops_profiler``.

D8: ``tensorboard.output_path`` and ``csv_monitor.output_path`` default to ``""`` as in DeepSpeed (the
documentation says ``~/tensorboard/`` or null); an empty path means "under the launching directory".
DeepSpeed drops ``"auto"`` values in the four DeepSpeed monitor sections; see :mod:`.auto`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

from pydantic import Field

from .base import NonNegFloat, NonNegInt, PosInt, Section


class TensorBoardConfig(Section):
    """``tensorboard``: events under ``output_path/job_name``. Needs the ``tensorboard`` package."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    """``wandb``: Weights & Biases logging (``team`` is the entity). Needs the ``wandb`` package."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(Section):
    """``comet``: Comet logging. ``experiment_key`` is 32-50 alphanumeric characters; ``mode="get"`` resumes
    the experiment it names. ``online`` None behaves as True and ``mode`` None as ``get_or_create``."""

    enabled: bool = False
    samples_log_interval: PosInt = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: Literal["get", "create", "get_or_create"] | None = None


class CSVMonitorConfig(Section):
    """``csv_monitor``: one CSV file per metric under ``output_path/job_name``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class MLflowConfig(Section):
    """``mlflow`` (dsrun's own section; DeepSpeed has none): log metrics, params and, with
    ``log_artifacts``, the run directory's files to an MLflow tracking server (``tracking_uri`` None means
    MLflow's default, a local ``mlruns`` folder)."""

    enabled: bool = False
    tracking_uri: str | None = None
    experiment_name: str = "dsrun"
    run_name: str | None = None
    log_artifacts: bool = True


class CommsLoggerConfig(Section):
    """``comms_logger``: log every collective (which synchronises it, so it slows training). ``prof_ops``
    restricts profiling to the named ops when ``prof_all`` is false; ``debug`` adds the caller's name."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)


class FlopsProfilerConfig(Section):
    """``flops_profiler``: profile one step (``profile_step``); enabling it also turns on
    ``wall_clock_breakdown``. ``module_depth`` -1 means all depths; ``output_file`` None means stdout.
    ``recompute_fwd_factor`` (undocumented, DeepSpeed default 0.0) counts recomputed forward flops."""

    enabled: bool = False
    recompute_fwd_factor: NonNegFloat = 0.0
    profile_step: PosInt = 1
    module_depth: Annotated[int, Field(ge=-1)] = -1
    top_modules: NonNegInt = 1
    detailed: bool = True
    output_file: str | None = None


CSVConfig = CSVMonitorConfig  # DeepSpeed's class name (deepspeed.monitor.config is this module)


class DeepSpeedMonitorConfig(Section):
    """``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet``; ``enabled`` when any of them is."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    comet: CometConfig = Field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        return any(s.enabled for s in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))


def get_monitor_config(param_dict: Mapping[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor sections of a DeepSpeed config dict."""
    names = ("tensorboard", "wandb", "csv_monitor", "comet")
    return DeepSpeedMonitorConfig(**{name: param_dict.get(name) or {} for name in names})
