"""``deepspeed.runtime.precision_config``: the precision sections read from a raw config dict."""
from __future__ import annotations

from typing import Any, Mapping

from dsrun.config.precision import BF16Config, FP16Config


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> BF16Config:
    """The ``bf16`` section (DeepSpeed also reads the older name ``bfloat16``), defaults when absent."""
    section = param_dict.get("bf16", param_dict.get("bfloat16", {}))
    return BF16Config.model_validate(section or {})


def get_float16_config(param_dict: Mapping[str, Any]) -> FP16Config:
    """The ``fp16`` section, defaults when absent."""
    return FP16Config.model_validate(param_dict.get("fp16") or {})


def get_bfloat16_enabled(param_dict: Mapping[str, Any]) -> bool:
    return bool(get_bfloat16_config(param_dict).enabled)


def get_fp16_enabled(param_dict: Mapping[str, Any]) -> bool:
    return bool(get_float16_config(param_dict).enabled)
