"""``deepspeed.monitor.config``: the monitor sections' models under DeepSpeed's names, and
:class:`DeepSpeedMonitorConfig`, the four sections together (``ds_config.monitor_config``)."""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field

from dsrun.config.monitoring import CometConfig, CSVMonitorConfig, TensorBoardConfig, WandbConfig

CSVConfig = CSVMonitorConfig  # DeepSpeed's class name


class DeepSpeedMonitorConfig(BaseModel):
    """``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet``; ``enabled`` when any of them is."""

    model_config = ConfigDict(extra="forbid")

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


__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig",
           "get_monitor_config"]
