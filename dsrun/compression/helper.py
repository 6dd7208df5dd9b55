"""``deepspeed.compression.helper``: module lookup by dotted name, and GPT-2's Conv1D turned into ``nn.Linear``.

Compression matches ``nn.Linear`` layers; Hugging Face's GPT-2 stores its projections as ``Conv1D`` (weight
``[in, out]``, ``y = x @ W + b``). :func:`convert_conv1d_to_linear` swaps each for an ``nn.Linear`` holding the
transposed weight, which computes the same function.
"""
from __future__ import annotations

import torch
from torch import nn


def recursive_getattr(model: nn.Module, module_name: str) -> nn.Module:
    """The submodule of ``model`` at ``module_name`` (``"transformer.h.0.attn"``)."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """Replace the submodule at ``module_name`` with ``module``."""
    parent_name, _, child = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, child, module)


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace every submodule of class ``convert_type`` (a Conv1D with ``weight`` ``[in, out]``) by an equal
    ``nn.Linear``; returns ``model``."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, convert_type)]
    for name, module in targets:
        weight = module.weight.data
        in_features, out_features = weight.shape
        linear = nn.Linear(in_features, out_features, bias=module.bias is not None,
                           device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            if module.bias is not None:
                linear.bias.copy_(module.bias.data)
        recursive_setattr(model, name, linear)
    return model
