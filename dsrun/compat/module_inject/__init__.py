"""``deepspeed.module_inject``: DeepSpeed's AutoTP layer classes, shard sizes and configurable rules (homes:
:mod:`dsrun.tensor_parallel.deepspeed_layers`, :mod:`dsrun.tensor_parallel.shard_sizes`,
:mod:`dsrun.tensor_parallel.autotp_config`, :mod:`dsrun.tensor_parallel.hf_plan`) and v1 kernel injection
(:mod:`dsrun.inference.injection`: ``replace_transformer_layer``, the policies)."""
from dsrun.inference.injection.policies import DSPolicy, HFBertLayerPolicy
from dsrun.inference.injection.replace import replace_transformer_layer

from . import autotp_config, layers, tp_plan_converter, tp_shard
from .layers import LinearAllreduce, LinearLayer

__all__ = ["DSPolicy", "HFBertLayerPolicy", "LinearAllreduce", "LinearLayer", "autotp_config", "layers",
           "replace_transformer_layer", "tp_plan_converter", "tp_shard"]
