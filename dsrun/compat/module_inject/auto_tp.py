"""``deepspeed.module_inject.auto_tp``: DeepSpeed's ``AutoTP`` driver class (home:
:mod:`dsrun.tensor_parallel.deepspeed_autotp`) and the rule classes its module imports (``AutoTPConfig``,
``TPLayerSpec``, ``PartitionType``: :mod:`dsrun.tensor_parallel.autotp_config`)."""
from dsrun.tensor_parallel.autotp_config import AutoTPConfig, PartitionType, TPLayerSpec
from dsrun.tensor_parallel.deepspeed_autotp import AutoTP

__all__ = ["AutoTP", "AutoTPConfig", "PartitionType", "TPLayerSpec"]
