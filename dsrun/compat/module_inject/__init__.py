"""``deepspeed.module_inject``: DeepSpeed's AutoTP layer classes and shard sizes (homes:
:mod:`dsrun.tensor_parallel.deepspeed_layers`, :mod:`dsrun.tensor_parallel.shard_sizes`)."""
from dsrun.tensor_parallel.deepspeed_layers import LinearAllreduce, LinearLayer

__all__ = ["LinearAllreduce", "LinearLayer"]
