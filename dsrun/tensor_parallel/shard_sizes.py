"""How DeepSpeed's AutoTP sizes each rank's shard of a dimension (``deepspeed.module_inject.tp_shard``).

A dimension of ``total`` over ``mp_size`` ranks: when the number of key/value heads is known (``set_num_kv_heads``)
and divides it, whole heads per rank (the first ``heads % mp_size`` ranks one more), except for MLP and MoE-MLP
projections and the LM head; otherwise in grains of ``tp_grain_size`` (1 by default) as evenly as possible, the
first ranks taking the extra grains and the last rank the tail that does not fill a grain. The shards always tile
the dimension. DeepSpeed's layer classes (:mod:`dsrun.tensor_parallel.deepspeed_layers`) cut by these sizes; dsrun's
splits cut by :func:`grain_widths` too (attention on whole heads, the rest in grains of ``tensor_parallel.tp.tp_grain_size``,
which ``initialize`` also sets here, as DeepSpeed does).
"""
from __future__ import annotations

from dsrun import comm

_LM_HEADS = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")

num_kv_heads: int | None = None
num_attention_heads: int | None = None
n_embd: int | None = None
tp_grain_size = 1


def set_num_kv_heads(num: int | None) -> None:
    global num_kv_heads
    num_kv_heads = num


def get_num_kv_heads() -> int | None:
    return num_kv_heads


def set_num_attention_heads(num: int | None) -> None:
    global num_attention_heads
    num_attention_heads = num


def get_num_attention_heads() -> int | None:
    return num_attention_heads


def set_n_embd(num: int | None) -> None:
    global n_embd
    n_embd = num


def get_n_embd() -> int | None:
    return n_embd


def set_tp_grain_size(num: int) -> None:
    global tp_grain_size
    tp_grain_size = int(num)


def by_kv_heads(total: int, name: object, heads: int | None) -> bool:
    """Whether DeepSpeed cuts a dimension of ``total`` under ``name`` by key/value groups: ``heads`` known and
    dividing it, and the name not an MLP projection's or the LM head's."""
    text = str(name)
    return (heads is not None and total % heads == 0 and "mlp" not in text and text not in _LM_HEADS
            and not any(part in text for part in _MLP_NAMES))


def get_shard_size(total_size: int, mp_size: int, name: object = None, rank: int | None = None,
                   mp_group: object = None, num_kv_heads: int | None = None) -> int:
    """The size of rank ``rank``'s shard (its rank *in the tensor-parallel group*; None: read from ``mp_group``, or
    the world's rank when the world is the group) of a dimension of ``total_size`` over ``mp_size`` ranks."""
    heads = globals()["num_kv_heads"] if num_kv_heads is None else num_kv_heads
    if rank is None:
        if mp_group is not None:
            rank = comm.get_rank(group=mp_group)
        elif comm.get_world_size() != mp_size:
            raise ValueError(f"get_shard_size needs the rank in the tensor-parallel group (rank= or mp_group=) when "
                             f"mp_size ({mp_size}) is not the world size ({comm.get_world_size()})")
        else:
            rank = comm.get_rank()
    if by_kv_heads(total_size, name, heads):
        mine = heads // mp_size + (1 if rank < heads % mp_size else 0)
        return total_size * mine // heads
    return grain_shard(total_size, rank, mp_size, tp_grain_size)


def grain_shard(total: int, rank: int, size: int, grain: int) -> int:
    """Rank ``rank``'s share of ``total`` over ``size`` ranks in grains of ``grain``: the grains as evenly as
    possible (the first ranks one more), the tail that fills no grain to the last rank; a dimension smaller than
    one grain in grains of one (DeepSpeed's ``get_shard_size`` without heads)."""
    if total < grain:
        return total // size + (1 if rank < total % size else 0)
    grains, tail = divmod(total, grain)
    share = (grains // size + (1 if rank < grains % size else 0)) * grain
    return share + (tail if rank == size - 1 else 0)


def grain_widths(total: int, size: int, grain: int) -> tuple[int, ...]:
    """Every rank's :func:`grain_shard`, in rank order (they add up to ``total``)."""
    return tuple(grain_shard(total, rank, size, grain) for rank in range(size))


def get_shard_size_list(total_size: int, mp_size: int, name: object = None, num_kv_heads: int | None = None
                        ) -> list[int]:
    """Every rank's shard size, in rank order; they add up to ``total_size``."""
    heads = globals()["num_kv_heads"] if num_kv_heads is None else num_kv_heads
    sizes = [get_shard_size(total_size, mp_size, name, rank, num_kv_heads=heads) for rank in range(mp_size)]
    if sum(sizes) != total_size:
        raise ValueError(f"shard sizes {sizes} of {name!r} do not add up to {total_size} over {mp_size} ranks "
                         f"(tp_grain_size {tp_grain_size}, num_kv_heads {heads})")
    return sizes
