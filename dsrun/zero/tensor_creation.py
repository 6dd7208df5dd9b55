"""The tensor constructors ``zero.Init`` overrides while a model is built, as DeepSpeed's ``Init`` does.

Inside the context ``torch.tensor``, ``empty``, ``zeros``, ``ones``, ``full``, ``arange``, ``eye``, ``randn`` and
the legacy ``torch.Tensor(...)`` constructor make their tensors on the accelerator's device when the caller names
none, and cast floating results to the context's dtype (each as :class:`DeepSpeedTensorOverride` asks). Each
constructor is made by :func:`zero_wrapper_for_fp_tensor_constructor` from the original kept here
(``_orig_torch_arange`` ...); :mod:`dsrun.zero.init` binds these names as its own module globals and looks the
wrapper up there each time a context is entered, because Hugging Face replaces
``deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor`` for the length of a model
build (to keep ``torch.arange``'s explicit dtype for RoPE buffers).
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Iterable

import torch


class DeepSpeedTensorOverride(Enum):
    """What ``zero.Init`` overrides in the tensors made inside it (its ``tensor_overrides`` keyword)."""

    dtype = 1  # floating tensors are cast to the context's dtype
    device = 2  # tensors made without a device land on the accelerator's device


DEFAULT_TENSOR_OVERRIDES = (DeepSpeedTensorOverride.dtype, DeepSpeedTensorOverride.device)

_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn
# torch.Tensor inherits its __new__ from the C base class: the context sets one on torch.Tensor, and deletes it after
_TENSOR_HAS_OWN_NEW = "__new__" in vars(torch.Tensor)
_orig_tensor_new = torch.Tensor.__new__

# torch's attribute name -> the original constructor (the order the context replaces them in)
ORIGINALS: dict[str, Callable[..., torch.Tensor]] = {
    "tensor": _orig_torch_tensor, "empty": _orig_torch_empty, "zeros": _orig_torch_zeros, "ones": _orig_torch_ones,
    "full": _orig_torch_full, "arange": _orig_torch_arange, "eye": _orig_torch_eye, "randn": _orig_torch_randn,
}


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None) -> Callable[..., torch.Tensor]:
    """``fn`` (a torch constructor) making its tensor on ``target_device`` when the caller passes no device, and
    casting a floating result to ``target_fp_dtype`` (None: either left as ``fn`` makes it)."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


def get_new_tensor_fn_for_dtype(target_fp_dtype: torch.dtype | None,
                                target_device: torch.device | None) -> Callable[..., torch.Tensor]:
    """A ``torch.Tensor.__new__`` for the legacy ``torch.Tensor(*sizes)`` constructor with the same overrides."""

    def new_tensor(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
        base = _orig_torch_empty(0) if target_device is None else _orig_torch_empty(0, device=target_device)
        tensor = base.new_empty(*(args or (0,)), **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return new_tensor


def add_tensor_creation_wrappers(wrap: Callable[..., Callable[..., torch.Tensor]], dtype: torch.dtype | None,
                                 device: torch.device | None, overrides: Iterable[DeepSpeedTensorOverride]) -> None:
    """Replace torch's constructors with ``wrap(original, target_fp_dtype=..., target_device=...)`` of each
    (``wrap``: :func:`zero_wrapper_for_fp_tensor_constructor`, or what a caller put in its place)."""
    overrides = tuple(overrides)
    target_fp_dtype = dtype if DeepSpeedTensorOverride.dtype in overrides else None
    target_device = device if DeepSpeedTensorOverride.device in overrides else None
    torch.Tensor.__new__ = get_new_tensor_fn_for_dtype(target_fp_dtype, target_device)  # type: ignore[method-assign]
    for name, original in ORIGINALS.items():
        setattr(torch, name, wrap(original, target_fp_dtype=target_fp_dtype, target_device=target_device))


def remove_tensor_creation_wrappers() -> None:
    """Put torch's own constructors back."""
    if _TENSOR_HAS_OWN_NEW:
        torch.Tensor.__new__ = _orig_tensor_new  # type: ignore[method-assign]
    elif "__new__" in vars(torch.Tensor):
        del torch.Tensor.__new__
    for name, original in ORIGINALS.items():
        setattr(torch, name, original)
