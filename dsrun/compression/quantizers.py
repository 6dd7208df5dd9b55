"""Quantization arithmetic, shared by training (fake quantization) and export (integer codes).

One function, :func:`quantize`, turns a tensor into integer codes and per-group scales; fake quantization is
``dequantize(quantize(x))``, so the weights an exported model is rebuilt from are bit for bit the ones the
simulated model computed with.

Grids (``bits`` per value, ``groups`` contiguous groups of the flattened tensor, each with its own scale):

* ``bits >= 3``, symmetric: codes ``-(2^(b-1)-1) .. 2^(b-1)-1`` (``2^b - 1`` levels, zero exact), scale
  ``max|x| / (2^(b-1)-1)``.
* ``bits >= 3``, asymmetric: codes ``0 .. 2^b-1`` with an integer zero point, over ``[min(x,0), max(x,0)]``.
* ``bits == 2`` (ternary, symmetric only): codes ``{-1, 0, 1}``, threshold ``0.7·mean|x|``, scale the mean
  magnitude of the values above it.
* ``bits == 1`` (binary, symmetric only): codes ``{-1, 1}`` (the sign, zero counted positive), scale
  ``mean|x|``.

Rounding is to nearest, or stochastic (``floor(v + u)``, ``u ~ U[0, 1)``, unbiased). The straight-through
estimator (:func:`fake_quantize_ste`) passes the gradient through unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.autograd.function import FunctionCtx

from dsrun.utils.errors import Problem, UserError


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one tensor: bit width, symmetric or not, groups, stochastic rounding or not."""

    bits: int
    symmetric: bool = True
    groups: int = 1
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.bits < 1:
            raise ValueError(f"bits must be >= 1, got {self.bits}")
        if self.bits <= 2 and not self.symmetric:
            raise ValueError("1- and 2-bit quantization is symmetric only")

    @property
    def scheme(self) -> str:
        return "symmetric" if self.symmetric else "asymmetric"


@dataclass
class Quantized:
    """Integer codes (``[groups, n]``, int32), per-group ``scale`` (``[groups, 1]``, fp32) and, for the
    asymmetric grid, per-group ``zero_point`` (``[groups, 1]``, int32)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: QuantSpec
    shape: torch.Size


def check_groups(numel: int, groups: int, where: str) -> None:
    """A tensor of ``numel`` values splits into ``groups`` equal groups, or a clear error naming ``where``."""
    if groups < 1 or numel % groups:
        raise UserError(Problem(where, f"{numel} values do not split into {groups} equal quantization groups",
                                "pick quantize_groups dividing the weight's size (e.g. its number of rows)"))


def _round(values: torch.Tensor, stochastic: bool) -> torch.Tensor:
    if stochastic:
        return torch.floor(values + torch.rand_like(values))
    return torch.round(values)


def quantize(x: torch.Tensor, spec: QuantSpec) -> Quantized:
    """Codes and scales of ``x`` (any shape) under ``spec``; computed in fp32 whatever ``x``'s dtype."""
    flat = x.detach().float().reshape(spec.groups, -1)
    if spec.bits == 1:
        scale = flat.abs().mean(dim=1, keepdim=True)
        codes = torch.where(flat >= 0, 1, -1).to(torch.int32)
        return Quantized(codes, scale, None, spec, x.shape)
    if spec.bits == 2:
        threshold = 0.7 * flat.abs().mean(dim=1, keepdim=True)
        keep = flat.abs() > threshold
        kept = keep.sum(dim=1, keepdim=True)
        scale = torch.where(kept > 0, (flat.abs() * keep).sum(dim=1, keepdim=True) / kept.clamp(min=1),
                            torch.zeros_like(threshold))
        codes = (torch.sign(flat) * keep).to(torch.int32)
        return Quantized(codes, scale, None, spec, x.shape)
    if spec.symmetric:
        qmax = 2 ** (spec.bits - 1) - 1
        absmax = flat.abs().amax(dim=1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
        codes = _round(flat / scale, spec.stochastic).clamp(-qmax, qmax).to(torch.int32)
        return Quantized(codes, scale, None, spec, x.shape)
    levels = 2 ** spec.bits - 1
    low = flat.amin(dim=1, keepdim=True).clamp(max=0)
    high = flat.amax(dim=1, keepdim=True).clamp(min=0)
    span = high - low
    scale = torch.where(span > 0, span / levels, torch.ones_like(span))
    zero_point = torch.round(-low / scale).clamp(0, levels)
    codes = (_round(flat / scale, spec.stochastic) + zero_point).clamp(0, levels).to(torch.int32)
    return Quantized(codes, scale, zero_point.to(torch.int32), spec, x.shape)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values the codes stand for, in ``q``'s original shape."""
    codes = q.codes.float()
    if q.zero_point is not None:
        codes = codes - q.zero_point.float()
    return (codes * q.scale).reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype (no gradient)."""
    return dequantize(quantize(x, spec), x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: object) -> torch.Tensor:
        ctx.others = len(args)
        return fn(x, *args)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, grad) + (None,) * ctx.others


def straight_through(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: object) -> torch.Tensor:
    """``fn(x, *args)`` whose gradient with respect to ``x`` is the identity (the straight-through
    estimator); the other arguments (whatever ``fn`` takes) get none."""
    return _StraightThrough.apply(fn, x, *args)


def fake_quantize_ste(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Fake quantization with a straight-through gradient."""
    return straight_through(fake_quantize, x, spec)


# --- activations: ranges per token / per image, or a fixed range ------------------------------------------

def _act_scale(low: torch.Tensor, high: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        absmax = torch.maximum(low.abs(), high.abs())
        return torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax)), None
    levels = 2 ** bits - 1
    low, high = low.clamp(max=0), high.clamp(min=0)
    span = high - low
    scale = torch.where(span > 0, span / levels, torch.ones_like(span))
    return scale, torch.round(-low / scale).clamp(0, levels)


