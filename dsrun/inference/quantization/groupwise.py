"""DeepSpeed's group-wise INT4/INT8 weight quantization of a model's layers (``deepspeed.inference.quantization``:
its ``utils``, ``layers`` and ``quantization`` modules are this one; the quantizer itself, with ``utils``' names, is
:mod:`dsrun.ops.groupwise_quant`, which ``zero.Init`` uses too).

``post_init_quant`` replaces each named ``nn.Linear``/``nn.Embedding`` by a quantized layer whose weight is one
frozen parameter in DeepSpeed's compat layout (the quantized bytes, then the scales, then the minima); its forward
dequantizes into a temporary and runs the float op.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from dsrun.ops.groupwise_quant import (WEIGHT_QUANTIZATION_LAYERS, DeQuantizer, Quantizer, _quantize_param,
                                       concat_to_compat_param, dequantized, quantized_compat,
                                       wrap_load_from_state_dict, wrap_quantized_functional)
from dsrun.utils.logging import logger

__all__ = ["DeQuantizer", "QUANTIZATION_LAYER_MAPPINGS", "QuantizedEmbedding", "QuantizedLinear", "Quantizer",
           "WEIGHT_QUANTIZATION_LAYERS", "_init_group_wise_weight_quantization", "_quantize_param",
           "concat_to_compat_param", "quantize_layers", "recursive_setattr", "wrap_load_from_state_dict",
           "wrap_quantized_functional"]


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
        return F.linear(input, dequantized(self.weight), self.bias)


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
        return F.embedding(input, dequantized(self.weight), self.padding_idx)


def _shared_or_new(shared: dict[int, nn.Parameter] | None, weight: nn.Parameter,
                   quantizer: Quantizer) -> nn.Parameter:
    """A weight tied between layers is quantized once; its layers share the quantized parameter."""
    if shared is None:
        return quantized_compat(weight.data, quantizer)
    if id(weight) not in shared:
        shared[id(weight)] = quantized_compat(weight.data, quantizer)
    return shared[id(weight)]


QUANTIZATION_LAYER_MAPPINGS: dict[type[nn.Module], Callable[..., nn.Module]] = {
    nn.Linear: QuantizedLinear,
    nn.Embedding: QuantizedEmbedding,
}


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted path ``module_name`` of ``model``."""
    parent, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_layers(model: nn.Module, rules: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """Replace each ``nn.Linear``/``nn.Embedding`` of ``model`` whose name contains a key of ``rules`` by its
    quantized layer with that key's settings (in place); returns the names replaced, by key. A name matching two
    keys is an error; smaller weights are quantized first, as DeepSpeed does. A weight zero.Init partitioned is
    refused (DeepSpeed gathers it inside a quantization context; dsrun quantizes whole weights only: quantize
    before the model is partitioned, or build it under zero.Init with ``quantized_initialization``)."""
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
        if not keys:
            continue
        if hasattr(module.weight, "ds_id"):
            raise ValueError(f"weight_quantization.post_init_quant: {name}.weight is partitioned by zero.Init; "
                             "expected a whole weight: quantize before partitioning (let dsrun.initialize apply "
                             "post_init_quant), or use weight_quantization.quantized_initialization in zero.Init")
        recursive_setattr(model, name, QUANTIZATION_LAYER_MAPPINGS[type(module)](rules[keys[0]], module, shared))
        matched.setdefault(keys[0], []).append(name)
    logger.info("Group-wise weight quantization: %d module(s) quantized (%s)", sum(map(len, matched.values())),
                "; ".join(f"{key}: {', '.join(names)}" for key, names in matched.items()))
    return matched


def _init_group_wise_weight_quantization(model: nn.Module, ds_config: Mapping[str, Any]) -> nn.Module:
    """DeepSpeed's entry point: :func:`quantize_layers` with ``ds_config["weight_quantization"]["post_init_quant"]``
    (in place; returned)."""
    try:
        rules = ds_config["weight_quantization"]["post_init_quant"]
    except (KeyError, TypeError):
        raise ValueError("_init_group_wise_weight_quantization: ds_config has no weight_quantization.post_init_quant; "
                         "expected {'weight_quantization': {'post_init_quant': {name_part: {num_bits, group_size, "
                         "group_dim, symmetric}}}}") from None
    quantize_layers(model, rules)
    return model
