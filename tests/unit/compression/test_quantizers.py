"""Quantization arithmetic against float64 references, and the integer packing export uses."""
import pytest
import torch

from dsrun.compression.quantizers import (QuantSpec, dequantize, fake_quantize, fake_quantize_ste, pack,
                                          quantize, signed_codes, unpack, unsigned_codes)


def _reference(x: torch.Tensor, bits: int, symmetric: bool, groups: int) -> torch.Tensor:
    """The grids of the module docstring, written out in float64."""
    flat = x.double().reshape(groups, -1)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = flat.abs().amax(1, keepdim=True) / qmax
        return (torch.round(flat / scale).clamp(-qmax, qmax) * scale).reshape(x.shape)
    levels = 2 ** bits - 1
    low, high = flat.amin(1, keepdim=True).clamp(max=0), flat.amax(1, keepdim=True).clamp(min=0)
    scale = (high - low) / levels
    zp = torch.round(-low / scale)
    return ((torch.round(flat / scale) + zp).clamp(0, levels) - zp).mul(scale).reshape(x.shape)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits,groups", [(8, 1), (4, 4), (3, 2)])
def test_fake_quantization_matches_float64_reference(bits, groups, symmetric):
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(bits * 10 + groups))
    got = fake_quantize(x, QuantSpec(bits, symmetric, groups)).double()
    ref = _reference(x, bits, symmetric, groups)
    # fp32 scale and product differ from float64 by a few ulps of the largest magnitude in the group
    assert (got - ref).abs().max() <= 4 * torch.finfo(torch.float32).eps * x.abs().max()


@pytest.mark.parametrize("symmetric", [True, False])
def test_four_bits_give_at_most_sixteen_values_per_group(symmetric):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    q = fake_quantize(x, QuantSpec(4, symmetric, groups=8)).reshape(8, -1)
    assert all(len(torch.unique(row)) <= 16 for row in q)
    assert quantize(x, QuantSpec(4, symmetric, 8)).codes.unique().numel() <= 16


def test_binary_and_ternary_grids():
    x = torch.tensor([[-2.0, -0.1, 0.05, 1.0, 3.0, 0.0]])
    binary = fake_quantize(x, QuantSpec(1))
    assert torch.allclose(binary, x.abs().mean() * torch.tensor([[-1, -1, 1, 1, 1, 1.0]]))
    ternary = fake_quantize(x, QuantSpec(2))
    threshold = 0.7 * x.abs().mean()  # 0.6417: -2, 1, 3 survive with the mean of their magnitudes, 2.0
    assert threshold < 1.0
    assert torch.equal(ternary, torch.tensor([[-2.0, 0, 0, 2.0, 2.0, 0]]))


def test_stochastic_rounding_is_unbiased_and_differs_from_nearest():
    torch.manual_seed(0)
    x = torch.full((1, 20000), 0.3)
    x[0, 0] = 1.0  # scale = 1/127: 0.3 sits at 38.1 steps
    nearest = fake_quantize(x, QuantSpec(8))
    stochastic = fake_quantize(x, QuantSpec(8, stochastic=True))
    assert torch.unique(nearest[0, 1:]).numel() == 1 and torch.unique(stochastic[0, 1:]).numel() == 2
    assert abs(stochastic[0, 1:].double().mean().item() - 0.3) < 1e-4  # 20000 draws: sd of the mean 2.3e-5


def test_straight_through_gradient_is_identity():
    x = torch.randn(4, 4, requires_grad=True)
    fake_quantize_ste(x, QuantSpec(4)).mul(torch.arange(16.0).reshape(4, 4)).sum().backward()
    assert torch.equal(x.grad, torch.arange(16.0).reshape(4, 4))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_codes_pack_and_unpack(bits):
    x = torch.randn(7, 9, generator=torch.Generator().manual_seed(bits))
    spec = QuantSpec(bits, symmetric=bits <= 2 or bits % 2 == 0)
    q = quantize(x, spec)
    packed = pack(unsigned_codes(q), bits)
    assert packed.numel() == -(-63 * {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8}[bits] // 8)
    codes = signed_codes(unpack(packed, bits, 63), spec).reshape(q.codes.shape)
    assert torch.equal(codes, q.codes)
    assert torch.equal(dequantize(q), fake_quantize(x, spec))
