"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` section's model under DeepSpeed's names.

:class:`DeepSpeedZeroConfig` is dsrun's :class:`~dsrun.config.zero.ZeroConfig` built the way DeepSpeed's is,
from one ``zero_optimization`` dict: deprecated keys are migrated as in a whole config (``cpu_offload`` ->
``offload_optimizer``, ...), DeepSpeed's attribute names (``prefetch_bucket_size``,
``gather_16bit_weights_on_model_save``: its fields drop the ``stage3_`` prefix) read the same values, and
``offload_param`` / ``offload_optimizer`` are None when the dict has no such section, as in DeepSpeed.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Any

from pydantic import model_validator

from dsrun.config.migrate import STAGE3_ALIASES, migrate_legacy
from dsrun.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from dsrun.zero.offload_config import OffloadDeviceEnum

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class DeepSpeedZeroConfig(ZeroConfig):
    """``zero_optimization`` as DeepSpeed's object (see the module docstring)."""

    offload_param: OffloadParamConfig | None = None  # type: ignore[assignment]
    offload_optimizer: OffloadOptimizerConfig | None = None  # type: ignore[assignment]

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: object) -> object:  # the raw section, whatever was passed
        if not isinstance(data, dict):
            return data
        migrated, problems, _ = migrate_legacy({"zero_optimization": dict(data)})
        if problems:
            raise ValueError("; ".join(f"{p.path}: {p.message}" for p in problems))
        return migrated["zero_optimization"]

    def __getattr__(self, name: str) -> Any:
        if name in STAGE3_ALIASES:
            return getattr(self, STAGE3_ALIASES[name])
        return super().__getattr__(name)  # type: ignore[misc]

    @property
    def offload_optimizer_device(self) -> str:
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"

    @property
    def offload_param_device(self) -> str:
        return self.offload_param.device if self.offload_param is not None else "none"


class ZeroStageEnum(IntEnum):
    """The ``zero_optimization.stage`` values."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]