def fake_quantize_range(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int,
                        symmetric: bool) -> torch.Tensor:
    """Fake-quantize ``x`` on the grid of the range ``[low, high]`` (tensors broadcasting against ``x``);
    values outside the range clip to it. No gradient handling: see :func:`fake_quantize_activation`."""
    values = x.detach().float()
    scale, zero_point = _act_scale(low.float(), high.float(), bits, symmetric)
    if zero_point is None:
        qmax = 2 ** (bits - 1) - 1
        out = torch.round(values / scale).clamp(-qmax, qmax) * scale
    else:
        levels = 2 ** bits - 1
        out = ((torch.round(values / scale) + zero_point).clamp(0, levels) - zero_point) * scale
    return out.to(x.dtype)


def dynamic_range(x: torch.Tensor, per_sample_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``x`` over everything but its first ``per_sample_dims`` dimensions (per token for a
    Linear's ``[..., features]`` input: all dims but the last; per image for a Conv2d's ``[N, C, H, W]``)."""
    reduce = tuple(range(per_sample_dims, x.dim()))
    values = x.detach().float()
    return values.amin(dim=reduce, keepdim=True), values.amax(dim=reduce, keepdim=True)


def fake_quantize_activation(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int,
                             symmetric: bool) -> torch.Tensor:
    """Activation fake quantization on a given range, with a straight-through gradient."""
    return straight_through(fake_quantize_range, x, low, high, bits, symmetric)


# --- packing integer codes into bytes --------------------------------------------------------------------

def container_bits(bits: int) -> int:
    """Bits each code occupies on disk: 1, 2, 4 or 8 (3 packs as 4; 5-7 as 8)."""
    for width in (1, 2, 4, 8):
        if bits <= width:
            return width
    raise ValueError(f"codes of {bits} bits do not fit a byte")


def unsigned_codes(q: Quantized) -> torch.Tensor:
    """Codes shifted to ``0 .. 2^b - 1`` (symmetric grids are offset by ``2^(b-1)``; binary maps -1,1 to
    0,1; ternary -1,0,1 to 0,1,2)."""
    bits = q.spec.bits
    if bits == 1:
        return ((q.codes + 1) // 2).to(torch.uint8)
    if bits == 2:
        return (q.codes + 1).to(torch.uint8)
    if q.spec.symmetric:
        return (q.codes + 2 ** (bits - 1)).to(torch.uint8)
    return q.codes.to(torch.uint8)


def signed_codes(unsigned: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Inverse of :func:`unsigned_codes`."""
    u = unsigned.to(torch.int32)
    if spec.bits == 1:
        return u * 2 - 1
    if spec.bits == 2:
        return u - 1
    if spec.symmetric:
        return u - 2 ** (spec.bits - 1)
    return u


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (each < 2^bits) packed ``8 // container_bits(bits)`` to a byte, little end first."""
    width = container_bits(bits)
    flat = codes.reshape(-1).to(device="cpu", dtype=torch.uint8)  # packing is for files
    per_byte = 8 // width
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    lanes = flat.reshape(-1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32) * width
    return (lanes << shifts).sum(dim=1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``numel`` unsigned codes."""
    width = container_bits(bits)
    per_byte = 8 // width
    shifts = torch.arange(per_byte, dtype=torch.int32) * width
    lanes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & (2 ** width - 1)
    return lanes.reshape(-1)[:numel].to(torch.uint8)
