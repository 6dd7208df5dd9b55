"""``deepspeed.module_inject.tp_shard``: DeepSpeed's shard sizes (home: :mod:`dsrun.tensor_parallel.shard_sizes`)."""
from dsrun.tensor_parallel.shard_sizes import (get_n_embd, get_num_attention_heads, get_num_kv_heads, get_shard_size,
                                               get_shard_size_list, set_n_embd, set_num_attention_heads,
                                               set_num_kv_heads, set_tp_grain_size)

__all__ = ["get_n_embd", "get_num_attention_heads", "get_num_kv_heads", "get_shard_size", "get_shard_size_list",
           "set_n_embd", "set_num_attention_heads", "set_num_kv_heads", "set_tp_grain_size"]
