"""``deepspeed.inference.v2.model_implementations.sharding``: each tensor-parallel rank's slice of a Transformer's
parameters, as DeepSpeed's inference v2 cuts them. Cuts fall on whole heads (``granularity=head_size``) or on
grains of 32 channels; when the grains do not divide evenly, the first ranks take one more. Fused q|k|v and
gate|up tensors are cut part by part. Grouped-query attention keeps each kv head whole: with at least as many kv
heads as ranks each rank takes whole groups; with fewer, the ranks sharing a kv head split its q heads."""
from __future__ import annotations

from enum import Enum
from typing import Optional

import torch

DEFAULT_SHARD_GRANULARITY = 32


class ShardingType(Enum):
    OUTER_DIMENSION = 0  # split the rows (the output channels of a [out, in] weight)
    INNER_DIMENSION = 1  # split the columns (the input channels)


def get_shard_endpoints(dim_size: int, shard_rank: int, num_shards: int,
                        granularity: int = DEFAULT_SHARD_GRANULARITY) -> tuple[int, int]:
    """``[start, end)`` of ``shard_rank``'s slice of a dimension of ``dim_size``, cut in grains of ``granularity``."""
    if dim_size % granularity != 0:
        raise ValueError(f"Dimension size {dim_size} must be divisible by the granularity {granularity}")
    chunks = dim_size // granularity
    base, extra = divmod(chunks, num_shards)
    start = shard_rank * base + min(shard_rank, extra)
    end = start + base + (1 if shard_rank < extra else 0)
    return start * granularity, end * granularity


def shard_param(param: Optional[torch.Tensor], shard_mode: ShardingType, shard_rank: int, num_shards: int,
                num_concatenated_matrices: int = 1, granularity: int = 32, bias_dims: int = 1) -> torch.Tensor:
    """``shard_rank``'s slice of ``param``, which may be ``num_concatenated_matrices`` matrices concatenated along
    the cut dimension (each cut alike). A tensor of ``bias_dims`` dimensions is a bias: cut on its last."""
    if shard_rank >= num_shards:
        raise ValueError(f"Shard rank {shard_rank} must be less than num_shards {num_shards}")
    if param is None:
        return None
    if num_shards == 1:
        return param
    if shard_mode == ShardingType.OUTER_DIMENSION:
        dim = -1 if param.ndim == bias_dims else -2
    else:
        dim = -1
    start, end = get_shard_endpoints(param.size(dim) // num_concatenated_matrices, shard_rank, num_shards,
                                     granularity)
    parts = torch.chunk(param, num_concatenated_matrices, dim=dim)
    return torch.cat([part.narrow(dim, start, end - start) for part in parts], dim=dim)


def get_local_heads(shard_rank: int, num_shards: int, n_heads_q: int,
                    n_heads_kv: Optional[int] = None) -> tuple[int, int]:
    """``(q heads, kv heads)`` of ``shard_rank``."""
    if n_heads_q < num_shards:
        raise ValueError("There must be at least as many attention heads as there are shards.")
    if n_heads_kv is None or n_heads_kv == n_heads_q:
        base, extra = divmod(n_heads_q, num_shards)
        heads = base + 1 if shard_rank < extra else base
        return heads, heads
    if n_heads_q % n_heads_kv != 0:
        raise ValueError("Must be an even ratio between query and key/value heads.")
    if n_heads_kv < num_shards and num_shards % n_heads_kv != 0:
        raise ValueError("If splitting a group across multiple shards, we must be able to distribute the groups "
                         "evenly.")
    if n_heads_kv >= num_shards and n_heads_kv % num_shards != 0:
        raise ValueError("If parallelizing groups, must be able to evenly distribute them.")
    ratio = n_heads_q // n_heads_kv
    if n_heads_kv >= num_shards:
        local_kv = n_heads_kv // num_shards
        return local_kv * ratio, local_kv
    ranks_per_group = num_shards // n_heads_kv
    base, extra = divmod(ratio, ranks_per_group)
    return (base + 1 if shard_rank % ranks_per_group < extra else base), 1


