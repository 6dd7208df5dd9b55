"""``deepspeed.linear.Init`` and ``init_lora``: build a model's linears as LoRA ``OptimizedLinear`` layers."""
from __future__ import annotations

import sys
from typing import Any

import torch

from dsrun.utils.logging import logger

from .config import LoRAConfig, QuantizationConfig
from .optimized_linear import LoRAOptimizedLinear, OptimizedLinear


def init_lora(model: torch.nn.Module) -> None:
    """Freeze every parameter of ``model`` and build the LoRA adapters of each ``LoRAOptimizedLinear`` (those
    a state-dict load turned back into plain linears keep none)."""
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, LoRAOptimizedLinear):
            module.init_lora()


def _transformers_auto_model() -> Any:
    """transformers' ``AutoModelForCausalLM`` when the program has imported transformers (importing it here
    would cost seconds to programs that never use it; one that does has imported it before building a model)."""
    transformers = sys.modules.get("transformers")
    return None if transformers is None else transformers.AutoModelForCausalLM


class Init:
    """Inside ``with Init(lora_config=..., quant_config=...)``, ``torch.nn.Linear(in, out, ...)`` builds an
    :class:`~dsrun.linear.OptimizedLinear` with those configs (its adapters delayed); Hugging Face's
    ``AutoModelForCausalLM.from_pretrained``/``from_config`` (when transformers is imported before the context
    opens) then run :func:`init_lora` on the model they return. A model built otherwise needs ``init_lora(model)`` called on it (a warning at exit says so)."""

    def __init__(self, lora_config: LoRAConfig | None = None, quant_config: QuantizationConfig | None = None):
        self.lora_config = lora_config
        self.quant_config = quant_config
        self._orig_nn_linear = torch.nn.Linear
        self._auto = _transformers_auto_model()
        self._orig_auto = (self._auto.from_pretrained, self._auto.from_config) if self._auto is not None else None
        self._post_init_complete = False

    def __enter__(self) -> "Init":
        linear_cls, lora, quant = self._orig_nn_linear, self.lora_config, self.quant_config

        class OptimizedLinearFactory:
            """``torch.nn.Linear`` while the context is open: each call builds an OptimizedLinear."""

            def __new__(cls, *args: object, **kwargs: object) -> torch.nn.Module:
                for torch_name, name in (("in_features", "input_dim"), ("out_features", "output_dim")):
                    if torch_name in kwargs:  # nn.Linear's keyword names
                        kwargs[name] = kwargs.pop(torch_name)
                if lora is not None:
                    lora.delay_lora_init = True  # the adapters are built once the model is (init_lora)
                return OptimizedLinear(*args, lora_config=lora, quantization_config=quant, linear_cls=linear_cls,
                                       **kwargs)

        def initialised(model: torch.nn.Module) -> torch.nn.Module:
            if lora is not None:
                init_lora(model)
            self._post_init_complete = True
            return model

        torch.nn.Linear = OptimizedLinearFactory
        if self._auto is not None:
            from_pretrained, from_config = self._orig_auto
            self._auto.from_pretrained = lambda *a, **k: initialised(from_pretrained(*a, **k))
            self._auto.from_config = lambda *a, **k: initialised(from_config(*a, **k))
        return self

    def __exit__(self, *exc: object) -> None:
        torch.nn.Linear = self._orig_nn_linear
        if self._auto is not None:
            self._auto.from_pretrained, self._auto.from_config = self._orig_auto
        if not self._post_init_complete:
            logger.warning("deepspeed.linear.Init: the LoRA adapters were not initialised (that happens "
                           "automatically for transformers' AutoModelForCausalLM.from_pretrained/from_config); "
                           "call init_lora(model) before using the model")
