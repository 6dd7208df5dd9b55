"""``deepspeed.module_inject.layers``: DeepSpeed's AutoTP layers (home: :mod:`dsrun.tensor_parallel.deepspeed_layers`)."""
from dsrun.tensor_parallel.deepspeed_layers import (LinearAllreduce, LinearLayer, is_autotp_training_mode,
                                                    set_autotp_mode)

__all__ = ["LinearAllreduce", "LinearLayer", "is_autotp_training_mode", "set_autotp_mode"]
