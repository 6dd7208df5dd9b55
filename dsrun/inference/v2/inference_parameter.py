"""``deepspeed.inference.v2.inference_parameter``: a tensor that carries auxiliary tensors (a quantized weight's
scales) as attributes, which follow it through ``.to(device)``."""
from __future__ import annotations

import torch

CORE_PARAM = "_ds_core_param_key"

STR_TO_DTYPE = {str(dtype): dtype for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                                 torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                 torch.bool)}


class InferenceParameter(torch.Tensor):
    """A ``torch.Tensor`` with auxiliary tensors; the results of operations on it are plain tensors."""

    @staticmethod
    def __new__(cls, tensor, *args, **kwargs):
        new_tensor = super().__new__(cls, tensor, *args, **kwargs)
        if hasattr(tensor, "_aux_attrs"):
            new_tensor._aux_attrs = tensor.aux_attrs
        return new_tensor

    def to(self, *args, **kwargs):
        new_tensor = super().to(*args, **kwargs)
        aux = dict(getattr(self, "_aux_attrs", {}))
        moves = _names_a_device(args, kwargs)  # a device move takes the auxiliary tensors along; a dtype cast not
        for name, attr in aux.items():
            aux[name] = attr.to(*args, **kwargs) if moves else attr
            setattr(new_tensor, name, aux[name])
        new_tensor._aux_attrs = aux
        return new_tensor

    @classmethod
    def initialize(cls, core_param: torch.Tensor, **kwargs: torch.Tensor) -> "InferenceParameter":
        """``core_param`` as an inference parameter with ``kwargs`` (tensors) as its auxiliary attributes."""
        param = InferenceParameter(core_param)
        param._aux_attrs = kwargs
        for name, attr in kwargs.items():
            if hasattr(param, name):
                raise ValueError(f"Attribute {name} already exists on param.")
            if not isinstance(attr, torch.Tensor):
                raise ValueError(f"Attribute {name} must be a tensor.")
            setattr(param, name, attr)
        return param

    @classmethod
    def initialize_raw(cls, **kwargs: torch.Tensor) -> "InferenceParameter":
        """As :meth:`initialize`, the core parameter given under :data:`CORE_PARAM`."""
        if CORE_PARAM not in kwargs:
            raise ValueError(f"Must provide core parameter, with key {CORE_PARAM}.")
        return InferenceParameter.initialize(kwargs[CORE_PARAM], **kwargs)

    @property
    def aux_attrs(self) -> dict[str, torch.Tensor]:
        return self._aux_attrs


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    if "device" in kwargs:
        return True
    if not args or isinstance(args[0], (torch.dtype, torch.Tensor)):
        return False
    try:
        torch.device(args[0])
        return True
    except (RuntimeError, TypeError):
        return False
