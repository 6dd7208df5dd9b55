"""``deepspeed.runtime.zero.offload_config``: the offload sections' models and the device names they take."""
from __future__ import annotations

from enum import Enum

from dsrun.config.zero import OffloadOptimizerConfig, OffloadParamConfig

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class OffloadDeviceEnum(str, Enum):
    """The ``offload_param.device`` / ``offload_optimizer.device`` values."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]