def shard_qkv_param(param: torch.Tensor, shard_rank: int, num_shards: int, head_size: int,
                    n_heads_q: Optional[int] = None, n_heads_kv: Optional[int] = None) -> Optional[torch.Tensor]:
    """``shard_rank``'s slice of a fused q|k|v weight or bias (all q heads, all k, all v). Give ``n_heads_q`` and
    ``n_heads_kv`` for grouped-query attention; without them it is multi-head attention."""
    if n_heads_kv is not None and n_heads_q is None:
        raise ValueError("n_heads_kv should not be passed without n_heads_q")
    if param is None:
        raise ValueError("param should not be None")
    if n_heads_q is None:
        if param.shape[0] // 3 % head_size != 0:
            raise ValueError("MHA param shape is not correct")
        n_heads_q = param.shape[0] // head_size // 3
        mha = True
    else:
        mha = n_heads_kv is None or n_heads_q == n_heads_kv
    if n_heads_q < num_shards:
        raise ValueError("There must be at least as many query heads as there are shards.")
    if mha:
        return shard_param(param, ShardingType.OUTER_DIMENSION, shard_rank, num_shards, num_concatenated_matrices=3,
                           granularity=head_size)
    if n_heads_q % n_heads_kv != 0:
        raise ValueError("Must be an even ratio between query and key/value heads.")
    if param.shape[0] != head_size * (n_heads_q + 2 * n_heads_kv):
        raise ValueError("GQA param shape is not correct")
    if n_heads_kv >= num_shards and n_heads_kv % num_shards != 0:
        raise ValueError("Currently do not support uneven partitioning of KV heads for GQA.")
    if n_heads_kv < num_shards and num_shards % n_heads_kv != 0:
        raise ValueError("Currently do not support distributing KV heads across different numbers of shards.")
    q_param, kv_param = param[:head_size * n_heads_q], param[head_size * n_heads_q:]
    if n_heads_kv >= num_shards:
        q_param = shard_param(q_param, ShardingType.OUTER_DIMENSION, shard_rank, num_shards, granularity=head_size)
        kv_param = shard_param(kv_param, ShardingType.OUTER_DIMENSION, shard_rank, num_shards,
                               num_concatenated_matrices=2, granularity=head_size)
        return torch.cat([q_param, kv_param], dim=0)
    ranks_per_group = num_shards // n_heads_kv
    kv_head = shard_rank // ranks_per_group
    k_param = kv_param[kv_head * head_size:(kv_head + 1) * head_size]
    v_param = kv_param[(n_heads_kv + kv_head) * head_size:(n_heads_kv + kv_head + 1) * head_size]
    ratio = n_heads_q // n_heads_kv
    q_group = q_param[ratio * kv_head * head_size:ratio * (kv_head + 1) * head_size]
    q_param = shard_param(q_group, ShardingType.OUTER_DIMENSION, shard_rank % ranks_per_group, ranks_per_group,
                          granularity=head_size)
    return torch.cat([q_param, k_param, v_param], dim=0)


def qkv_out_features(in_features: int, shard_rank: int, num_shards: int, head_size: int,
                     n_heads_q: Optional[int] = None, n_heads_kv: Optional[int] = None) -> int:
    """Rows of ``shard_rank``'s q|k|v slice (``shard_qkv_param``'s output) for a model dimension ``in_features``."""
    if n_heads_kv is not None and n_heads_q is None:
        raise ValueError("n_heads_kv should not be passed without n_heads_q")
    if n_heads_q is not None and in_features != head_size * n_heads_q:
        raise ValueError("in_features is not consistent with n_heads_q and head_size")
    if n_heads_kv is None or n_heads_q == n_heads_kv:
        start, end = get_shard_endpoints(in_features, shard_rank, num_shards, granularity=head_size)
        return (end - start) * 3
    if n_heads_kv >= num_shards:
        if n_heads_kv % num_shards != 0:
            raise ValueError("The KV heads must be evenly distributed across the shards.")
        return n_heads_kv // num_shards * head_size * (2 + n_heads_q // n_heads_kv)
    if num_shards % n_heads_kv != 0:
        raise ValueError("A shared KV head must always partition across the same number of shards.")
    ranks_per_group = num_shards // n_heads_kv
    start, end = get_shard_endpoints(n_heads_q // n_heads_kv * head_size, shard_rank % ranks_per_group,
                                     ranks_per_group, granularity=head_size)
    return end - start + 2 * head_size


def _gqa_split_check(n_heads_q: int, n_heads_kv: int, num_shards: int) -> None:
    if n_heads_kv % num_shards != 0 and num_shards % n_heads_kv != 0:
        raise ValueError(f"No partitioning of {n_heads_kv} kv heads over {num_shards} shards: one must divide the "
                         "other")


