"""Small helpers shared by every layer: user-facing errors, suggestions, package paths, a free TCP port.

Also DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``log_dist`` (:mod:`.logging`) and ``RepeatingLoader``
(:mod:`.repeating_loader`), loaded on first use so ``dsrun.utils.errors`` stays free of torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "logger": "dsrun.utils.logging",
    "log_dist": "dsrun.utils.logging",
    "RepeatingLoader": "dsrun.utils.repeating_loader",
    "OnDevice": "dsrun.utils.init_on_device",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dsrun.utils' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
