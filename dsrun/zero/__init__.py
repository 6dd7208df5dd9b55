"""``dsrun.zero``: DeepSpeed's ZeRO-3 user API.

* :class:`Init` — build a model with its parameters partitioned across ranks from the start.
* :class:`MiCS_Init` — the same, partitioned over MiCS shard groups (``mics_shard_size``).
* :class:`GatheredParameters` — gather partitioned parameters for a ``with`` block (and broadcast changes).
* :func:`register_external_parameter` — a module uses a parameter it does not own.
* :func:`full_state_dict` — the model's state dict with every partitioned parameter gathered.
* :class:`TiledLinear`, :class:`TiledLinearReturnBias` — a linear layer in tiles gathered one at a time.
* :class:`DeepSpeedTensorOverride` — what ``Init`` overrides in the tensors torch's constructors make inside it.
* :func:`unwrap_model_for_generation` — every parameter gathered and the hooks lifted, for a generation loop.
* ``ZeroParamStatus`` — a partitioned parameter's ``ds_status`` (DeepSpeed's name of :class:`ParamStatus`).

See ``docs/zero3.md``.
"""
from dsrun.zero.partition_params import ParamStatus, is_zero_param
from dsrun.zero.stage3 import full_state_dict

from .gathered import GatheredParameters, register_external_parameter, unregister_external_parameter
from .generation import unwrap_model_for_generation
from .init import Init, MiCS_Init
from .tensor_creation import DeepSpeedTensorOverride
from .tiling import TiledLinear, TiledLinearReturnBias

ZeroParamStatus = ParamStatus  # DeepSpeed's name

__all__ = ["DeepSpeedTensorOverride", "GatheredParameters", "Init", "MiCS_Init", "ParamStatus", "TiledLinear", "TiledLinearReturnBias", "ZeroParamStatus",
           "full_state_dict", "is_zero_param", "register_external_parameter", "unregister_external_parameter",
           "unwrap_model_for_generation"]
