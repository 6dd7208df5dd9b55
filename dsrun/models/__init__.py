"""Built-in models for the recipes: the GPT family (``conf/model/gpt-*.yaml``) and the helpers that count
them (parameters, largest layer, analytic FLOPs, the model FLOPs of MFU). Any other model plugs in through
``model._target_``."""
from __future__ import annotations

from dsrun.models.accounting import (forward_flops, largest_layer_params, matmul_parameters, model_step_flops,
                                     num_parameters, recompute_flops, train_step_flops)
from dsrun.models.config import GPTConfig
from dsrun.models.gpt import GPT
from dsrun.models.registry import build_model, gpt_config, model_names, model_spec

__all__ = ["GPT", "GPTConfig", "build_model", "forward_flops", "gpt_config", "largest_layer_params",
           "matmul_parameters", "model_names", "model_spec", "model_step_flops", "num_parameters", "recompute_flops",
           "train_step_flops"]
