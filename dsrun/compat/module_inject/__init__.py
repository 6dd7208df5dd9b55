"""``deepspeed.module_inject``: DeepSpeed's AutoTP layer classes and shard sizes (homes:
:mod:`dsrun.tensor_parallel.deepspeed_layers`, :mod:`dsrun.tensor_parallel.shard_sizes`)."""
from . import layers, tp_shard
from .layers import LinearAllreduce, LinearLayer

__all__ = ["LinearAllreduce", "LinearLayer", "layers", "tp_shard"]
