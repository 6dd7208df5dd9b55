"""DeepSpeed's FP quantizer (``deepspeed.ops.fp_quantizer``: ``FP_Quantize``, ``matmul_fp8``) in torch.

Each group of ``group_size`` values is scaled so its largest magnitude lands on the format's range (DeepSpeed's
``q_range``: FP8 E4M3 480, FP8 E5M2 114688, FP12 (E7M4) 510, FP6 (E3M2) 28, FP4 (E2M1) 6) and rounded to the
nearest value of a float format with ``q_bits - q_mantisa_bits - 1`` exponent bits and ``q_mantisa_bits``
mantissa bits (IEEE-style bias, subnormals, every exponent field a number: no inf or NaN); it comes back as the
code's value times ``max / q_range``. ``quantize`` returns ``uint8`` rows of ``[num_groups, group_size * q_bits / 8 +
4]``: the codes (sign, exponent, mantissa; packed least-significant bit first for 4, 6 and 12 bits), then the group's
float32 dequantization multiplier ``max / q_range`` as 4 bytes.

Where this differs from DeepSpeed's CUDA kernel (``FPQuantizerBuilder``, which dsrun does not build): ties round
to even (the kernel rounds half up in magnitude), a value below the smallest normal becomes a subnormal (the kernel
lifts it to the smallest normal), no stochastic rounding (``stochastic_mode=True`` is refused), and the 6- and
12-bit packing is a plain bit stream, not the kernel's per-thread order, so the bytes are not interchangeable with a
CUDA build's. The inputs may be any float dtype (the kernel takes bfloat16 only).
"""
from __future__ import annotations

import abc
from typing import Any, Protocol

import torch

#: DeepSpeed's target magnitude of each group per (q_bits, mantissa bits)
Q_RANGE = {(8, 3): 480.0, (8, 2): 114688.0, (12, 4): 510.0, (6, 2): 28.0, (4, 1): 6.0}
#: the mantissa width DeepSpeed fixes for each q_bits other than 8
_FIXED_MANTISSA = {12: 4, 6: 2, 4: 1}


def _format(q_bits: int, q_mantisa_bits: int) -> tuple[int, int]:
    """(exponent bits, mantissa bits) of ``q_bits`` (8 keeps the mantissa asked for, as DeepSpeed)."""
    mantissa = _FIXED_MANTISSA.get(q_bits, q_mantisa_bits)
    if (q_bits, mantissa) not in Q_RANGE:
        raise ValueError(f"FP quantizer: q_bits={q_bits} with q_mantisa_bits={mantissa} is not a format it has; "
                         "expected 8 (E4M3 or E5M2), 12, 6 or 4")
    return q_bits - mantissa - 1, mantissa


