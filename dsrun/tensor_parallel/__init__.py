"""Tensor-parallel training (DeepSpeed's AutoTP for training: ``tensor_parallel.autotp_size``,
``deepspeed.tp_model_init``): a model's Transformer blocks split column/row-wise over a tensor-parallel group,
composed with ZeRO 0-3 over the data-parallel group. docs/autotp.md."""
from .autotp_config import AutoTPConfig, AutoTPPresets, PartitionType, TPLayerSpec
from .feature import AutoTPFeature, autotp_degree, refuse_group_beside_mpu, reset_tp_model_init, tp_model_init
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLinear, is_model_parallel_parameter
from .spec_split import split_by_specs
from .split import TPLayout, split_for_training

__all__ = ["AutoTPConfig", "AutoTPFeature", "AutoTPPresets", "ColumnParallelLinear", "PartitionType",
           "RowParallelLinear", "TPLayerSpec", "TPLayout", "TensorParallelLinear", "autotp_degree",
           "is_model_parallel_parameter", "refuse_group_beside_mpu", "reset_tp_model_init", "split_by_specs",
           "split_for_training", "tp_model_init"]
