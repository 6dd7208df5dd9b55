"""``deepspeed.module_inject.auto_tp_model_utils``: per-head ALiBi tables of a split model (home:
:mod:`dsrun.tensor_parallel.head_shard`)."""
from dsrun.tensor_parallel.head_shard import (build_bloom_alibi_tensor, build_mpt_alibi_tensor,
                                              build_mpt_atten_bias_tensor, get_alibi_mask, get_head_shard_sizes,
                                              install_head_sharded_helper)

__all__ = ["build_bloom_alibi_tensor", "build_mpt_alibi_tensor", "build_mpt_atten_bias_tensor", "get_alibi_mask",
           "get_head_shard_sizes", "install_head_sharded_helper"]
