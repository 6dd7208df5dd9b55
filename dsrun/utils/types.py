"""``deepspeed.utils.types``: the activation and norm kinds DeepSpeed's inference kernels take as integers."""
from __future__ import annotations

from enum import IntEnum


class ActivationFuncType(IntEnum):
    UNKNOWN = 0
    GELU = 1
    ReLU = 2
    GATED_GELU = 3
    GATED_SILU = 4


#: the kinds whose input holds the value half and the gate half side by side (``out = value * act(gate)``)
GATED_ACTIVATION_TYPES = [ActivationFuncType.GATED_GELU, ActivationFuncType.GATED_SILU]


class NormType(IntEnum):
    UNKNOWN = 0
    LayerNorm = 1
    GroupNorm = 2
    RMSNorm = 3
