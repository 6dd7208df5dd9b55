"""Small helpers shared by every layer: user-facing errors, suggestions, package paths, a free TCP port.

Also DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``log_dist``, ``set_log_level_from_string``
(:mod:`.logging`), ``RepeatingLoader`` (:mod:`.repeating_loader`) and the helpers for partitioned state, ``safe_get_full_fp32_param`` & co.
(:mod:`.tensor_fragment`), the ZeRO-3 leaf-module flags, ``set_z3_leaf_modules`` & co. (:mod:`.leaf_modules`,
DeepSpeed's ``utils.z3_leaf_module``), loaded on first use so ``dsrun.utils.errors`` stays free of torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "logger": "dsrun.utils.logging",
    "log_dist": "dsrun.utils.logging",
    "set_log_level_from_string": "dsrun.utils.logging",
    "RepeatingLoader": "dsrun.utils.repeating_loader",
    "OnDevice": "dsrun.utils.init_on_device",
    "safe_get_full_fp32_param": "dsrun.utils.tensor_fragment",
    "safe_get_full_grad": "dsrun.utils.tensor_fragment",
    "safe_get_full_optimizer_state": "dsrun.utils.tensor_fragment",
    "safe_get_local_fp32_param": "dsrun.utils.tensor_fragment",
    "safe_get_local_grad": "dsrun.utils.tensor_fragment",
    "safe_get_local_optimizer_state": "dsrun.utils.tensor_fragment",
    "safe_set_full_fp32_param": "dsrun.utils.tensor_fragment",
    "safe_set_full_optimizer_state": "dsrun.utils.tensor_fragment",
    "safe_set_local_fp32_param": "dsrun.utils.tensor_fragment",
    "safe_set_local_optimizer_state": "dsrun.utils.tensor_fragment",
    "safe_set_full_grad": "dsrun.utils.tensor_fragment",
    "safe_set_local_grad": "dsrun.utils.tensor_fragment",
    "safe_update_full_grad_vectorized": "dsrun.utils.tensor_fragment",
    **{name: "dsrun.utils.leaf_modules" for name in (
        "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter",
        "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")},
}


# DeepSpeed's submodules of deepspeed.utils that live elsewhere in dsrun (served from dsrun/compat)
_SUBMODULES = {"groups": "dsrun.compat.utils.groups"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'dsrun.utils' has no attribute '{name}'")
    globals()[name] = value
    return value
