"""Group-wise INT4/INT8 weight quantization (DeepSpeed's ``deepspeed.inference.quantization.utils``), the op under
the ``weight_quantization`` config section: ``zero.Init``'s ``quantized_initialization`` and the layers of
``post_init_quant`` (:mod:`dsrun.inference.quantization`) both store weights this way.

Each group of ``group_size`` consecutive values along ``group_dim`` is quantized asymmetrically to ``num_bits``:
``q = round(clamp((x - min) * scale, 0, 2**bits - 1))`` with ``scale = (2**bits - 1) / (max - min)`` (a group whose
values are all equal keeps scale 1, so it comes back exactly), and comes back as ``q / scale + min``: within half
a step, ``(max - min) / (2**bits - 1) / 2``. INT4 packs two values per byte along the last dimension, the
even-indexed one in the high nibble. A quantized weight keeps DeepSpeed's layout: one flat tensor of the weight's
dtype holding the quantized bytes, then the scales, then the minima, with ``weight.deconcat(weight)`` to split it
and ``weight.dequantizer`` to restore it; a forward dequantizes into a temporary and runs the float op.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

QUANTIZED_ATTR = "weight_quantized"  # DeepSpeed's mark on a parameter holding the layout above
FULL_SHAPE_ATTR = "ds_quantized_from_shape"  # the shape of the float weight it was quantized from
_AS_FLOAT_ATTR = "ds_quantized_as_float"  # inside float_weights: the parameter holds its float weight for now
STORAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the layers whose ``weight`` zero.Init's quantized_initialization quantizes (their exact types, as DeepSpeed's)
WEIGHT_QUANTIZATION_LAYERS = (nn.Linear, nn.Embedding)


def _check(config: Mapping[str, Any]) -> None:
    if config.get("num_bits") not in (4, 8):
        raise ValueError(f"weight quantization num_bits: {config.get('num_bits')!r}; expected 4 or 8 (INT4, INT8)")
    if config.get("symmetric", False):
        raise ValueError("weight quantization symmetric: true is not supported; set symmetric: false (asymmetric "
                         "min/scale quantization)")


def _grouped(tensor: Tensor, config: Mapping[str, Any]) -> Tensor:
    """``tensor`` viewed with ``group_dim`` split into ``(groups, group_size)``."""
    dim, size, shape = config["group_dim"], config["group_size"], tensor.shape
    if dim >= len(shape) or shape[dim] % size:
        raise ValueError(f"weight quantization group_size {size} does not divide dimension {dim} of a tensor of "
                         f"shape {tuple(shape)}; pick a group_dim and a group_size that divides it")
    return tensor.reshape(shape[:dim] + (shape[dim] // size, size) + shape[dim + 1:])


class Quantizer:
    """``quantize(tensor) -> (quantized uint8, scale, min)``; scale and min per group, in the tensor's dtype."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        _check(config)
        self.config = config

    def quantize(self, tensor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        grouped = _grouped(tensor.to(torch.float32), self.config)
        axis = self.config["group_dim"] + 1
        q_range = 2 ** self.config["num_bits"] - 1
        low, high = grouped.amin(dim=axis, keepdim=True), grouped.amax(dim=axis, keepdim=True)
        spread = high - low
        scale = torch.where(spread > 0, q_range / spread.clamp_min(torch.finfo(torch.float32).tiny),
                            torch.ones_like(spread))
        quantized = ((grouped - low) * scale).clamp_(0, q_range).round_().to(torch.uint8).reshape(tensor.shape)
        if self.config["num_bits"] == 4:
            quantized = self._compress_uint8_to_uint4(quantized)
        return quantized, scale.to(tensor.dtype), low.to(tensor.dtype)

    @staticmethod
    def _compress_uint8_to_uint4(tensor: Tensor) -> Tensor:
        if tensor.shape[-1] % 2:
            raise ValueError(f"INT4 packs two values per byte along the last dimension; {tensor.shape[-1]} is odd")
        return tensor[..., 0::2].bitwise_left_shift(4).bitwise_or_(tensor[..., 1::2])


class DeQuantizer:
    """``dequantize(quantized, scale, min)``: ``q / scale + min`` in ``dtype``."""

    def __init__(self, config: Mapping[str, Any], dtype: torch.dtype) -> None:
        _check(config)
        self.config, self.dtype = config, dtype

    def dequantize(self, tensor: Tensor, quant_scale: Tensor, quant_min: Tensor) -> Tensor:
        if self.config["num_bits"] == 4:
            tensor = self._decompress_uint4_to_uint8(tensor)
        grouped = _grouped(tensor, self.config).to(self.dtype)
        return grouped.div_(quant_scale.to(self.dtype)).add_(quant_min.to(self.dtype)).reshape(tensor.shape)

    @staticmethod
    def _decompress_uint4_to_uint8(tensor: Tensor) -> Tensor:
        out = torch.empty(tensor.shape[:-1] + (tensor.shape[-1] * 2,), dtype=torch.uint8, device=tensor.device)
        out[..., 0::2] = tensor.bitwise_right_shift(4)
        out[..., 1::2] = tensor.bitwise_and(0xF)
        return out


def concat_to_compat_param(quantized_weight: Tensor, quant_scale: Tensor, quant_min: Tensor,
                           return_param: bool = True) -> nn.Parameter | Tensor:
    """The three tensors (of one dtype) flattened into one, with ``deconcat(t) -> (weight, scale, min)`` views."""
    shapes = (quantized_weight.shape, quant_scale.shape, quant_min.shape)
    compat = torch.cat([quantized_weight.flatten(), quant_scale.flatten(), quant_min.flatten()])
    if return_param:
        compat = nn.Parameter(compat, requires_grad=False)

    def deconcat(flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        parts, start = [], 0
        for shape in shapes:
            parts.append(flat.narrow(0, start, shape.numel()).view(shape))
            start += shape.numel()
        return parts[0], parts[1], parts[2]

    compat.deconcat = deconcat
    return compat


def quantized_compat(weight: Tensor, quantizer: Quantizer, return_param: bool = True) -> nn.Parameter | Tensor:
    """``weight`` quantized into the compat layout: its quantized bytes viewed as its own dtype (so the last
    dimension of those bytes must be a multiple of the dtype's size), then the scales and minima."""
    if weight.dtype not in STORAGE_DTYPES:
        raise ValueError(f"weight quantization: a {weight.dtype} weight; expected float16, bfloat16 or float32 "
                         "(the quantized bytes are stored in the weight's dtype)")
    quantized, scale, low = quantizer.quantize(weight.detach())
    size = weight.element_size()
    if quantized.shape[-1] % size:
        raise ValueError(f"weight quantization: a {weight.dtype} weight of shape {tuple(weight.shape)} quantizes to "
                         f"{quantized.shape[-1]} bytes per row, not a multiple of {size}; store the model in "
                         "float16/bfloat16 or use 8 bits")
    compat = concat_to_compat_param(quantized.view(weight.dtype), scale, low, return_param)
    setattr(compat, FULL_SHAPE_ATTR, tuple(weight.shape))
    return compat


def dequantized(weight: Tensor) -> Tensor:
    """The float weight a compat-layout ``weight`` stands for (a new tensor)."""
    quantized, scale, low = weight.deconcat(weight)
    return weight.dequantizer.dequantize(quantized.view(torch.uint8), scale, low)


def _quantize_param(param: nn.Parameter, quant_config: Mapping[str, Any]) -> None:
    """DeepSpeed's ``_quantize_param``: ``param`` (the same object) now holds its values in the compat layout,
    marked ``weight_quantized``, with its ``quantizer``, ``dequantizer`` and ``deconcat``. The integer codes take
    no gradient, so the parameter is frozen (DeepSpeed leaves ``requires_grad`` on and only ever runs such a model
    for inference; an optimizer stepping the codes as floats would corrupt them)."""
    if getattr(param, QUANTIZED_ATTR, False):
        raise ValueError("weight quantization: this parameter is already quantized")
    quantizer = Quantizer(quant_config)
    compat = quantized_compat(param.data, quantizer, return_param=False)
    param.data = compat
    param.deconcat = compat.deconcat
    param.quantizer, param.dequantizer = quantizer, DeQuantizer(quant_config, param.dtype)
    setattr(param, FULL_SHAPE_ATTR, getattr(compat, FULL_SHAPE_ATTR))
    param.requires_grad_(False)
    setattr(param, QUANTIZED_ATTR, True)


@contextlib.contextmanager
def float_weights(params: Iterable[Tensor]) -> Iterator[None]:
    """Inside the block each quantized parameter of ``params`` (whole: gathered, if ZeRO-3 partitioned it) holds its
    dequantized float weight, and is quantized again from what the block left there on exit: an initialisation
    that writes a quantized layer's weight (a ``torch.nn.init`` function, ``module.apply``) sets the values it
    means instead of overwriting the codes' bytes. Other parameters are untouched."""
    quantized = [p for p in params if getattr(p, QUANTIZED_ATTR, False) and not getattr(p, _AS_FLOAT_ATTR, False)]
    for param in quantized:  # (one already inside an outer block stays that block's)
        param.data = dequantized(param)
        setattr(param, _AS_FLOAT_ATTR, True)
    try:
        yield
    finally:
        for param in quantized:
            param.data = quantized_compat(param.data, param.quantizer, return_param=False)
            delattr(param, _AS_FLOAT_ATTR)


def wrap_quantized_functional(f: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``f(input, weight, ...)`` (``F.linear``, ``F.embedding``) that dequantizes a quantized ``weight`` into a
    temporary first."""
    @functools.wraps(f)
    def wrapper(input: Tensor, weight: Tensor, *args: object, **kwargs: object) -> Tensor:
        if getattr(weight, QUANTIZED_ATTR, False):
            return f(input, dequantized(weight), *args, **kwargs)
        return f(input, weight, *args, **kwargs)

    wrapper._ds_quantized = True  # type: ignore[attr-defined]
    return wrapper


def wrap_load_from_state_dict(f: Callable[..., None]) -> Callable[..., None]:
    """A layer's ``_load_from_state_dict`` that quantizes an incoming float ``weight`` for a quantized weight
    (a compat-layout tensor, e.g. from a checkpoint of the quantized model, loads as it is)."""
    @functools.wraps(f)
    def wrapper(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: object) -> None:
        weight, key = getattr(module, "weight", None), prefix + "weight"
        incoming = state_dict.get(key)
        if (getattr(weight, QUANTIZED_ATTR, False) and isinstance(incoming, Tensor)
                and tuple(incoming.shape) == getattr(weight, FULL_SHAPE_ATTR, None)):
            state_dict[key] = quantized_compat(incoming.to(weight.dtype), weight.quantizer, return_param=False)
            try:
                return f(module, state_dict, prefix, *args)
            finally:
                state_dict[key] = incoming
        return f(module, state_dict, prefix, *args)

    wrapper._ds_quantized = True  # type: ignore[attr-defined]
    return wrapper


def install_quantized_functionals() -> None:
    """Route ``F.linear``/``F.embedding`` and the layers' state-dict loading through the wrappers above, for the
    rest of the process, as DeepSpeed's ``zero.Init`` does (over whatever ``F.linear`` is then: ZeRO-3's linear
    under ``memory_efficient_linear``). Idempotent: each is wrapped once."""
    functional = torch.nn.functional
    for name in ("linear", "embedding"):
        if not getattr(getattr(functional, name), "_ds_quantized", False):
            setattr(functional, name, wrap_quantized_functional(getattr(functional, name)))
    for cls in WEIGHT_QUANTIZATION_LAYERS:
        if not getattr(cls._load_from_state_dict, "_ds_quantized", False):
            cls._load_from_state_dict = wrap_load_from_state_dict(cls._load_from_state_dict)
