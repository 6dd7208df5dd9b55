"""The top-level ``weight_quantization`` section (ZeRO-Inference's group-wise weight quantization) acts: at
``dsrun.initialize`` and in ``zero.Init``, weights are stored in ``num_bits`` per value plus a scale and a minimum
per group, and a layer computes with the dequantized weight.

Bounds from the arithmetic: each weight comes back within half its group's step, ``(max - min) / (2**bits - 1) / 2``
(at most ``max|w| / (2**bits - 1)``), so an output of a linear layer moves by at most ``sum_j |x_j| * step_ij / 2``,
plus fp32 rounding of the two sums (``n * eps`` of ``sum_j |x_j w_ij|``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsrun
from dsrun.config import load_ds_config, validate_ds_config
from dsrun.inference.quantization import QuantizedLinear
from dsrun.ops.groupwise_quant import dequantized
from dsrun.zero.partitioner_internals import InsertPostInitMethodToModuleSubClasses

pytestmark = pytest.mark.usefixtures("world_of_one")
RULE = {"group_size": 16, "group_dim": 1, "symmetric": False}


@pytest.fixture(autouse=True)
def _restore_process_patches(monkeypatch):
    """Quantization wraps F.linear, F.embedding and the layers' state-dict loading for the rest of the process, as
    DeepSpeed's does: put them back after each test."""
    monkeypatch.setattr(F, "linear", F.linear)
    monkeypatch.setattr(F, "embedding", F.embedding)
    for cls in (nn.Linear, nn.Embedding):
        monkeypatch.setattr(cls, "_load_from_state_dict", cls._load_from_state_dict)
    if "linear_bk" in vars(InsertPostInitMethodToModuleSubClasses):
        monkeypatch.setattr(InsertPostInitMethodToModuleSubClasses, "linear_bk",
                            InsertPostInitMethodToModuleSubClasses.linear_bk)
    else:
        monkeypatch.delattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", raising=False)
        yield
        if "linear_bk" in vars(InsertPostInitMethodToModuleSubClasses):
            del InsertPostInitMethodToModuleSubClasses.linear_bk
        return
    yield


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(16, 32), nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids)))).square().mean()


def _config(section: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "weight_quantization": section, **extra}


