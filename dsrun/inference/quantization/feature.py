"""The ``weight_quantization`` section as an engine feature: ``dsrun.initialize`` stores the model's weights
group-wise quantized before the optimizer and the ZeRO strategy see them (``wrap_model``).

DeepSpeed's engine reads the section nowhere: ``quantized_initialization`` acts inside ``zero.Init`` built with the
config (the Hugging Face loader does so under ``HfDeepSpeedConfig``), ``post_init_quant`` when the caller runs
``_init_group_wise_weight_quantization``. dsrun does both there too (:mod:`dsrun.zero.init`, :mod:`.groupwise`), and
applies whatever the caller did not to the model ``dsrun.initialize`` takes, so a config that sets the key always
gets it: layers already quantized are left as they are. The quantized weights are frozen (integer codes take no
gradient); the rest of the model trains. Weights are quantized in the dtype the engine then casts the model to
(fp16/bf16), so the cast leaves their bytes alone; a weight already quantized in another dtype is refused, since
the cast would convert its bytes as numbers.
"""
from __future__ import annotations

import torch
from torch import nn

from dsrun.config import DSConfig
from dsrun.config.misc import WeightQuantConfig
from dsrun.features import Feature
from dsrun.ops.groupwise_quant import (QUANTIZED_ATTR, WEIGHT_QUANTIZATION_LAYERS, _quantize_param,
                                       install_quantized_functionals)

from .groupwise import quantize_layers


def quantized_weights(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` held in the quantized layout (each once)."""
    seen: dict[int, nn.Parameter] = {}
    for param in model.parameters():
        if getattr(param, QUANTIZED_ATTR, False) or hasattr(param, "deconcat"):
            seen.setdefault(id(param), param)
    return list(seen.values())


class WeightQuantizationFeature(Feature):
    """Applies ``weight_quantization`` to the model of one engine."""

    name = "weight_quantization"

    def __init__(self, section: WeightQuantConfig, model_dtype: torch.dtype | None):
        self.section = section
        self.model_dtype = model_dtype  # the dtype the engine casts the model to; None: the model's own

    @classmethod
    def build(cls, config: DSConfig) -> "WeightQuantizationFeature | None":
        section = config.weight_quantization
        if section is None or not section.active:
            return None
        if int(config.tensor_parallel.autotp_size) > 1:
            raise ValueError("weight_quantization with tensor_parallel.autotp_size > 1: AutoTP cannot split "
                             "quantized weights; drop one of the two")
        dtype = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None
        return cls(section, dtype)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.section.post_init_quant:
            self._to_model_dtype(model, [m for n, m in model.named_modules() if type(m) in WEIGHT_QUANTIZATION_LAYERS
                                         and any(key in n for key in self.section.post_init_quant)])
            quantize_layers(model, {key: rule.model_dump() for key, rule in self.section.post_init_quant.items()})
        rule = self.section.quantized_initialization
        if rule is not None:
            layers = [m for m in model.modules() if type(m) in WEIGHT_QUANTIZATION_LAYERS
                      and not getattr(m.weight, QUANTIZED_ATTR, False)]
            partitioned = [m for m in layers if hasattr(m.weight, "ds_id")]
            if partitioned:
                raise ValueError("weight_quantization.quantized_initialization: the model was partitioned by zero.Init "
                                 "without it; pass the same config to zero.Init(config_dict_or_path=...) so each "
                                 "weight is quantized before it is partitioned")
            self._to_model_dtype(model, layers)
            for module in layers:
                _quantize_param(module.weight, rule.model_dump())
            install_quantized_functionals()
        if self.model_dtype is not None:
            wrong = [p for p in quantized_weights(model) if p.dtype != self.model_dtype]
            if wrong:
                raise ValueError(f"weight_quantization: {len(wrong)} weight(s) were quantized in {wrong[0].dtype} but "
                                 f"the engine casts the model to {self.model_dtype} (fp16/bf16), which would convert "
                                 "their bytes as numbers; convert the model to that dtype before quantizing it")
        return model

    def _to_model_dtype(self, model: nn.Module, layers: list[nn.Module]) -> None:
        """The weights about to be quantized, in the dtype the engine will cast the model to."""
        if self.model_dtype is None:
            return
        for module in layers:
            if module.weight.is_floating_point() and module.weight.dtype != self.model_dtype:
                module.weight.data = module.weight.data.to(self.model_dtype)
