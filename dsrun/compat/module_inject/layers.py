"""``deepspeed.module_inject.layers``: DeepSpeed's AutoTP layers (homes: :mod:`dsrun.tensor_parallel.deepspeed_layers`,
:mod:`dsrun.tensor_parallel.subparam_layers` for fused sub-parameters)."""
from dsrun.tensor_parallel.deepspeed_layers import (LinearAllreduce, LinearLayer, is_autotp_training_mode,
                                                    set_autotp_mode)
from dsrun.tensor_parallel.subparam_layers import (FusedModuleWrapper, GateUpPack_LinearLayer, SubParamColumnParallel,
                                                   SubParamLinearAllreduce, SubParamLinearLayer, fused_LinearLayer)

__all__ = ["FusedModuleWrapper", "GateUpPack_LinearLayer", "LinearAllreduce", "LinearLayer", "SubParamColumnParallel",
           "SubParamLinearAllreduce", "SubParamLinearLayer", "fused_LinearLayer", "is_autotp_training_mode",
           "set_autotp_mode"]