def _linear_bound(x: torch.Tensor, w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per output: sum_j |x_j| * step_ij / 2 plus the fp32 rounding of both products' sums."""
    grouped = w.double().reshape(w.shape[0], -1, RULE["group_size"])
    step = ((grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / (2**bits - 1)).expand_as(grouped)
    x64 = x.double().abs()
    rounding = 2 * w.shape[1] * torch.finfo(torch.float32).eps * (x64 @ (w.double().abs() + step.reshape(w.shape)).T)
    return x64 @ step.reshape(w.shape).T / 2 + rounding


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_initialization_at_initialize_stores_bits_and_computes_within_a_step(bits):
    torch.manual_seed(bits)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    engine = dsrun.initialize(model=model, config=_config({"quantized_initialization": {"num_bits": bits, **RULE}}))[0]
    fc1 = engine.module.fc1
    assert fc1.weight.weight_quantized and not fc1.weight.requires_grad and fc1.bias.requires_grad
    groups = 64 * 32 // RULE["group_size"]
    # the weight's bytes: bits per value, then a float32 scale and minimum per group (vs 4 bytes per value)
    assert fc1.weight.numel() * fc1.weight.element_size() == 64 * 32 * bits // 8 + 2 * groups * 4
    assert type(engine.module.emb) is nn.Embedding and engine.module.emb.weight.weight_quantized
    x = torch.randn(5, 32)
    error = (fc1(x).double() - reference.fc1(x).double()).abs()
    assert (error <= _linear_bound(x, reference.fc1.weight.detach(), bits)).all()
    assert error.max() > 0  # the forward really ran on the quantized weight
    codes = fc1.weight.detach().clone()  # bytes: some read as NaN when seen as float32
    ids = torch.randint(0, 16, (2, 5))
    engine.backward(engine(ids))
    engine.step()
    assert torch.equal(fc1.weight.view(torch.uint8), codes.view(torch.uint8)) and not torch.equal(fc1.bias, reference.fc1.bias)  # the rest trains

    off = dsrun.initialize(model=Net(), config=_config({"enabled": False, "quantized_initialization": {
        "num_bits": bits, **RULE}}))[0]
    assert not hasattr(off.module.fc1.weight, "weight_quantized") and off.module.fc1.weight.shape == (64, 32)


def test_post_init_quant_at_initialize_replaces_the_named_layers_in_the_engine_dtype():
    torch.manual_seed(0)
    engine = dsrun.initialize(model=Net(), config=_config({"post_init_quant": {"fc1": {"num_bits": 8, **RULE}}},
                                                          bf16={"enabled": True}))[0]
    fc1 = engine.module.fc1
    assert type(fc1) is QuantizedLinear and fc1.weight.dtype == torch.bfloat16
    assert type(engine.module.fc2) is nn.Linear and engine.module.fc2.weight.shape == (8, 64)
    assert fc1.weight.numel() * 2 == 64 * 32 + 2 * (64 * 32 // RULE["group_size"]) * 2  # int8 + bf16 scale/min
    engine.backward(engine(torch.randint(0, 16, (2, 5))))
    engine.step()
    # a weight quantized in float32 before a bf16 engine: its bytes would be cast as numbers
    early = Net()
    dsrun.inference.quantization._init_group_wise_weight_quantization(
        early, {"weight_quantization": {"post_init_quant": {"fc2": {"num_bits": 8, **RULE}}}})
    with pytest.raises(ValueError, match="quantized in torch.float32 but the engine casts"):
        dsrun.initialize(model=early, config=_config({"post_init_quant": {"fc1": {"num_bits": 8, **RULE}}},
                                                     bf16={"enabled": True}))


def test_zero_init_quantizes_each_weight_before_partitioning_it():
    from dsrun.zero import GatheredParameters, Init
    from dsrun.zero.linear import zero3_linear_wrap

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "weight_quantization": {"quantized_initialization": {"num_bits": 8, **RULE}}}
    with Init(config_dict_or_path=config):
        layer = nn.Linear(32, 4)
    assert layer.weight.weight_quantized and F.linear.__wrapped__ is zero3_linear_wrap  # over ZeRO-3's linear
    # the partitioned parameter is the quantized layout: int8 codes, then a float32 scale and minimum per group
    assert layer.weight.ds_numel * 4 == 4 * 32 + 2 * (4 * 32 // RULE["group_size"]) * 4
    full = torch.randn(4, 32)
    with GatheredParameters([layer.weight, layer.bias], modifier_rank=0):
        layer.load_state_dict({"weight": full, "bias": torch.zeros(4)})  # a float weight is quantized as it loads
    x = torch.randn(3, 32)
    with GatheredParameters([layer.weight, layer.bias]):
        assert ((layer(x).double() - x.double() @ full.double().T).abs() <= _linear_bound(x, full, 8)).all()
        back = dequantized(layer.weight)
    assert back.shape == (4, 32)
    with pytest.raises(ValueError, match="partitioned by zero.Init without it"):
        with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            plain = Net()
        dsrun.initialize(model=plain, config=_config({"quantized_initialization": {"num_bits": 8, **RULE}},
                                                     zero_optimization={"stage": 3}))


def test_unknown_or_unsupported_keys_are_refused_with_one_line_each():
    base = {"train_micro_batch_size_per_gpu": 1}
    rule = {"num_bits": 8, **RULE}
    for section, path in [({"bits": 8}, "weight_quantization.bits"),
                          ({"quantized_initialization": {**rule, "bits": 8}},
                           "weight_quantization.quantized_initialization.bits"),
                          ({"post_init_quant": {"fc": {**rule, "num_bits": 3}}},
                           "weight_quantization.post_init_quant.fc.num_bits"),
                          ({"quantized_initialization": {**rule, "symmetric": True}},
                           "weight_quantization.quantized_initialization.symmetric")]:
        (problem,) = validate_ds_config({**base, "weight_quantization": section})
        assert problem.path == path
    assert validate_ds_config({**base, "weight_quantization": {"quantized_initialization": {}}}) == []
    (missing,) = validate_ds_config({**base, "weight_quantization": {"post_init_quant": {"fc": {"num_bits": 8}}}})
    assert missing.path == "weight_quantization.post_init_quant.fc.group_size"  # group_dim defaults to 1
    written = load_ds_config({**base, "weight_quantization": {"quantized_initialization": {}}}, 1).to_ds_dict()
    assert written["weight_quantization"] == {"quantized_initialization": {}}  # DeepSpeed's "off": a dict, not null


def test_an_initialisation_after_build_sets_a_quantized_weights_values():
    """A parent that re-initialises its layers after they were built (``reset_parameters``, Hugging Face's
    ``_init_weights`` through ``module.apply``) sets the values it means: the codes are re-quantized from them."""
    from dsrun.zero import GatheredParameters, Init

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 4)
            nn.init.constant_(self.fc.weight, 0.5)  # each group constant: comes back exactly
            self.apply(lambda m: m.weight.data[:, :16].fill_(-2.0) if isinstance(m, nn.Linear) else None)

    config = {"zero_optimization": {"stage": 3},
              "weight_quantization": {"quantized_initialization": {"num_bits": 4, **RULE}}}
    with Init(config_dict_or_path=config):
        model = Parent()
    with GatheredParameters(model.fc.weight):
        assert model.fc.weight.weight_quantized
        assert torch.equal(dequantized(model.fc.weight)[:, :16], torch.full((4, 16), -2.0))
        assert torch.equal(dequantized(model.fc.weight)[:, 16:], torch.full((4, 16), 0.5))


def test_a_checkpoint_resumes_the_codes_at_stages_0_and_3(tmp_path):
    """The quantized layout is saved and loaded as it is (not quantized twice), and a ZeRO-3 engine after one
    without ZeRO-3 in the same process still dequantizes (ZeRO-3's linear goes under the quantized wrapper)."""
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    for stage in (0, 3):
        config = _config({"quantized_initialization": {"num_bits": 4, **RULE}}, zero_optimization={"stage": stage})
        torch.manual_seed(0)
        engine = dsrun.initialize(model=Net(), config=config)[0]
        engine.backward(engine(ids))
        engine.step()
        engine.save_checkpoint(str(tmp_path / str(stage)), tag="t")
        torch.manual_seed(1)
        resumed = dsrun.initialize(model=Net(), config=config)[0]
        resumed.load_checkpoint(str(tmp_path / str(stage)), tag="t")
        for saved, loaded in zip(engine.module.state_dict().values(), resumed.module.state_dict().values()):
            assert torch.equal(saved.view(torch.uint8), loaded.view(torch.uint8))
        assert torch.equal(engine(ids), resumed(ids))
