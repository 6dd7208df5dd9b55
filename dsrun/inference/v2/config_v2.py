"""``deepspeed.inference.v2.config_v2``: the ragged inference engine's config."""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from dsrun.config.config_utils import DeepSpeedConfigModel

from .ragged import DSStateManagerConfig


class DeepSpeedTPConfig(DeepSpeedConfigModel):
    tp_size: int = 1
    """Devices the model is split over with tensor parallelism."""


class QuantizationConfig(DeepSpeedConfigModel):
    quantization_mode: Optional[str] = None
    """None, or ``"wf6af16"``: FP6 weights, FP16 activations."""

    @field_validator("quantization_mode")
    @classmethod
    def _known_mode(cls, mode: Optional[str]) -> Optional[str]:
        if mode not in (None, "wf6af16"):
            raise ValueError(f"quantization_mode: expected None or 'wf6af16', got {mode!r}")
        return mode


class RaggedInferenceEngineConfig(DeepSpeedConfigModel):
    tensor_parallel: DeepSpeedTPConfig = Field({}, alias="tp")
    state_manager: DSStateManagerConfig = Field({}, alias="manager")
    quantization: QuantizationConfig = {}
