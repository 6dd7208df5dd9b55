"""The torch_autocast section: the forward runs under torch.autocast in its dtype (parameters stay fp32), and
the lower-precision-safe modules' parameters get comm_dtype, so ZeRO-0 reduces their gradients in that dtype."""
from __future__ import annotations

import pytest
import torch

import dsrun

pytestmark = pytest.mark.usefixtures("world_of_one")


def _engine(section=None):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if section is not None:
        config["torch_autocast"] = section
    return dsrun.initialize(model=model, config=config)[0]


def test_torch_autocast_runs_linear_layers_in_bf16():
    x = torch.randn(2, 4)
    off, on = _engine(), _engine({"enabled": True})
    assert off(x).dtype == torch.float32 and on(x).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in on.module.parameters())
    on.backward(on(x).float().sum())
    on.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the section decides inside the engine's forward
        assert off(x).dtype == torch.float32 and on(x).dtype == torch.bfloat16


def test_torch_autocast_dtype_and_safe_modules():
    x = torch.randn(2, 4)
    fp16 = _engine({"enabled": True, "dtype": "fp16"})
    assert fp16(x).dtype == torch.float16
    assert [getattr(p, "comm_dtype", None) for p in fp16.module[0].parameters()] == [torch.float16] * 2
    default = _engine({"enabled": True})
    marked = [n for n, p in default.module.named_parameters() if hasattr(p, "comm_dtype")]
    assert marked == ["0.weight", "0.bias", "2.weight", "2.bias"]  # Linear, not LayerNorm
    only_norm = _engine({"enabled": True, "lower_precision_safe_modules": ["torch.nn.LayerNorm"]})
    marked = {n: p.comm_dtype for n, p in only_norm.module.named_parameters() if hasattr(p, "comm_dtype")}
    assert marked == {"1.weight": torch.bfloat16, "1.bias": torch.bfloat16}
    # ZeRO-0 reduces the marked parameters' gradients in bf16, the rest in fp32: the bucket's pieces
    strategy = only_norm.strategy
    (bucket,) = strategy.queue.buckets
    dtypes = [dtype for _, _, dtype in strategy._comm_dtype_runs(bucket)]
    assert dtypes == [torch.float32, torch.bfloat16, torch.float32]
    assert default.strategy._comm_dtype_runs(bucket) is not None and _engine().strategy._comm_dtype_runs(bucket) is None


@pytest.mark.parametrize("spelling, dtype", [("torch.bfloat16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                             ("torch.float16", torch.float16), ("half", torch.float16),
                                             (torch.bfloat16, torch.bfloat16)])
def test_torch_autocast_dtype_takes_deepspeeds_spellings(spelling, dtype):
    """DeepSpeedExamples' bf16_full.json writes "torch.bfloat16"; DeepSpeed's DtypeEnum takes it, so does dsrun."""
    engine = _engine({"enabled": True, "dtype": spelling})
    assert engine.torch_autocast_dtype() == dtype and engine(torch.randn(2, 4)).dtype == dtype
    assert engine._config.torch_autocast.dtype == {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def test_data_types_take_deepspeeds_spellings_and_a_bad_one_names_the_key():
    from dsrun.config import load_ds_config
    from dsrun.utils.errors import ConfigError

    cfg = load_ds_config({"train_micro_batch_size_per_gpu": 1, "data_types": {"grad_accum_dtype": "torch.float32"}})
    assert cfg.data_types.grad_accum_dtype == "fp32"
    with pytest.raises(ConfigError, match=r"torch_autocast.dtype: got 'int8'; allowed: 'fp16', 'bf16' or 'fp32'"):
        load_ds_config({"train_micro_batch_size_per_gpu": 1, "torch_autocast": {"enabled": True, "dtype": "int8"}})
