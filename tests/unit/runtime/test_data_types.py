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


class Island(torch.nn.Module):
    """A module wholly kept fp32: it records the dtype its forward receives."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1.0 + 2.0 ** -12))  # rounds to 1.0 in bf16
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.proj(x) * self.scale


class WithIsland(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.mid, self.last = torch.nn.Linear(4, 4), Island(), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.mid(self.first(x)))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                               num_heads=2, decoder_start_token_id=0))


def test_keep_in_fp32_modules_keeps_the_listed_modules_fp32():
    from dsrun.utils.errors import ConfigError

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "bf16": {"enabled": True}, "data_types": {"keep_in_fp32_modules": ["mid"]}}
    model = WithIsland()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = dsrun.initialize(model=model, config=config)[0]
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes == {"first.weight": torch.bfloat16, "first.bias": torch.bfloat16, "mid.proj.weight": torch.float32,
                      "mid.proj.bias": torch.float32, "last.weight": torch.bfloat16, "last.bias": torch.bfloat16}
    assert torch.equal(model.mid.proj.weight, initial["mid.proj.weight"])  # the loaded values, not a bf16 trip
    assert model.mid.scale.dtype == torch.float32 and model.mid.scale[0] != 1.0
    out = engine(torch.randn(3, 4, dtype=torch.bfloat16))
    assert model.mid.seen == [torch.float32] and out.dtype == torch.bfloat16  # fp32 inside, the caller's outside
    # Hugging Face's match: an entry is searched in the names; one that matches none is refused with the nearest
    with pytest.raises(ConfigError) as refused:
        dsrun.initialize(model=WithIsland(), config={**config, "data_types": {"keep_in_fp32_modules": ["mdi"]}})
    assert str(refused.value).count("\n") == 0 and "'mdi'" in str(refused.value) and "mid" in str(refused.value)
    # 16-bit masters would step the kept tensors (proj.weight, proj.bias, scale) in 16 bits: refused
    bf16_masters = {**config, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "bf16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    with pytest.raises(ConfigError, match="keep_in_fp32_modules: keeps 3 parameters and buffers fp32, but the master"):
        dsrun.initialize(model=WithIsland(), config=bf16_masters)
    # "auto": the model's own lists where Hugging Face applies them (T5's ["wo"]: under fp16, not bf16)
    auto = {**config, "data_types": {}}
    t5 = _t5()
    dsrun.initialize(model=t5, config=auto)
    assert {p.dtype for p in t5.parameters()} == {torch.bfloat16}
    t5 = _t5()
    dsrun.initialize(model=t5, config={**auto, "bf16": {"enabled": False}, "fp16": {"enabled": True}})
    kept = {n for n, p in t5.named_parameters() if p.dtype == torch.float32}
    assert kept and all(".wo." in n for n in kept) and len(kept) == 2  # the encoder's and the decoder's wo
    assert {p.dtype for n, p in t5.named_parameters() if n not in kept} == {torch.float16}


def test_keep_in_fp32_modules_beside_torch_autocast_is_refused():
    """torch_autocast would run the kept modules' forward in its 16-bit dtype (and reduce its safe modules'
    gradients in it): a listed module is refused by the config check, what "auto" keeps by the engine's cast."""
    from dsrun.utils.errors import ConfigError

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "torch_autocast": {"enabled": True}, "data_types": {"keep_in_fp32_modules": ["mid"]}}
    for precision in ({}, {"bf16": {"enabled": True}}):  # an fp32 model too: autocast would compute it in bf16
        problems = validate_ds_config({**config, **precision})
        assert [str(p) for p in problems] == [
            "data_types.keep_in_fp32_modules: keeps modules fp32, but torch_autocast.enabled runs their forward in "
            "the autocast dtype too (and reduces its safe modules' gradients in it) (turn torch_autocast off (bf16 "
            "or fp16 alone keeps the listed modules fp32), or set data_types.keep_in_fp32_modules to [])"]
    auto = {**config, "fp16": {"enabled": True}, "data_types": {}}
    with pytest.raises(ConfigError, match="keep_in_fp32_modules: keeps modules fp32, but torch_autocast"):
        dsrun.initialize(model=_t5(), config=auto)  # T5's own ["wo"] under fp16
    engine = dsrun.initialize(model=WithIsland(), config=auto)[0]  # "auto" keeping nothing: autocast as usual
    assert engine.torch_autocast_enabled() and {p.dtype for p in engine.module.parameters()} == {torch.float16}
