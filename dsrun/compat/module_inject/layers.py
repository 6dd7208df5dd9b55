"""``deepspeed.module_inject.layers``: DeepSpeed's AutoTP layers (homes: :mod:`dsrun.tensor_parallel.deepspeed_layers`,
:mod:`dsrun.tensor_parallel.subparam_layers` for fused sub-parameters) and their universal-checkpoint metadata
(:mod:`dsrun.checkpoint.autotp_meta`)."""
from dsrun.checkpoint.autotp_meta import (_build_param_uc_restore_meta, _get_param_uc_conversion_meta,
                                          collect_autotp_universal_checkpoint_info)
from dsrun.tensor_parallel.deepspeed_layers import (LinearAllreduce, LinearLayer, LmHeadLinearAllreduce,
                                                    Yuan_LinearAllreduce, Yuan_LinearLayer, _subparam_shard_widths,
                                                    is_autotp_training_mode, set_autotp_mode)
from dsrun.tensor_parallel.subparam_layers import (FusedModuleWrapper, GateUpPack_LinearLayer, SubParamColumnParallel,
                                                   SubParamLinearAllreduce, SubParamLinearLayer, fused_LinearLayer)

__all__ = ["FusedModuleWrapper", "GateUpPack_LinearLayer", "LinearAllreduce", "LinearLayer", "LmHeadLinearAllreduce",
           "SubParamColumnParallel", "Yuan_LinearAllreduce", "Yuan_LinearLayer",
           "SubParamLinearAllreduce", "SubParamLinearLayer", "_build_param_uc_restore_meta",
           "_get_param_uc_conversion_meta", "_subparam_shard_widths", "collect_autotp_universal_checkpoint_info",
           "fused_LinearLayer", "is_autotp_training_mode", "set_autotp_mode"]
