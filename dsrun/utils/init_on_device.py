"""``OnDevice``: build a model's parameters on a given device and dtype (DeepSpeed's ``deepspeed.OnDevice``);
``move_to_device``: tensors nested in lists, tuples and dicts onto a device (DeepSpeed's
``deepspeed.runtime.utils.move_to_device``).

``with OnDevice(dtype=torch.bfloat16, device="meta"): model = Model(cfg)`` allocates no memory for the
parameters (``meta``), or puts them straight on ``device`` in ``dtype``. Only floating-point tensors take
``dtype``; integer buffers keep theirs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class OnDevice:
    """Context manager: tensors created inside go to ``device`` (floating point ones in ``dtype``).

    ``enabled=False`` makes it a no-op, as in DeepSpeed.
    """

    def __init__(self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True):
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._device_context: Any = None
        self._previous_dtype: torch.dtype | None = None

    def __enter__(self) -> "OnDevice":
        if not self.enabled:
            return self
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        if self.dtype is not None:
            self._previous_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._previous_dtype is not None:
            torch.set_default_dtype(self._previous_dtype)
            self._previous_dtype = None
        self._device_context.__exit__(*exc)
        self._device_context = None


def move_to_device(item: object, device: torch.device | str, criterion_func: Callable[[object], bool] | None = None
                   ) -> object:
    """``item`` (a tensor, or lists, tuples and dicts of them, nested) with its tensors on ``device``: copies, in
    containers of the same kind. A tensor ``criterion_func`` accepts is moved in place instead (its ``.data``
    becomes the copy's) and returned itself."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)
