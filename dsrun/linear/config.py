"""``deepspeed.linear.config``: the two dataclasses :class:`~dsrun.linear.OptimizedLinear` takes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# the Llama-3.1 projections DeepSpeed's LoRA targets by default
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """``lora_r``: the adapters' rank; ``lora_alpha``: their scale (the output adds ``lora_alpha / lora_r``
    times theirs); ``base_weight_sharding``: over how many ranks (the world) the frozen base weight is split, 1
    for none; ``offload``/``offload_ratio``: DeepSpeed moves that share of the base weights to host memory between
    uses (refused by dsrun: the weights stay where the model is); ``delay_lora_init``: build the adapters later,
    with :func:`~dsrun.linear.init_lora`; ``target_mods``: module names that keep LoRA when a state dict is loaded
    (any other becomes a plain linear)."""

    lora_r: int = 64
    lora_alpha: float = 16.0
    base_weight_sharding: int = 1
    offload: bool = False
    offload_ratio: float = 0.0
    delay_lora_init: bool = False
    target_mods: list[str] = field(default_factory=lambda: list(LLAMA_TARGETS))


@dataclass
class QuantizationConfig:
    """DeepSpeed's FP quantization of the base weight: ``q_bits`` (6, 8 or 12), ``mantissa_bits``, ``group_size``
    elements per scale, ``q_dtype`` of the stored bytes (see :mod:`dsrun.linear.quantization`)."""

    q_bits: int = 8
    mantissa_bits: int = 3
    group_size: int = 512
    q_dtype: torch.dtype = torch.uint8
