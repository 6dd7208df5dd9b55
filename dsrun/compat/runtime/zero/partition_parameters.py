"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3's parameter API under DeepSpeed's module path.

``ZeroParamStatus`` is the ``param.ds_status`` enum (``NOT_AVAILABLE``, ``INFLIGHT``, ``AVAILABLE``);
``Init``, ``GatheredParameters`` and ``register_external_parameter`` are :mod:`dsrun.zero`'s.
"""
from dsrun.zero.partition_params import ParamStatus as ZeroParamStatus
from dsrun.zero.partition_params import is_zero_param
from dsrun.zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "is_zero_param", "register_external_parameter",
           "unregister_external_parameter"]
