"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` section's model under DeepSpeed's names."""
from __future__ import annotations

from enum import IntEnum

from dsrun.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from dsrun.runtime.zero.offload_config import OffloadDeviceEnum

DeepSpeedZeroConfig = ZeroConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class ZeroStageEnum(IntEnum):
    """The ``zero_optimization.stage`` values."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]
