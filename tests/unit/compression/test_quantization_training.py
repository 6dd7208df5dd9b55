"""Weight and activation quantization in the forward: each key's effect, against fake-quant references."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.compression import compression_scheduler, init_compression, redundancy_clean
from dsrun.models.gpt import GPT

from .conftest import TwoLayer, merge, technique

WQ_FORWARD = {"quantize_weight_in_forward": True, "schedule_offset": 0}


def _start(model, config):
    init_compression(model, config)
    scheduler = compression_scheduler(model)
    scheduler.step(step_zero_check=True)
    return scheduler


def _per_token_reference(x: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    v = x.double()
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = torch.maximum(lo.abs(), hi.abs()) / qmax
        return torch.round(v / scale).clamp(-qmax, qmax) * scale
    levels = 2 ** bits - 1
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = (hi - lo) / levels
    zp = torch.round(-lo / scale)
    return ((torch.round(v / scale) + zp).clamp(0, levels) - zp) * scale


@pytest.mark.parametrize("kind", ["symmetric", "asymmetric"])
def test_dynamic_activation_quantization_matches_a_fake_quant_reference(two_layer, kind):
    config = technique("activation_quantization", {"schedule_offset": 0, "quantization_type": kind,
                                                   "range_calibration": "dynamic"}, {"bits": 8}, ["fc1"])
    _start(two_layer, config)
    x = torch.randn(3, 5, 16)
    ref = F.linear(_per_token_reference(x, 8, kind == "symmetric").float(), two_layer.fc1.weight, two_layer.fc1.bias)
    got = two_layer.fc1(x)
    assert (got - ref).abs().max() <= 1e-6 * max(1.0, ref.abs().max().item())
    assert not torch.allclose(got, F.linear(x, two_layer.fc1.weight, two_layer.fc1.bias), atol=1e-6)


def test_static_range_is_a_momentum_average_fixed_in_eval(two_layer):
    config = technique("activation_quantization", {"schedule_offset": 0, "range_calibration": "static",
                                                   "quantization_type": "asymmetric"}, {"bits": 4}, ["fc1"])
    _start(two_layer, config)
    a, b = torch.rand(4, 16) * 2, torch.rand(4, 16) * 6 - 3
    two_layer.fc1(a)
    assert torch.equal(two_layer.fc1.activation_range, torch.stack([a.min(), a.max()]))
    two_layer.fc1(b)
    expected = 0.95 * torch.stack([a.min(), a.max()]) + 0.05 * torch.stack([b.min(), b.max()])
    assert torch.allclose(two_layer.fc1.activation_range, expected)
    two_layer.eval()
    two_layer.fc1(b * 10)  # eval: the range stays
    assert torch.allclose(two_layer.fc1.activation_range, expected)
    lo, hi = expected
    scale = (hi - lo) / 15
    zp = torch.round(-lo / scale)
    xq = ((torch.round(b / scale) + zp).clamp(0, 15) - zp) * scale
    assert torch.allclose(two_layer.fc1(b), F.linear(xq, two_layer.fc1.weight, two_layer.fc1.bias), atol=1e-6)


def test_activation_bits_and_per_image_ranges_for_conv():
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 3, 3))
    x = torch.randn(2, 2, 5, 5)
    x[1] *= 100  # a per-image range keeps image 0's resolution
    outs = {}
    for bits in (4, 8):
        model = nn.Sequential(nn.Conv2d(2, 3, 3))
        model.load_state_dict(conv.state_dict())
        _start(model, technique("activation_quantization", {"schedule_offset": 0}, {"bits": bits}))
        outs[bits] = model(x)
    exact = conv(x)
    err4, err8 = ((outs[b] - exact).abs().amax(dim=(1, 2, 3)) for b in (4, 8))
    assert (err8 < err4).all() and err8[0] < err8[1] / 10


def test_weight_groups_type_and_bits_each_change_the_weight(two_layer):
    x = torch.randn(4, 16)
    outputs = {}
    for name, shared, params in [("g1-sym-4", {}, {"start_bits": 4, "target_bits": 4}),
                                 ("g4-sym-4", {"quantize_groups": 4}, {"start_bits": 4, "target_bits": 4}),
                                 ("g1-asym-4", {"quantization_type": "asymmetric"}, {"start_bits": 4, "target_bits": 4}),
                                 ("g1-sym-8", {}, {"start_bits": 8, "target_bits": 8})]:
        model = TwoLayer()
        model.load_state_dict(two_layer.state_dict())
        config = technique("weight_quantization", {**WQ_FORWARD, **shared}, params)
        _start(model, config)
        outputs[name] = model(x)
        redundancy_clean(model, config)
        groups = shared.get("quantize_groups", 1)
        rows = model.fc1.weight.reshape(groups, -1)
        original = two_layer.fc1.weight.detach().reshape(groups, -1)
        assert all(len(torch.unique(r)) <= 2 ** params["target_bits"] for r in rows)
        if "sym" in name and "asym" not in name:  # each group on its own grid: multiples of absmax / (2^(b-1)-1)
            steps = original.abs().amax(1, keepdim=True) / (2 ** (params["target_bits"] - 1) - 1)
            assert torch.allclose(rows / steps, torch.round(rows / steps), atol=1e-4)
    assert len({tuple(o.flatten().tolist()) for o in outputs.values()}) == 4
    exact = two_layer(x)
    assert (outputs["g1-sym-8"] - exact).abs().max() < (outputs["g1-sym-4"] - exact).abs().max()


def test_stochastic_rounding_changes_the_forward(two_layer):
    _start(two_layer, technique("weight_quantization", {**WQ_FORWARD, "rounding": "stochastic"},
                                {"start_bits": 4, "target_bits": 4}))
    x = torch.randn(4, 16)
    torch.manual_seed(1)
    first = two_layer(x)
    assert not torch.equal(first, two_layer(x))  # new draws each forward


def test_groups_name_modules_and_first_group_wins(two_layer):
    config = technique("weight_quantization", WQ_FORWARD, {"start_bits": 8, "target_bits": 8}, ["fc2"])
    config["compression_training"]["weight_quantization"]["different_groups"]["g2"] = {
        "params": {"start_bits": 4, "target_bits": 4}, "modules": ["*"]}
    _start(two_layer, config)
    assert two_layer.fc2.ds_compression.weight.bits == 8 and two_layer.fc1.ds_compression.weight.bits == 4


def test_mixed_quantize_blends_the_quantized_share(two_layer):
    config = technique("weight_quantization", {**WQ_FORWARD, "fp16_mixed_quantize": {
        "enabled": True, "quantize_change_ratio": 0.5}}, {"start_bits": 2, "target_bits": 2})
    scheduler = _start(two_layer, config)
    x = torch.randn(3, 16)
    w = two_layer.fc1.weight.detach().clone()
    half = two_layer.fc1(x)
    from dsrun.compression.quantizers import QuantSpec, fake_quantize

    blended = 0.5 * fake_quantize(w, QuantSpec(2)) + 0.5 * w
    assert torch.allclose(half, F.linear(x, blended, two_layer.fc1.bias), atol=1e-6)
    scheduler.step()
    assert torch.allclose(two_layer.fc1(x), F.linear(x, fake_quantize(w, QuantSpec(2)), two_layer.fc1.bias), atol=1e-6)


def test_quantize_verbose_reports_bit_changes(two_layer, capsys):
    scheduler = _start(two_layer, technique("weight_quantization", {**WQ_FORWARD, "quantize_verbose": True},
                                            {"start_bits": 8, "target_bits": 7, "quantization_period": 1}))
    scheduler.step()
    out = capsys.readouterr().out
    assert "fc1: 8-bit weights from step 0" in out and "fc1: 7-bit weights from step 1" in out


def test_quantizer_kernel_computes_the_same_quantization(two_layer):
    """``quantizer_kernel`` picks DeepSpeed's CUDA kernel there; dsrun has one quantizer (no effect by design)."""
    x = torch.randn(3, 16)
    outs = []
    for kernel in (False, True):
        model = TwoLayer()
        model.load_state_dict(two_layer.state_dict())
        _start(model, technique("weight_quantization", {**WQ_FORWARD, "quantizer_kernel": kernel},
                                {"start_bits": 4, "target_bits": 4}))
        outs.append(model(x))
    assert torch.equal(*outs)


def test_tied_gpt_embedding_is_quantized_once_and_the_head_follows():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    config = merge(technique("weight_quantization", WQ_FORWARD, {"start_bits": 4, "target_bits": 4}),
                   technique("activation_quantization", {"schedule_offset": 0}, {"bits": 8}))
    _start(model, config)
    assert model.lm_head.ds_compression.weight_owner is model.transformer["wte"]
    model.eval()
    tokens = torch.randint(0, 64, (2, 8))
    simulated = model(tokens)
    redundancy_clean(model, config)
    assert model.lm_head.weight is model.transformer["wte"].weight
    rows = model.lm_head.weight
    assert all(len(torch.unique(r)) <= 16 for r in rows)  # per-token groups for the embedding
    assert torch.allclose(model(tokens), simulated, atol=1e-5)
