"""The flops profiler counts what the formulas say, matches the analytic GPT count, and prints
DeepSpeed's report layout with its arithmetic invariants."""
from __future__ import annotations

import re
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.models.accounting import forward_flops
from dsrun.models.gpt import GPT
from dsrun.profiling.flops_profiler import (FlopsProfiler, duration_to_string, flops_to_string, get_model_profile,
                                            macs_to_string, number_to_string, params_to_string)


def test_linear_only_model_is_exactly_two_flops_per_mac_and_in_times_out_per_token():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False))
    x = torch.randn(4, 5, 16)
    flops, macs, params = get_model_profile(model, args=[x], print_profile=False, warm_up=0)
    tokens = 4 * 5
    assert macs == tokens * 16 * 32 + tokens * 32 * 8
    assert flops == 2 * macs
    assert params == 16 * 32 + 32 + 32 * 8


@pytest.mark.parametrize("sizes", [dict(n_layer=3, n_head=4, n_embd=96, block_size=128),
                                   dict(n_layer=4, n_head=4, n_embd=128, block_size=256)])
def test_gpt_forward_flops_within_one_percent_of_the_analytic_count(sizes):
    torch.manual_seed(0)
    model = GPT(vocab_size=256, **sizes)
    batch, seq = 2, sizes["block_size"]
    idx = torch.randint(0, 256, (batch, seq))
    flops, macs, params = get_model_profile(model, args=[idx], print_profile=False, warm_up=0)
    analytic = forward_flops(model, batch, seq)
    assert abs(flops - analytic) / analytic < 0.01
    assert params == sum(p.numel() for p in model.parameters())


def test_formulas_for_conv_attention_matmul_operator_and_norms():
    prof_model = nn.Module()
    prof = FlopsProfiler(prof_model)
    prof.start_profile()
    try:
        x = torch.randn(2, 3, 8, 8)
        w = torch.randn(4, 3, 3, 3)
        F.conv2d(x, w, torch.zeros(4), padding=1)  # out 2x4x8x8, 27 MACs each, plus the bias adds
        conv = prof.get_total_macs(), prof.get_total_flops()
        prof.reset_profile()
        q = torch.randn(2, 4, 10, 8)
        F.scaled_dot_product_attention(q, torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 6))
        sdpa = prof.get_total_flops()
        prof.reset_profile()
        torch.randn(3, 5) @ torch.randn(5, 7)
        matmul = prof.get_total_macs()
        prof.reset_profile()
        F.layer_norm(torch.randn(4, 10), (10,), torch.ones(10), torch.zeros(10))
        F.max_pool2d(torch.randn(1, 1, 4, 4), 2)  # dispatches internally; counted once
        norm_pool = prof.get_total_flops()
    finally:
        prof.end_profile()
    assert conv == (2 * 4 * 8 * 8 * 27, 2 * 2 * 4 * 8 * 8 * 27 + 2 * 4 * 8 * 8)
    assert sdpa == 2 * (2 * 4 * 10 * 8 * 12 + 2 * 4 * 10 * 12 * 6)
    assert matmul == 3 * 5 * 7
    assert norm_pool == 40 * 5 + 16


def test_profiling_leaves_torch_as_it_was():
    originals = (F.linear, torch.matmul, torch.Tensor.add, "__matmul__" in vars(torch.Tensor))
    prof = FlopsProfiler(nn.Linear(2, 2))
    prof.start_profile()
    assert F.linear is not originals[0]
    prof.end_profile()
    assert (F.linear, torch.matmul, torch.Tensor.add, "__matmul__" in vars(torch.Tensor)) == originals
    # and nothing is counted once the profile is over
    prof.model(torch.randn(3, 2))
    assert prof.get_total_flops() == 0


def test_number_formats_match_deepspeeds_documented_output():
    assert params_to_string(336.23e6) == "336.23 M"
    assert params_to_string(1.05e6) == "1.05 M"
    assert macs_to_string(3139.93e9) == "3139.93 GMACs"
    assert macs_to_string(10.74e9) == "10.74 GMACs"
    assert number_to_string(6279.86e9) == "6279.86 G"
    assert flops_to_string(81.9e12) == "81.9 TFLOPS"
    assert duration_to_string(0.07667) == "76.67 ms"
    assert duration_to_string(34.09e-6) == "34.09 us"
    assert duration_to_string(1.89) == "1.89 s"


def _value(text: str, key: str) -> str:
    line = next(line for line in text.splitlines() if line.startswith(key + ":"))
    assert len(line.split(":")[0]) + 1 <= 70 and line[70:72] == "  "  # '{:<70}  {:<8}'
    return line[72:].strip()


def test_report_layout_and_arithmetic_invariants_with_engine_timings():
    torch.manual_seed(0)
    model = GPT(vocab_size=256, n_layer=2, n_head=2, n_embd=64, block_size=32)
    engine = types.SimpleNamespace(world_size=2, dp_world_size=2, mpu=None,
                                   train_micro_batch_size_per_gpu=lambda: 4)
    prof = FlopsProfiler(model, ds_engine=engine)
    prof.start_profile()
    model(torch.randint(0, 256, (4, 32)))
    prof.stop_profile()
    prof.fwd_latency, prof.bwd_latency, prof.step_latency = 0.010, 0.020, 0.005
    text = prof.model_profile_text(profile_step=3, module_depth=-1, top_modules=2, detailed=True)
    total = prof.get_total_flops()
    prof.end_profile()

    assert "-------------------------- DeepSpeed Flops Profiler --------------------------" in text
    assert "Profile Summary at step 3:" in text
    assert _value(text, "world size") == "2" and _value(text, "batch size per GPU") == "4"
    assert _value(text, "fwd flops per GPU") == number_to_string(total)
    assert _value(text, "fwd FLOPS per GPU = fwd flops per GPU / fwd latency") == flops_to_string(total / 0.010)
    assert _value(text, "fwd+bwd FLOPS per GPU = 3 * fwd flops per GPU / (fwd+bwd latency)") == flops_to_string(
        3 * total / 0.030)
    assert _value(text, "iter latency") == "35.0 ms"
    assert _value(text, "samples/second") == str(round(4 * 2 / 0.035, 2))
    assert _value(text, "bwd FLOPS per GPU = 2 * fwd flops per GPU / bwd latency") == flops_to_string(
        2 * total / 0.020)
    assert "Top 2 modules in terms of params, MACs or fwd latency at different model depths:" in text
    assert re.search(r"depth 0:\n    params      - \{'GPT': '[\d.]+ k'\}", text)
    assert "------------------------------ Detailed Profile per GPU ------------------------------" in text
    assert re.search(r"\(c_fc\): Linear\([\d.]+ k, [\d.]+% Params, [\d.]+ MMACs, [\d.]+% MACs, .*in_features=64",
                     text)
    assert text.rstrip().endswith("------------------------------------------------------------------------------")


def test_get_model_profile_input_shape_strings_and_output_file(tmp_path):
    model = nn.Sequential(nn.Linear(8, 4))
    out = tmp_path / "flops.txt"
    flops, macs, params = get_model_profile(model, input_shape=(2, 8), as_string=True, output_file=str(out))
    assert (flops, macs, params) == ("128", "64 MACs", "36")
    assert "fwd MACs per GPU:" in out.read_text()
    with pytest.raises(ValueError):
        get_model_profile(model)
