"""``data_types.param_dtype`` and ``data_types.buffer_dtype`` with DeepSpeed's meaning: the parameters' dtype
must be the one fp16/bf16 gives them (a conflict is refused, as DeepSpeed's engine asserts), and buffer_dtype
casts every floating-point buffer after the model's cast (a rotary table kept fp32)."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.config import validate_ds_config

pytestmark = pytest.mark.usefixtures("world_of_one")


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))


def _engine(data_types: dict, precision: str = "bf16"):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              precision: {"enabled": True}, "data_types": data_types}
    return dsrun.initialize(model=WithBuffers(), config=config)[0]


def test_param_dtype_must_match_the_precision():
    engine = _engine({"param_dtype": "bf16"})
    assert engine.module.linear.weight.dtype == torch.bfloat16
    base = {"train_micro_batch_size_per_gpu": 1}
    (conflict,) = validate_ds_config({**base, "bf16": {"enabled": True}, "data_types": {"param_dtype": "fp32"}})
    assert conflict.path == "data_types.param_dtype" and "bf16" in conflict.message
    (fp32_model,) = validate_ds_config({**base, "data_types": {"param_dtype": "torch.bfloat16"}})
    assert "fp32" in fp32_model.message
    assert validate_ds_config({**base, "fp16": {"enabled": True}, "data_types": {"param_dtype": "half"}}) == []


def test_buffer_dtype_casts_the_buffers():
    cast = _engine({})
    assert cast.module.inv_freq.dtype == torch.bfloat16  # unset: the model's cast takes the buffers along
    kept = _engine({"buffer_dtype": "fp32"})
    assert kept.module.inv_freq.dtype == torch.float32 and kept.module.linear.weight.dtype == torch.bfloat16
    assert torch.equal(kept.module.inv_freq, WithBuffers().inv_freq)  # exact, not a bf16 round trip
    assert kept.module.mask.dtype == torch.bool  # not floating point: never cast
    assert _engine({"buffer_dtype": "bf16"}, "fp16").module.inv_freq.dtype == torch.bfloat16
