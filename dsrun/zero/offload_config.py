"""``deepspeed.runtime.zero.offload_config``: the offload sections' models, the device names they take and the
state names ``engine.offload_states(include=...)`` takes (both enums live with the code that moves states,
:mod:`dsrun.offload.state_moves`)."""
from __future__ import annotations

from dsrun.config.zero import OffloadOptimizerConfig, OffloadParamConfig
from dsrun.offload.state_moves import OffloadDeviceEnum, OffloadStateTypeEnum

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
