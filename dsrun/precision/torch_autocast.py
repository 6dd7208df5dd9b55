"""The config's ``torch_autocast`` section (DeepSpeed 0.16+): the engine's forward runs under
``torch.autocast`` while the parameters stay fp32, and the parameters of the *lower-precision-safe* modules
carry a ``comm_dtype`` attribute: their gradients are all-reduced in the autocast dtype (ZeRO stage 0; the
partitioned stages reduce every gradient in ``communication_data_type``), the others in their own dtype.

``lower_precision_safe_modules`` names classes as ``"package.Class"``; unset, DeepSpeed's list
(:data:`LOWER_PRECISION_SAFE_MODULES`). ``dtype`` unset is the device's autocast default (bfloat16 on CPU).
If the caller already runs under ``torch.autocast``, the section decides: enabled, its dtype is used; disabled,
autocast is switched off inside the engine's forward (the bf16/fp16 sections are then what applies).
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Protocol

import torch

from dsrun.utils.logging import logger


class AutocastEngine(Protocol):
    """What the autocast helpers read of the engine."""

    device: torch.device
    module: torch.nn.Module

    def torch_autocast_enabled(self) -> bool: ...

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
_state: dict[str, Any] = {"initialized": False, "dtype": None, "warned_nested": False}


def _import_class(name: str) -> type:
    package, _, cls = name.rpartition(".")
    try:
        return getattr(importlib.import_module(package), cls)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({err}); "
                         "write 'package.Class', e.g. 'torch.nn.Linear'") from None


def get_default_autocast_lower_precision_modules() -> list[str]:
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def init_autocast_params(engine: AutocastEngine, dtype: torch.dtype | None,
                         lower_precision_safe_modules: list[str] | None) -> None:
    """Mark the parameters of the safe modules of ``engine.module`` with ``comm_dtype = dtype``."""
    classes = tuple(LOWER_PRECISION_SAFE_MODULES if lower_precision_safe_modules is None
                    else [_import_class(n) for n in lower_precision_safe_modules])
    comm = dtype or torch.get_autocast_dtype(engine.device.type)
    for module in engine.module.modules():
        if type(module) in classes:
            for param in module.parameters(recurse=False):
                setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, comm)
    _state.update(initialized=True, dtype=comm)


def is_autocast_initialized() -> bool:
    return bool(_state["initialized"])


def get_autocast_dtype() -> torch.dtype | None:
    return _state["dtype"]


def has_comm_dtype(param: torch.Tensor) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable[torch.Tensor]) -> set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    return sorted(dtypes, key=str)


@contextmanager
def autocast_if_enabled(engine: AutocastEngine) -> Iterator[None]:
    """The engine's forward context: autocast as its config says, whatever the caller's autocast state."""
    device = engine.device.type
    enabled = engine.torch_autocast_enabled()
    if torch.is_autocast_enabled(device) and not _state["warned_nested"]:
        _state["warned_nested"] = True
        logger.info("torch.autocast is already on outside the engine; inside its forward the config's "
                    "torch_autocast section decides (%s)", "enabled" if enabled else "disabled")
    if enabled:
        with torch.autocast(device_type=device, dtype=engine.torch_autocast_dtype(), enabled=True):
            yield
    elif torch.is_autocast_enabled(device):
        with torch.autocast(device_type=device, enabled=False):
            yield
    else:
        yield