def encode(values: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
    """The int32 codes of ``values`` (float32, already scaled) in the (exp_bits, man_bits) format, rounded to the
    nearest (ties to even) and saturated at the largest finite value."""
    bias = 2 ** (exp_bits - 1) - 1
    min_exp, max_exp = 1 - bias, 2**exp_bits - 1 - bias
    largest = (2 - 2.0**-man_bits) * 2.0**max_exp
    magnitude = values.abs().to(torch.float64).clamp_(max=largest)
    exponent = torch.frexp(magnitude).exponent.to(torch.float64) - 1  # floor(log2); 0 gives -1, clamped below
    step = torch.exp2(exponent.clamp_(min_exp, max_exp) - man_bits)
    rounded = torch.round(magnitude / step) * step  # may carry into the next binade: re-read its exponent
    rounded.clamp_(max=largest)
    exponent = (torch.frexp(rounded).exponent.to(torch.float64) - 1).clamp_(min_exp, max_exp)
    normal = rounded >= 2.0**min_exp
    field = torch.where(normal, exponent + bias, torch.zeros_like(exponent))
    mantissa = torch.where(normal, rounded / torch.exp2(exponent - man_bits) - 2**man_bits,
                           rounded / 2.0 ** (min_exp - man_bits))
    sign = (values < 0).to(torch.int32)
    return (sign << (exp_bits + man_bits)) | (field.to(torch.int32) << man_bits) | mantissa.round().to(torch.int32)


def decode(codes: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
    """The float32 values of int32 ``codes``."""
    bias = 2 ** (exp_bits - 1) - 1
    mantissa = (codes & (2**man_bits - 1)).to(torch.float32)
    field = ((codes >> man_bits) & (2**exp_bits - 1)).to(torch.float32)
    magnitude = torch.where(field > 0, (2**man_bits + mantissa) * torch.exp2(field - bias - man_bits),
                            mantissa * 2.0 ** (1 - bias - man_bits))
    return torch.where((codes >> (exp_bits + man_bits)) & 1 == 1, -magnitude, magnitude)


def _pack(codes: torch.Tensor, q_bits: int) -> torch.Tensor:
    """Rows of int32 codes as rows of bytes, ``q_bits`` each, least-significant bit first."""
    if q_bits == 8:
        return codes.to(torch.uint8)
    bits = (codes.unsqueeze(-1) >> torch.arange(q_bits, device=codes.device)) & 1
    bits = bits.reshape(codes.shape[0], -1, 8).to(torch.uint8)
    return (bits << torch.arange(8, device=codes.device, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def _unpack(data: torch.Tensor, q_bits: int) -> torch.Tensor:
    if q_bits == 8:
        return data.to(torch.int32)
    bits = (data.to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=data.device)) & 1
    bits = bits.reshape(data.shape[0], -1, q_bits)
    return (bits << torch.arange(q_bits, device=data.device)).sum(-1, dtype=torch.int32)


class GroupSized(Protocol):
    """What ``FP_Quantize`` reads of its config (``deepspeed.linear.QuantizationConfig``): values per scale."""

    group_size: int


class Quantizer(abc.ABC):
    """DeepSpeed's interface of a group quantizer (``group_size`` values per scale)."""

    def __init__(self, group_size: int = 512) -> None:
        self.group_size = group_size

    @abc.abstractmethod
    def quantize(self, input: torch.Tensor, q_bits: int = 8, q_mantisa_bits: int = 3, stochastic_mode: bool = False,
                 return_meta_tensor: bool = False) -> Any: ...

    @abc.abstractmethod
    def dequantize(self, input_q: torch.Tensor, fp_out: torch.Tensor | None = None, q_bits: int = 8,
                   q_mantisa_bits: int = 3, scale: torch.Tensor | None = None) -> torch.Tensor: ...


class FP_Quantize(Quantizer):  # noqa: N801 (DeepSpeed's name)
    """Group-wise FP8/FP12/FP6/FP4 quantization (``quantization_config.group_size`` values per scale)."""

    def __init__(self, quantization_config: GroupSized) -> None:
        super().__init__(group_size=quantization_config.group_size)
        self.q_config = quantization_config
        self.orig_dtype: torch.dtype | None = None
        self.orig_shape: torch.Size | None = None
        self.num_groups: int | None = None
        self.scale: torch.Tensor | None = None

    def quantize(self, input: torch.Tensor, q_bits: int = 8, q_mantisa_bits: int = 3, stochastic_mode: bool = False,
                 return_meta_tensor: bool = False) -> Any:
        """The quantized rows (codes then the 4-byte multiplier); with ``return_meta_tensor`` (8 bits only) the
        codes in ``input``'s shape and the ``[num_groups, 4]`` multipliers apart."""
        if stochastic_mode:
            raise ValueError("FP_Quantize: stochastic_mode=True is not supported (round to nearest only)")
        if return_meta_tensor and q_bits != 8:
            raise ValueError("FP_Quantize: return_meta_tensor needs q_bits=8")
        if input.numel() % self.group_size:
            raise ValueError(f"FP_Quantize: {input.numel()} values do not split into groups of {self.group_size}")
        exp_bits, man_bits = _format(q_bits, q_mantisa_bits)
        self.orig_dtype, self.orig_shape = input.dtype, input.shape
        groups = input.reshape(-1, self.group_size).to(torch.float32)
        self.num_groups = groups.shape[0]
        peak = groups.abs().amax(dim=-1, keepdim=True)
        multiplier = torch.where(peak > 0, peak / Q_RANGE[(q_bits, man_bits)], torch.ones_like(peak))
        data = _pack(encode(groups / multiplier, exp_bits, man_bits), q_bits)
        scale = multiplier.contiguous().view(torch.uint8)  # [num_groups, 4]
        if return_meta_tensor:
            self.scale = scale
            return data.reshape(input.shape), scale
        return torch.cat([data, scale], dim=-1)

    def to(self, *args: object, **kwargs: object) -> None:
        if self.scale is not None:
            self.scale = self.scale.to(*args, **kwargs)

    def get_scales(self) -> torch.Tensor:
        """The float32 dequantization multipliers of the last ``return_meta_tensor`` call, ``[num_groups, 1]``."""
        return self.scale.view(torch.float32)

    def _values(self, input_q: torch.Tensor, q_bits: int, q_mantisa_bits: int,
                scale: torch.Tensor | None) -> torch.Tensor:
        """float32 values, one group a row, of quantized rows (or of codes and their ``scale``)."""
        if self.orig_dtype is None:
            raise RuntimeError("FP_Quantize: call quantize before dequantizing")
        exp_bits, man_bits = _format(q_bits, q_mantisa_bits)
        code_bytes = self.group_size * q_bits // 8
        rows = input_q.reshape(-1, code_bytes) if scale is not None else input_q.reshape(-1, code_bytes + 4)
        data, multiplier = (rows, scale) if scale is not None else (rows[:, :code_bytes], rows[:, code_bytes:])
        multiplier = multiplier.reshape(-1, 4).contiguous().view(torch.float32)
        return decode(_unpack(data, q_bits), exp_bits, man_bits) * multiplier

    def dequantize(self, input_q: torch.Tensor, fp_out: torch.Tensor | None = None, q_bits: int = 8,
                   q_mantisa_bits: int = 3, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The values back in the quantized tensor's dtype and shape (written into ``fp_out`` when given)."""
        values = self._values(input_q, q_bits, q_mantisa_bits, scale).to(self.orig_dtype).reshape(self.orig_shape)
        return values if fp_out is None else fp_out.copy_(values)

    def selective_dequantize(self, input_q: torch.Tensor, indexes: torch.Tensor, fp_out: torch.Tensor | None = None,
                             q_bits: int = 8, q_mantisa_bits: int = 3,
                             scale: torch.Tensor | None = None) -> torch.Tensor:
        """Only the rows ``indexes`` (dimension 0) of a quantized 3-D tensor (experts' weights), dequantized."""
        if self.orig_shape is None or len(self.orig_shape) != 3:
            raise ValueError("FP_Quantize.selective_dequantize works on a 3-D tensor; quantize one of those first")
        values = self._values(input_q, q_bits, q_mantisa_bits, scale).reshape(self.orig_shape[0], -1)
        values = values[indexes.long()].to(self.orig_dtype).reshape(-1, *self.orig_shape[1:])
        return values if fp_out is None else fp_out.copy_(values)


def matmul_fp8(inp: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, quantization_group_size: int,
               quantizer: FP_Quantize) -> torch.Tensor:
    """``inp @ W`` with ``W`` the FP8 ``weight`` (codes and ``scale`` from ``quantize(..., return_meta_tensor=True)``)
    dequantized (DeepSpeed's fallback; its Triton kernel is not served)."""
    return torch.matmul(inp, quantizer.dequantize(weight, scale=scale))
