"""Precision sections: ``fp16``, ``bf16`` (old name ``bfloat16``), ``amp`` and ``data_types``.

fp16, bf16 and amp exclude one another, and amp excludes ZeRO; those rules live in :mod:`.rules`.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .base import NonNegFloat, NonNegInt, RawValue, Section, TorchDTypeName


class FP16Config(Section):
    """``fp16``: mixed precision with DeepSpeed's loss scaler (Apex O2-like, not Apex itself).

    ``loss_scale`` 0 selects dynamic scaling starting at ``2**initial_scale_power``. Defaults follow
    DeepSpeed (config-keys.md §6 D3): ``initial_scale_power`` 16 and ``min_loss_scale`` 1, not the old
    documentation's 32 and 1000. ``min_loss_scale`` is a float because DeepSpeed passes it to the scaler
    unchanged and real configs write values such as ``1e-4``.
    """

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: NonNegFloat = 0.0
    initial_scale_power: NonNegInt = 16
    # any number while unused (a static scale, or fp16 off), as DeepSpeed 0.19.8 takes them; > 0 once the
    # dynamic scaler runs (the model validator below)
    loss_scale_window: int = 1000
    hysteresis: NonNegInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    # Undocumented but read by DeepSpeed; requires ZeRO stage 2 (see rules).
    fp16_master_weights_and_grads: bool = False

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    # DeepSpeed 0.19.8's checks: no bool, infinity or NaN slips through as a number (pydantic would read
    # True as 1), and the dynamic scaler's window and floor are positive when it runs (a window of 0 divides
    # by zero, a floor of 0 lets the scale collapse).
    @field_validator("loss_scale", mode="before")
    @classmethod
    def _finite_loss_scale(cls, value: RawValue) -> RawValue:
        if isinstance(value, bool):
            raise ValueError("fp16.loss_scale must be a number, not bool")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError("fp16.loss_scale must be a number") from None
        if not math.isfinite(number):
            raise ValueError("fp16.loss_scale must be a finite number (not inf/-inf/nan)")
        return value

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _finite_scaler_setting(cls, value: RawValue, info: ValidationInfo) -> RawValue:
        name = f"fp16.{info.field_name}"
        if isinstance(value, bool):
            raise ValueError(f"{name} must be a number, not bool")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number (not inf/-inf/nan)")
        return value

    @model_validator(mode="after")
    def _dynamic_scaler_settings_positive(self) -> "FP16Config":
        if self.enabled and self.dynamic_loss_scale:
            for name in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"fp16.{name} must be > 0 when dynamic loss scaling is enabled (loss_scale=0)")
        return self


class BF16Config(Section):
    """``bf16``: bfloat16 training; no loss scaling. Needs hardware support on GPUs.

    ``immediate_grad_update`` (undocumented in the seed docs, read by DeepSpeed's bf16 optimizer: ZeRO 1 with
    ``data_types.grad_accum_dtype`` fp32, ``dsrun/zero/grad_accum.py``) and the later-documented
    ``bf16_master_weights_and_grads`` / ``bf16_optimizer_states`` (docs/precision.md).
    """

    enabled: bool = False
    immediate_grad_update: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    check_grad_overflow: bool = True


class AMPConfig(Section):
    """``amp``: NVIDIA Apex AMP. Every key but ``enabled`` is passed to ``apex.amp.initialize`` unchanged,
    so this section is an open dict (e.g. ``opt_level``); amp excludes fp16, bf16 and ZeRO.
    """

    model_config = ConfigDict(extra="allow")

    enabled: bool = False

    @property
    def params(self) -> dict[str, Any]:
        """The keyword arguments for ``apex.amp.initialize``."""
        return dict(self.model_extra or {})

    def to_ds_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, **self.params}


class DataTypesConfig(Section):
    """``data_types``: ``grad_accum_dtype`` (None = DeepSpeed decides: fp32 for bf16 without ZeRO, else the
    model dtype; see :meth:`DSConfig.resolved_grad_accum_dtype`; dsrun's strategies then accumulate in
    :attr:`DSConfig.native_grad_accum_dtype`, and in the named dtype when it is another:
    ``dsrun/zero/grad_accum.py``)."""

    grad_accum_dtype: TorchDTypeName | None = Field(default=None)
    param_dtype: TorchDTypeName | None = None
    buffer_dtype: TorchDTypeName | None = None
    keep_in_fp32_modules: Literal["auto"] | list[str] = "auto"
