"""Small helpers shared by every layer: user-facing errors, suggestions, package paths, a free TCP port; and
DeepSpeed's ``deepspeed.utils`` names: ``RepeatingLoader`` and the helpers for partitioned state
(``safe_get_full_fp32_param`` & co.)."""
from .repeating_loader import RepeatingLoader
from .tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                              safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                              safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                              safe_set_local_optimizer_state)

__all__ = ["RepeatingLoader", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
           "safe_set_local_optimizer_state"]