def shard_attn_out_param(param: torch.Tensor, shard_rank: int, num_shards: int, head_size: int,
                         n_heads_q: Optional[int] = None, n_heads_kv: Optional[int] = None) -> Optional[torch.Tensor]:
    """``shard_rank``'s columns of the attention output projection (the bias: rank 0 only, None elsewhere)."""
    if len(param.shape) == 1:
        return param if shard_rank == 0 else None
    if n_heads_kv is not None and n_heads_q is None:
        raise ValueError("n_heads_kv should not be passed without n_heads_q")
    if n_heads_kv is None or n_heads_q == n_heads_kv:
        return shard_param(param, ShardingType.INNER_DIMENSION, shard_rank, num_shards, granularity=head_size)
    if param.shape[-1] != head_size * n_heads_q:
        raise ValueError("GQA param shape is not correct")
    _gqa_split_check(n_heads_q, n_heads_kv, num_shards)
    if n_heads_kv % num_shards == 0:
        return shard_param(param, ShardingType.INNER_DIMENSION, shard_rank, num_shards, granularity=head_size)
    ranks_per_group = num_shards // n_heads_kv
    kv_head = shard_rank // ranks_per_group
    ratio = n_heads_q // n_heads_kv
    q_group = param[..., ratio * kv_head * head_size:ratio * (kv_head + 1) * head_size]
    return shard_param(q_group, ShardingType.INNER_DIMENSION, shard_rank % ranks_per_group, ranks_per_group,
                       granularity=head_size)


def attn_out_in_features(out_features: int, shard_rank: int, num_shards: int, head_size: int,
                         n_heads_q: Optional[int] = None, n_heads_kv: Optional[int] = None) -> int:
    """Columns of ``shard_rank``'s slice of the attention output projection."""
    if n_heads_kv is not None and n_heads_q is None:
        raise ValueError("n_heads_kv should not be passed without n_heads_q")
    if n_heads_kv is None or n_heads_q == n_heads_kv:
        start, end = get_shard_endpoints(out_features, shard_rank, num_shards, granularity=head_size)
        return end - start
    _gqa_split_check(n_heads_q, n_heads_kv, num_shards)
    if n_heads_kv >= num_shards:
        return n_heads_kv // num_shards * head_size * (n_heads_q // n_heads_kv)
    ranks_per_group = num_shards // n_heads_kv
    start, end = get_shard_endpoints(n_heads_q // n_heads_kv * head_size, shard_rank % ranks_per_group,
                                     ranks_per_group, granularity=head_size)
    return end - start


def shard_mlp_1_param(param: torch.Tensor, shard_rank: int, num_shards: int, gated: bool = False,
                      is_moe: bool = False) -> torch.Tensor:
    """``shard_rank``'s rows of the MLP's first projection (gated: interleaved gate|up rows, cut in pairs)."""
    granularity = DEFAULT_SHARD_GRANULARITY * 2 if gated else DEFAULT_SHARD_GRANULARITY
    return shard_param(param, ShardingType.OUTER_DIMENSION, shard_rank, num_shards, granularity=granularity,
                       bias_dims=2 if is_moe else 1)


def shard_mlp_2_param(param: torch.Tensor, shard_rank: int, num_shards: int,
                      is_moe: bool = False) -> Optional[torch.Tensor]:
    """``shard_rank``'s columns of the MLP's second projection (the bias: rank 0 only)."""
    if len(param.shape) == (2 if is_moe else 1):
        return param if shard_rank == 0 else None
    return shard_param(param, ShardingType.INNER_DIMENSION, shard_rank, num_shards)


def sharded_intermediate_dim(intermediate_size: int, num_shards: int, shard_rank: int) -> int:
    start, end = get_shard_endpoints(intermediate_size, shard_rank, num_shards)
    return end - start


def shard_embedding_param(param: torch.Tensor, shard_rank: int, num_shards: int) -> torch.Tensor:
    """``shard_rank``'s slice of the model dimension of a ``[vocab, model_dim]`` embedding."""
    return shard_param(param, ShardingType.INNER_DIMENSION, shard_rank, num_shards)


def sharded_embedding_dim(embedding_size: int, shard_rank: int, num_shards: int) -> int:
    start, end = get_shard_endpoints(embedding_size, shard_rank, num_shards)
    return end - start


def shard_unembed_param(param: torch.Tensor, shard_rank: int, num_shards: int) -> torch.Tensor:
    """``shard_rank``'s vocabulary rows of the unembedding (an all-gather rebuilds the logits)."""
    return shard_param(param, ShardingType.OUTER_DIMENSION, shard_rank, num_shards, granularity=1)


def sharded_unembed_dim(vocab_size: int, shard_rank: int, num_shards: int) -> int:
    start, end = get_shard_endpoints(vocab_size, shard_rank, num_shards, granularity=1)
    return end - start


__all__ = ["DEFAULT_SHARD_GRANULARITY", "ShardingType", "attn_out_in_features", "get_local_heads",
           "get_shard_endpoints", "qkv_out_features", "shard_attn_out_param", "shard_embedding_param",
           "shard_mlp_1_param", "shard_mlp_2_param", "shard_param", "shard_qkv_param", "shard_unembed_param",
           "sharded_embedding_dim", "sharded_intermediate_dim", "sharded_unembed_dim"]
