"""``deepspeed.module_inject.autotp_config``: DeepSpeed's configurable AutoTP rules (home:
:mod:`dsrun.tensor_parallel.autotp_config`)."""
from dsrun.tensor_parallel.autotp_config import (AutoTPConfig, AutoTPPresets, PartitionType, TPLayerSpec,
                                                 merge_autotp_configs)

__all__ = ["AutoTPConfig", "AutoTPPresets", "PartitionType", "TPLayerSpec", "merge_autotp_configs"]
