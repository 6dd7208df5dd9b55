"""DeepSpeed's v1 inference kernels in torch (``deepspeed.ops.transformer.inference``): each op class against a
plain-torch float64 reference, through DeepSpeed's import paths and ``InferenceBuilder().load()``.

Tolerances: a kernel sums/normalises in float32 and rounds once to the output dtype, so it is within one rounding
of that dtype (relative 2**-8 for bfloat16, 2**-11 for float16) of the exact value, plus float32's own error
(relative ~1e-6 per operation over a few operations) for float32; the absolute part covers results near zero.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from dsrun.alias.paths import target_of
from dsrun.ops.transformer import DeepSpeedInferenceConfig
from dsrun.ops.transformer.inference import op_binding as ops
from dsrun.ops.transformer.inference.kernels import nhwc_bias_add
from dsrun.utils.types import ActivationFuncType

# relative error of one rounding to the dtype (float32: a few float32 operations), and the absolute floor
TOL = {torch.float16: (2.0**-10, 1e-3), torch.bfloat16: (2.0**-7, 1e-2), torch.float32: (1e-5, 1e-6)}
DTYPES = list(TOL)


def close(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> bool:
    rtol, atol = TOL[dtype]
    return out.dtype == dtype and torch.allclose(out.double(), exact, rtol=rtol, atol=atol)


def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=torch.float32).to(dtype)


GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_and_norm_ops_match_their_math(dtype):
    x, bias, res = rand(2, 3, 64, dtype=dtype), rand(64, dtype=dtype), rand(2, 3, 64, dtype=dtype)
    gamma, beta = rand(64, dtype=dtype), rand(64, dtype=dtype)
    xd, bd, rd, gd, btd = x.double(), bias.double(), res.double(), gamma.double(), beta.double()
    config = DeepSpeedInferenceConfig(dtype=dtype)
    # bias add (in the dtype: one rounding of the exact sum), GELU (tanh form), ReLU
    assert close(ops.BiasAddOp(config)(x, bias), xd + bd, dtype)
    assert close(ops.BiasGeluOp(config)(x, bias), F.gelu(xd + bd, approximate="tanh"), dtype)
    assert close(ops.BiasReluOp(config)(x, bias), F.relu(xd + bd), dtype)
    # GEGLU / SwiGLU: value half times the activated gate half
    wide, wide_bias = rand(2, 3, 128, dtype=dtype), rand(128, dtype=dtype)
    value, gate = (wide.double() + wide_bias.double()).chunk(2, dim=-1)
    assert close(ops.GatedActivationOp()(wide, wide_bias, ActivationFuncType.GATED_GELU), value * F.gelu(gate), dtype)
    assert close(ops.GatedActivationOp()(wide, wide_bias, ActivationFuncType.GATED_SILU), value * F.silu(gate), dtype)
    with pytest.raises(ValueError, match="GATED_GELU"):
        ops.GatedActivationOp()(wide, wide_bias, ActivationFuncType.GELU)
    # the norms: LayerNorm, with the residual (and the stored pre-norm sum), RMSNorm, pre-RMSNorm
    assert close(ops.LayerNormOp()(x, gamma, beta, 1e-5), F.layer_norm(xd, (64,), gd, btd, 1e-5), dtype)
    summed = xd + bd + rd
    normed, stored = ops.LayerNormOp.layer_norm_residual_store_pre_ln_res(x, bias, res, gamma, beta, 1e-5)
    assert close(normed, F.layer_norm(summed, (64,), gd, btd, 1e-5), dtype) and close(stored, summed, dtype)
    assert close(ops.LayerNormOp.layer_norm_residual(x, bias, res, gamma, beta, 1e-5), normed.double(), dtype)

    def rms(v):
        return gd * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)

    # gamma * (normalised, rounded to the dtype): two roundings in a half dtype
    rtol2 = 2 * TOL[dtype][0]
    assert torch.allclose(ops.RMSNormOp()(x, gamma, 1e-5).double(), rms(xd), rtol=rtol2, atol=TOL[dtype][1])
    out, new_res = ops.PreRMSNormOp()(x, res, gamma, 1e-5)
    assert torch.allclose(out.double(), rms(xd + rd), rtol=rtol2, atol=TOL[dtype][1]) and close(new_res, xd + rd, dtype)


@pytest.mark.parametrize("mlp_after_attn,pre_layer_norm,add_bias", [(True, True, True), (True, False, True),
                                                                    (False, True, True), (False, True, False)])
def test_residual_add_writes_the_blocks_residual_in_place(mlp_after_attn, pre_layer_norm, add_bias):
    dtype, mp = torch.float32, 2
    hidden, residual, attn = (rand(2, 3, 32, dtype=dtype) for _ in range(3))
    attn_bias, final_bias = rand(32, dtype=dtype), rand(32, dtype=dtype)
    h, r, a, ab, fb = (t.double() for t in (hidden, residual, attn, attn_bias, final_bias))
    if mlp_after_attn and pre_layer_norm:
        exact = h + (r + a + ab + fb) / mp
    elif mlp_after_attn:
        exact = r + h + fb
    else:
        exact = h + a + (r + fb) / mp + (ab / mp if add_bias else 0)
    hidden_before = hidden.clone()
    config = DeepSpeedInferenceConfig(dtype=dtype, mp_size=mp, mlp_after_attn=mlp_after_attn,
                                      pre_layer_norm=pre_layer_norm)
    out = ops.ResidualAddOp(config)(hidden, residual, add_bias, attn, attention_bias=attn_bias, final_bias=final_bias)
    assert out is residual and close(residual, exact, dtype) and torch.equal(hidden, hidden_before)
    # without biases: (residual + attention_output) / mp_size + hidden_state
    residual2 = rand(2, 3, 32, dtype=dtype)
    out = ops.ResidualAddOp(config)(hidden, residual2, add_bias, attn)
    assert close(out, (residual2.double() + a) / mp + h, dtype)


def test_moe_residual_mix_reads_the_coefficients_in_the_kernels_layout():
    residual, output = rand(2, 4, 8, dtype=torch.float32), rand(2, 4, 8, dtype=torch.float32)
    c1, c2 = rand(1, 1, 8, dtype=torch.float32), rand(1, 1, 8, dtype=torch.float32)
    coef = torch.cat((c1, c2), dim=-1).transpose(-1, -2).contiguous()  # [1, 2 * hidden, 1]
    exact = residual.double() * c1.double() + output.double() * c2.double()
    assert close(ops.MoEResMatmulOp()(residual, coef, output), exact, torch.float32)


def test_nhwc_bias_add_keeps_channels_last():
    act, other = (rand(2, 6, 4, 4, dtype=torch.float16).to(memory_format=torch.channels_last) for _ in range(2))
    bias, other_bias = rand(6, dtype=torch.float16), rand(6, dtype=torch.float16)
    terms = [act.double(), bias.double().reshape(1, -1, 1, 1), other.double(), other_bias.double().reshape(1, -1, 1, 1)]
    for n, out in ((2, nhwc_bias_add(act, bias)), (3, nhwc_bias_add(act, bias, other)),
                   (4, nhwc_bias_add(act, bias, other, other_bias))):
        assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == torch.float16
        # n - 1 float16 additions, each off by at most half an ulp (2**-11 relative) of a partial sum, which is
        # no larger than the sum of the terms' magnitudes
        bound = (n - 1) * 2.0**-11 * sum(t.abs() for t in terms[:n])
        assert ((out.double() - sum(terms[:n])).abs() <= bound).all()


def test_the_builders_load_the_kernels_under_deepspeeds_names():
    from op_builder import InferenceBuilder, OpBuilder, SpatialInferenceBuilder

    from dsrun.ops import compatible_ops

    compatible = compatible_ops()
    assert compatible["transformer_inference"] and compatible["spatial_inference"]
    module = InferenceBuilder().load()
    for name in ("bias_add_fp16", "bias_gelu_bf16", "bias_relu_fp32", "residual_add_bias_fp16", "layer_norm",
                 "_layer_norm_residual", "layer_norm_residual_store_pre_ln_res", "rms_norm", "pre_rms_norm",
                 "gated_activation", "moe_res_matmul", "_vector_add"):
        assert callable(getattr(module, name)), name
    # INT8 weights: each of the groups (row-major, equal) times its scale, in the kernel's dtype
    weight, scale = torch.randint(-127, 128, (6, 8), dtype=torch.int8, generator=GEN), torch.rand(4, 1, generator=GEN)
    exact = (weight.double().reshape(4, -1) * scale.double()).reshape(6, 8)
    assert close(module.dequantize_fp16(weight, scale, 4), exact, torch.float16)
    assert close(module.dequantize_fp32(weight, scale, 4), exact, torch.float32)
    x, b = rand(1, 2, 4, 4, dtype=torch.float32), rand(2, dtype=torch.float32)
    assert torch.equal(SpatialInferenceBuilder().load().nhwc_bias_add(x, b), x + b.reshape(1, -1, 1, 1))
    # DeepSpeed's paths: one module per op class there, the one op_binding package here
    for path in ("deepspeed.ops.transformer.inference.op_binding.bias_add",
                 "deepspeed.ops.transformer.inference.op_binding.rms_norm"):
        assert importlib.import_module(target_of(path)) is ops
    assert target_of("deepspeed.ops.transformer.inference.bias_add") == "dsrun.ops.transformer.inference.kernels"
    # DeepSpeed's tests skip ROCm builds by this: (0, 0) unless torch was built for ROCm
    hip = getattr(torch.version, "hip", None)
    assert OpBuilder.installed_rocm_version() == ((0, 0) if not hip else tuple(map(int, hip.split(".")[:2])))


def test_inference_config_keeps_deepspeeds_defaults():
    config = DeepSpeedInferenceConfig(hidden_size=64, heads=4, layer_norm_eps=1e-6)
    assert (config.intermediate_size, config.epsilon, config.dtype, config.mp_size) == (256, 1e-6, torch.float16, 1)
    assert config.pre_layer_norm and config.mlp_after_attn and config.layer_id == -1
    assert DeepSpeedInferenceConfig.from_dict({"hidden_size": 8, "mp_size": 2}).mp_size == 2
