"""``deepspeed.module_inject``: DeepSpeed's AutoTP layer classes, shard sizes and configurable rules (homes:
:mod:`dsrun.tensor_parallel.deepspeed_layers`, :mod:`dsrun.tensor_parallel.shard_sizes`,
:mod:`dsrun.tensor_parallel.autotp_config`, :mod:`dsrun.tensor_parallel.hf_plan`)."""
from . import autotp_config, layers, tp_plan_converter, tp_shard
from .layers import LinearAllreduce, LinearLayer

__all__ = ["LinearAllreduce", "LinearLayer", "autotp_config", "layers", "tp_plan_converter", "tp_shard"]
