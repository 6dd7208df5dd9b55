"""DeepSpeed's group-wise INT4/INT8 weight quantization (``deepspeed.inference.quantization``).

Bounds from the arithmetic: a value is rounded to the nearest of ``2**bits`` levels spaced ``(max - min) / (2**bits
- 1)`` over its group, so it comes back within half a step; in a half dtype the stored scale and minimum and the
two operations of ``q / scale + min`` each round once more (relative ``eps`` of at most ``|x| + (max - min)``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.alias.paths import target_of
from dsrun.inference.quantization import (DeQuantizer, QuantizedEmbedding, QuantizedLinear, Quantizer,
                                          _init_group_wise_weight_quantization)


def _step(data: torch.Tensor, bits: int, group_dim: int, group_size: int) -> torch.Tensor:
    """Each element's quantization step (its group's range over 2**bits - 1), shaped like ``data``."""
    shape = data.shape
    grouped = data.double().reshape(shape[:group_dim] + (shape[group_dim] // group_size, group_size)
                                    + shape[group_dim + 1:])
    spread = grouped.amax(group_dim + 1, keepdim=True) - grouped.amin(group_dim + 1, keepdim=True)
    return (spread / (2**bits - 1)).expand_as(grouped).reshape(shape)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_dim", [0, 1])
def test_round_trip_is_within_half_a_step(bits, group_dim):
    config = {"num_bits": bits, "group_size": 16, "group_dim": group_dim, "symmetric": False}
    data = torch.randn(32, 48, generator=torch.Generator().manual_seed(bits + group_dim))
    data[:16, :16] = 0.25  # a constant group comes back exactly
    q, scale, low = Quantizer(config).quantize(data)
    assert q.dtype == torch.uint8 and q.shape == ((32, 24) if bits == 4 else (32, 48))
    back = DeQuantizer(config, torch.float32).dequantize(q, scale, low)
    assert back.shape == data.shape
    assert ((back.double() - data.double()).abs() <= _step(data, bits, group_dim, 16) / 2 + 1e-6).all()
    assert torch.equal(back[:16, :16], data[:16, :16])


def test_int4_packs_the_even_value_in_the_high_nibble():
    config = {"num_bits": 4, "group_size": 4, "group_dim": 1, "symmetric": False}
    q, scale, low = Quantizer(config).quantize(torch.tensor([[0.0, 15.0, 5.0, 10.0]]))
    assert q.tolist() == [[0x0F, 0x5A]] and scale.item() == 1.0 and low.item() == 0.0


def _bound(data: torch.Tensor, bits: int, group_size: int, eps: float) -> torch.Tensor:
    step = _step(data, bits, 1, group_size)
    return step / 2 + 4 * eps * (data.double().abs() + step * (2**bits - 1))


def test_quantized_layers_compute_with_their_dequantized_weights():
    torch.manual_seed(0)
    config = {"num_bits": 8, "group_size": 32, "group_dim": 1, "symmetric": False}
    linear = nn.Linear(64, 16).to(torch.bfloat16)
    original = linear.weight.detach().clone()
    quantized = QuantizedLinear(config, linear)
    q, scale, low = quantized.weight.deconcat(quantized.weight)
    w_back = quantized.weight.dequantizer.dequantize(q.view(torch.uint8), scale, low)
    assert ((w_back.double() - original.double()).abs() <= _bound(original, 8, 32, 2.0**-8)).all()
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(quantized(x), F.linear(x, w_back, linear.bias))
    assert quantized.bias is linear.bias and not quantized.weight.requires_grad
    embedding = nn.Embedding(10, 32).half()
    qe = QuantizedEmbedding(config, embedding)
    ids = torch.tensor([[1, 7]])
    assert ((qe(ids).double() - embedding(ids).double()).abs() <= _bound(embedding.weight, 8, 32, 2.0**-11)[ids]).all()


def test_post_init_quantization_replaces_the_named_layers():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.fc1, self.fc2 = nn.Embedding(16, 32), nn.Linear(32, 64), nn.Linear(64, 32)
            self.lm_head = nn.Linear(32, 16, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    rule = {"num_bits": 4, "group_size": 32, "group_dim": 1, "symmetric": False}
    model = _init_group_wise_weight_quantization(Block().half(), {"weight_quantization": {"post_init_quant": {
        "fc": rule, "lm_head": rule, "embed_tokens": rule}}})
    assert type(model.fc1) is QuantizedLinear and type(model.fc2) is QuantizedLinear
    assert type(model.embed_tokens) is QuantizedEmbedding and model.lm_head.weight is model.embed_tokens.weight
    with pytest.raises(ValueError, match="matches both"):
        _init_group_wise_weight_quantization(Block().half(), {"weight_quantization": {"post_init_quant": {
            "fc": rule, "fc1": rule}}})
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        QuantizedLinear(rule, nn.Linear(32, 32).double())
    assert target_of("deepspeed.inference.quantization.utils") == "dsrun.inference.quantization.groupwise"
