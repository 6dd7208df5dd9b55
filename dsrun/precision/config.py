"""``deepspeed.runtime.precision_config``: the precision sections read from a raw config dict."""
from __future__ import annotations

from typing import Any, Mapping

from dsrun.config import ds_section
from dsrun.config.precision import BF16Config, FP16Config

#: DeepSpeed's names for the two section models (``DeepSpeedFP16Config(enabled=True, loss_scale=0, ...)``)
DeepSpeedFP16Config = FP16Config
DeepSpeedBF16Config = BF16Config


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> BF16Config:
    """The ``bf16`` section (DeepSpeed also reads the older name ``bfloat16``), defaults when absent."""
    return ds_section(param_dict, "bf16")  # the legacy name is migrated there


def get_float16_config(param_dict: Mapping[str, Any]) -> FP16Config:
    """The ``fp16`` section, defaults when absent."""
    return ds_section(param_dict, "fp16")


def get_bfloat16_enabled(param_dict: Mapping[str, Any]) -> bool:
    return bool(get_bfloat16_config(param_dict).enabled)


def get_fp16_enabled(param_dict: Mapping[str, Any]) -> bool:
    return bool(get_float16_config(param_dict).enabled)
