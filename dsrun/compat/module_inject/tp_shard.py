"""``deepspeed.module_inject.tp_shard``: DeepSpeed's shard sizes (home: :mod:`dsrun.tensor_parallel.shard_sizes`).
Its settings (``num_kv_heads``, ``num_attention_heads``, ``n_embd``, ``tp_grain_size``) read live from the home."""
from typing import Any

from dsrun.tensor_parallel import shard_sizes as _home
from dsrun.tensor_parallel.shard_sizes import (get_n_embd, get_num_attention_heads, get_num_kv_heads, get_shard_size,
                                               get_shard_size_list, set_n_embd, set_num_attention_heads,
                                               set_num_kv_heads, set_tp_grain_size)

__all__ = ["get_n_embd", "get_num_attention_heads", "get_num_kv_heads", "get_shard_size", "get_shard_size_list",
           "set_n_embd", "set_num_attention_heads", "set_num_kv_heads", "set_tp_grain_size"]

_SETTINGS = ("num_kv_heads", "num_attention_heads", "n_embd", "tp_grain_size")


def __getattr__(name: str) -> Any:
    if name in _SETTINGS:  # the current value, not the one at import
        return getattr(_home, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
