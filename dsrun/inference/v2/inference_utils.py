"""DeepSpeed's inference-v2 enums and small helpers (``deepspeed.inference.v2.inference_utils``): the activation
functions, the dtypes under their several spellings, element sizes."""
from __future__ import annotations

from enum import Enum, IntEnum

import torch


class NormTypeEnum(Enum):
    LayerNorm: str = "layer_norm"
    RMSNorm: str = "rms_norm"


class DtypeEnum(Enum):
    """A dtype by any of its names: ``DtypeEnum("half") is DtypeEnum.fp16``; ``.value`` is the torch dtype."""
    fp16 = torch.float16, "torch.float16", "fp16", "float16", "half"
    fp32 = torch.float32, "torch.float32", "fp32", "float32", "float"
    bf16 = torch.bfloat16, "torch.bfloat16", "bf16", "bfloat16", "bfloat"
    int8 = torch.int8, "torch.int8", "int8"

    def __new__(cls, *spellings):
        member = object.__new__(cls)
        member._value_ = spellings[0]  # the torch dtype is the value; the other spellings look it up too
        for other in spellings[1:]:
            cls._value2member_map_[other] = member
        member._all_values = spellings
        return member

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self._name_}: {', '.join(repr(v) for v in self._all_values)}>"


ELEM_SIZES: dict[torch.dtype, int] = {
    torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8, torch.int8: 1, torch.uint8: 1,
    torch.int16: 2, torch.int32: 4, torch.int64: 8, torch.bool: 1,
}


class ActivationType(IntEnum):
    """The activations of DeepSpeed's inference modules (the integer is the kernels' code)."""
    GELU = 0
    RELU = 1
    SILU = 2
    GEGLU = 3
    ReGLU = 4
    SiGLU = 5
    IDENTITY = 6
    InvalidType = -1


def is_gated(act_fn: ActivationType) -> bool:
    """Whether ``act_fn`` is a gated activation (its input holds gate and value channels, interleaved)."""
    return ActivationType(act_fn) in (ActivationType.GEGLU, ActivationType.ReGLU, ActivationType.SiGLU)


def elem_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    try:
        return ELEM_SIZES[dtype]
    except KeyError:
        raise ValueError(f"Unknown dtype size for {dtype}") from None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
