"""``OnDevice``: build a model's parameters on a given device and dtype (DeepSpeed's ``deepspeed.OnDevice``).

``with OnDevice(dtype=torch.bfloat16, device="meta"): model = Model(cfg)`` allocates no memory for the
parameters (``meta``), or puts them straight on ``device`` in ``dtype``. Only floating-point tensors take
``dtype``; integer buffers keep theirs.
"""
from __future__ import annotations

from typing import Any

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
