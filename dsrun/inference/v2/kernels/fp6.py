"""The FP6 (E3M2) number format of DeepSpeed's FP6 weight-only linear (FP6-LLM): 1 sign bit, 3 exponent bits with
bias 3, 2 mantissa bits, subnormals, no infinities or NaN. Its largest value is 28 (``1.75 * 2**4``), the
``q_range`` DeepSpeed's ``fp_quantize`` scales each row to. A code is 6 bits: sign (bit 5), exponent, mantissa.

DeepSpeed rounds onto this grid with qtorch's ``float_quantize`` (not a dsrun dependency); here the rounding is
to the nearest grid value, ties to the even code, values beyond 28 saturate."""
from __future__ import annotations

import torch

SIGN_BIT = 32
MAX_VALUE = 28.0


def _magnitudes() -> torch.Tensor:
    codes = torch.arange(32)
    exponent, mantissa = codes >> 2, (codes & 3).double()
    normal = (1 + mantissa / 4) * torch.pow(2.0, (exponent - 3).double())
    subnormal = (mantissa / 4) * 2.0**-2
    return torch.where(exponent > 0, normal, subnormal).float()


MAGNITUDES = _magnitudes()  # the 32 non-negative values, ascending with their code
VALUES = torch.cat([MAGNITUDES, -MAGNITUDES])  # by code: 0..31 positive, 32..63 negative


def encode(values: torch.Tensor) -> torch.Tensor:
    """The nearest FP6 code (uint8, 0..63) of each element of ``values`` (float)."""
    magnitude = values.abs().float().clamp(max=MAX_VALUE)
    table = MAGNITUDES.to(values.device)
    low = (torch.bucketize(magnitude, table, right=True) - 1).clamp(0, 31)
    high = (low + 1).clamp(max=31)
    below, above = magnitude - table[low], table[high] - magnitude
    take_high = (above < below) | ((above == below) & (high % 2 == 0) & (high != low))
    code = torch.where(take_high, high, low)
    negative = torch.signbit(values) & (code != 0)
    return (code + SIGN_BIT * negative).to(torch.uint8)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of each FP6 code."""
    return VALUES.to(codes.device)[codes.long()]


def split_2_4(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of a [out, in] matrix as DeepSpeed's FP6 kernel holds them: a 2-bit slice (each code's top two
    bits, four to a byte: shape [out * 2 / 8, in]) and a 4-bit slice (the low four, two to a byte: [out * 4 / 8,
    in]), 6 bits a weight. Row-major packing of consecutive rows, not the CUDA kernel's tensor-core order."""
    out_features = codes.shape[0]
    if out_features % 4 != 0:
        raise ValueError(f"FP6 packing needs the output channels ({out_features}) to be a multiple of 4")
    high = (codes >> 4).view(out_features // 4, 4, -1)
    low = (codes & 15).view(out_features // 2, 2, -1)
    two_bit = high[:, 0] | high[:, 1] << 2 | high[:, 2] << 4 | high[:, 3] << 6
    four_bit = low[:, 0] | low[:, 1] << 4
    return two_bit.to(torch.uint8), four_bit.to(torch.uint8)


def join_2_4(two_bit: torch.Tensor, four_bit: torch.Tensor) -> torch.Tensor:
    """The [out, in] codes back from :func:`split_2_4`'s two slices."""
    high = torch.stack([(two_bit >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).flatten(0, 1)
    low = torch.stack([four_bit & 15, four_bit >> 4], dim=1).flatten(0, 1)
    return high << 4 | low
