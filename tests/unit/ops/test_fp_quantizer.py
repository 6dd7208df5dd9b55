"""DeepSpeed's FP quantizer in torch (``deepspeed.ops.fp_quantizer``). Every code of each format decodes and encodes
back to itself; a value comes back within half a step of its format at its scaled magnitude (a step is
``2**(exponent - mantissa_bits)``, the exponent no lower than the smallest normal's), times the group's multiplier,
plus one rounding to bfloat16 (relative 2**-8)."""
from __future__ import annotations

import pytest
import torch

from dsrun.alias.paths import target_of
from dsrun.linear.config import QuantizationConfig
from dsrun.ops.fp_quantizer import FP_Quantize, matmul_fp8
from dsrun.ops.fp_quantizer.quantize import Q_RANGE, decode, encode

FORMATS = {8: (4, 3), 12: (7, 4), 6: (3, 2), 4: (2, 1)}


def test_every_code_round_trips_and_the_largest_is_deepspeeds_range():
    for q_bits, (e, m) in FORMATS.items():
        codes = torch.arange(2 ** (1 + e + m), dtype=torch.int32)
        values = decode(codes, e, m)
        assert torch.equal(encode(values, e, m) | (values == 0) * codes, codes)  # -0 encodes as +0
        largest = values.abs().max().item()
        assert largest == (Q_RANGE[(q_bits, m)] if q_bits != 12 else (2 - 2**-4) * 2.0**64)


@pytest.mark.parametrize("q_bits", [8, 12, 6, 4])
def test_groups_come_back_within_half_a_step(q_bits):
    e, m = FORMATS[q_bits]
    config = QuantizationConfig()
    config.group_size = 64
    quantizer = FP_Quantize(config)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(q_bits)).to(torch.bfloat16)
    out = quantizer.quantize(x, q_bits=q_bits)
    assert out.dtype == torch.uint8 and out.shape == (16, 64 * q_bits // 8 + 4)
    back = quantizer.dequantize(out, q_bits=q_bits)
    assert back.dtype == x.dtype and back.shape == x.shape
    groups = x.double().reshape(16, 64)
    multiplier = groups.abs().amax(-1, keepdim=True) / Q_RANGE[(q_bits, m)]
    scaled_exp = torch.floor(torch.log2((groups / multiplier).abs().clamp_min(1e-30))).clamp_min(2 - 2 ** (e - 1))
    bound = torch.exp2(scaled_exp - m) / 2 * multiplier + 2.0**-8 * groups.abs()
    assert ((back.double().reshape(16, 64) - groups).abs() <= bound + 1e-12).all()


def test_meta_tensor_selective_and_fp8_matmul():
    config = QuantizationConfig()
    config.group_size = 32
    quantizer = FP_Quantize(config)
    w = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = quantizer.dequantize(quantizer.quantize(w))
    codes, scale = quantizer.quantize(w, return_meta_tensor=True)
    assert codes.shape == w.shape and scale.shape == (12, 4)
    assert torch.equal(quantizer.dequantize(codes, scale=scale), whole)
    assert torch.equal(quantizer.get_scales().flatten(), (w.float().reshape(12, 32).abs().amax(-1) / 480))
    assert torch.equal(quantizer.selective_dequantize(codes, torch.tensor([2, 0]), scale=scale), whole[[2, 0]])
    x = torch.randn(5, 3 * 8, dtype=torch.bfloat16)
    w2 = w.reshape(24, 16)
    codes2, scale2 = quantizer.quantize(w2, return_meta_tensor=True)
    assert torch.equal(matmul_fp8(x, codes2, scale2, 32, quantizer), x @ quantizer.dequantize(codes2, scale=scale2))
    with pytest.raises(ValueError, match="stochastic"):
        quantizer.quantize(w, stochastic_mode=True)
    with pytest.raises(ValueError, match="q_bits=5"):
        quantizer.quantize(w, q_bits=5)
    assert target_of("deepspeed.ops.fp_quantizer.fp8_gemm") == "dsrun.ops.fp_quantizer.quantize"
