"""DeepSpeed's group-wise INT4/INT8 weight quantization (``deepspeed.inference.quantization``: its ``utils``,
``layers`` and ``quantization`` modules are this one).

Each group of ``group_size`` consecutive values along ``group_dim`` is quantized asymmetrically to ``num_bits``:
``q = round(clamp((x - min) * scale, 0, 2**bits - 1))`` with ``scale = (2**bits - 1) / (max - min)`` (a group whose
values are all equal keeps scale 1, so it comes back exactly), and comes back as ``q / scale + min``. INT4 packs
two values per byte along the last dimension, the even-indexed one in the high nibble. A quantized layer keeps
DeepSpeed's weight layout: one flat parameter of the weight's dtype holding the quantized bytes, then the scales,
then the minima, with ``weight.deconcat(weight)`` to split it and ``weight.dequantizer`` to restore it; the forward
dequantizes into a temporary and runs the float op.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsrun.utils.logging import logger


def _check(config: Mapping[str, Any]) -> None:
    if config.get("num_bits") not in (4, 8):
        raise ValueError(f"weight quantization num_bits: {config.get('num_bits')!r}; expected 4 or 8 (INT4, INT8)")
    if config.get("symmetric", False):
        raise ValueError("weight quantization symmetric: true is not supported; set symmetric: false (asymmetric "
                         "min/scale quantization)")


def _grouped(tensor: Tensor, config: Mapping[str, Any]) -> Tensor:
    """``tensor`` viewed with ``group_dim`` split into ``(groups, group_size)``."""
    dim, size, shape = config["group_dim"], config["group_size"], tensor.shape
    if shape[dim] % size:
        raise ValueError(f"weight quantization group_size {size} does not divide dimension {dim} of a tensor of "
                         f"shape {tuple(shape)}; pick a group_size that divides it")
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


def _quantized_weight(weight: Tensor, quantizer: Quantizer) -> nn.Parameter:
    """``weight`` quantized into DeepSpeed's compat layout (bytes viewed as the weight's 2-byte dtype)."""
    if weight.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"weight quantization: a {weight.dtype} weight; expected float16 or bfloat16 (the quantized "
                         "bytes are stored in the weight's dtype): convert the model with .half() first")
    quantized, scale, low = quantizer.quantize(weight.data)
    return concat_to_compat_param(quantized.view(weight.dtype), scale, low)


def _dequantized(weight: nn.Parameter) -> Tensor:
    quantized, scale, low = weight.deconcat(weight)
    return weight.dequantizer.dequantize(quantized.view(torch.uint8), scale, low)


class QuantizedLinear(nn.Linear):
    """``pre_quant_layer`` with its weight group-wise quantized (``config``: ``num_bits``, ``group_size``,
    ``group_dim``, ``symmetric``); the bias stays as it was."""

    def __init__(self, config: Mapping[str, Any], pre_quant_layer: nn.Linear,
                 _shared: dict[int, nn.Parameter] | None = None) -> None:
        weight = pre_quant_layer.weight
        super().__init__(pre_quant_layer.in_features, pre_quant_layer.out_features, bias=False, device="meta",
                         dtype=weight.dtype)
        self.config, self.quantizer = config, Quantizer(config)
        self.bias = pre_quant_layer.bias
        self.weight = _shared_or_new(_shared, weight, self.quantizer)
        self.weight.dequantizer = DeQuantizer(config, weight.dtype)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, _dequantized(self.weight), self.bias)


class QuantizedEmbedding(nn.Embedding):
    """``pre_quant_layer`` with its table group-wise quantized (plain lookups only: no ``max_norm``, sparse
    gradients or frequency scaling, as in DeepSpeed)."""

    def __init__(self, config: Mapping[str, Any], pre_quant_layer: nn.Embedding,
                 _shared: dict[int, nn.Parameter] | None = None) -> None:
        layer = pre_quant_layer
        if layer.max_norm is not None or layer.scale_grad_by_freq or layer.sparse:
            raise ValueError("QuantizedEmbedding: max_norm, scale_grad_by_freq and sparse are not supported")
        super().__init__(layer.num_embeddings, layer.embedding_dim, padding_idx=layer.padding_idx, device="meta",
                         dtype=layer.weight.dtype)
        self.config = config
        self.weight = _shared_or_new(_shared, layer.weight, Quantizer(config))
        self.weight.dequantizer = DeQuantizer(config, layer.weight.dtype)

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, _dequantized(self.weight), self.padding_idx)


def _shared_or_new(shared: dict[int, nn.Parameter] | None, weight: nn.Parameter,
                   quantizer: Quantizer) -> nn.Parameter:
    """A weight tied between layers is quantized once; its layers share the quantized parameter."""
    if shared is None:
        return _quantized_weight(weight, quantizer)
    if id(weight) not in shared:
        shared[id(weight)] = _quantized_weight(weight, quantizer)
    return shared[id(weight)]


QUANTIZATION_LAYER_MAPPINGS: dict[type[nn.Module], Callable[..., nn.Module]] = {
    nn.Linear: QuantizedLinear,
    nn.Embedding: QuantizedEmbedding,
}


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted path ``module_name`` of ``model``."""
    parent, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _init_group_wise_weight_quantization(model: nn.Module, ds_config: Mapping[str, Any]) -> nn.Module:
    """Replace each ``nn.Linear``/``nn.Embedding`` whose name contains a key of
    ``ds_config["weight_quantization"]["post_init_quant"]`` by its quantized layer with that key's settings (in
    place; returned). A name matching two keys is an error; smaller weights are quantized first, as DeepSpeed
    does. ZeRO-3 configs (DeepSpeed quantizes gathered partitions inside ``zero.Init``) are refused."""
    try:
        rules = ds_config["weight_quantization"]["post_init_quant"]
    except (KeyError, TypeError):
        raise ValueError("_init_group_wise_weight_quantization: ds_config has no weight_quantization.post_init_quant; "
                         "expected {'weight_quantization': {'post_init_quant': {name_part: {num_bits, group_size, "
                         "group_dim, symmetric}}}}") from None
    if (ds_config.get("zero_optimization") or {}).get("stage") == 3:
        raise ValueError("_init_group_wise_weight_quantization: zero_optimization.stage 3 is not supported (the "
                         "quantized partitions of zero.Init are not built); quantize before a stage 0-2 engine")
    candidates = [(name, module) for name, module in model.named_modules()
                  if type(module) in QUANTIZATION_LAYER_MAPPINGS]
    candidates.sort(key=lambda item: item[1].weight.numel())
    shared: dict[int, nn.Parameter] = {}
    matched: dict[str, list[str]] = {}
    for name, module in candidates:
        keys = [key for key in rules if key in name]
        if len(keys) > 1:
            raise ValueError(f"weight_quantization.post_init_quant: {name} matches both {keys[0]!r} and {keys[1]!r}; "
                             "make the keys name distinct modules")
        if keys:
            recursive_setattr(model, name, QUANTIZATION_LAYER_MAPPINGS[type(module)](rules[keys[0]], module, shared))
            matched.setdefault(keys[0], []).append(name)
    logger.info("Group-wise weight quantization: %d module(s) quantized (%s)", sum(map(len, matched.values())),
                "; ".join(f"{key}: {', '.join(names)}" for key, names in matched.items()))
    return model
