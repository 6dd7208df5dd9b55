"""dsrun: a declarative experiment runner for large-model training, compatible with DeepSpeed.

The training API keeps DeepSpeed's names (``dsrun.initialize``, ``dsrun.init_distributed``,
``dsrun.add_config_arguments``, ``dsrun.zero``, ``dsrun.comm``, ``dsrun.checkpointing``,
``dsrun.DeepSpeedTransformerLayer``), and so does inference (``dsrun.init_inference``,
``dsrun.InferenceEngine``), so a DeepSpeed script switches by changing its import. Those names are loaded
on first use, so ``import dsrun`` stays cheap for the CLI.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute" (attribute empty for a submodule)
_LAZY: dict[str, str] = {
    "initialize": "dsrun.engine.initialize:initialize",
    "add_config_arguments": "dsrun.engine.initialize:add_config_arguments",
    "init_distributed": "dsrun.comm.comm:init_distributed",
    "comm": "dsrun.comm:",
    "zero": "dsrun.zero:",
    "checkpointing": "dsrun.activation_checkpointing.api:",
    "pipe": "dsrun.pipe:",
    "runtime": "dsrun.compat.runtime:",  # DeepSpeed's deepspeed.runtime paths (dsrun.alias.paths)
    "DeepSpeedTransformerConfig": "dsrun.ops.transformer:DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer": "dsrun.ops.transformer:DeepSpeedTransformerLayer",
    "init_inference": "dsrun.inference:init_inference",
    "tp_model_init": "dsrun.tensor_parallel:tp_model_init",
    "replace_transformer_layer": "dsrun.inference.injection:replace_transformer_layer",
    "InferenceEngine": "dsrun.inference:InferenceEngine",
    "inference": "dsrun.inference:",
    "elasticity": "dsrun.elasticity:",
    "moe": "dsrun.moe:",
    "linear": "dsrun.linear:",
    # DeepSpeed's other top-level names (deepspeed/__init__.py)
    "DeepSpeedConfig": "dsrun.config.deepspeed_config:DeepSpeedConfig",
    "DeepSpeedConfigError": "dsrun.config.deepspeed_config:DeepSpeedConfigError",
    "DeepSpeedEngine": "dsrun.engine.engine:DeepSpeedEngine",
    "DeepSpeedHybridEngine": "dsrun.engine.hybrid_engine:DeepSpeedHybridEngine",
    "OnDevice": "dsrun.utils.init_on_device:OnDevice",
    "get_accelerator": "dsrun.accelerator:get_accelerator",
    "log_dist": "dsrun.utils.logging:log_dist",
    "logger": "dsrun.utils.logging:logger",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'dsrun' has no attribute '{name}'")
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attribute) if attribute else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
