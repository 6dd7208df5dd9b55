"""Per-head tables of a model split over a tensor-parallel group (``deepspeed.module_inject.auto_tp_model_utils``):
ALiBi biases are computed for every head, and each rank keeps the rows of the heads it holds.

AutoTP cuts the attention heads with DeepSpeed's shard sizes (whole key/value groups when their number is set: 5
heads over 2 ranks are 3 and 2), so a model's helper that builds a per-head table must slice it the same way:

* ``install_head_sharded_helper(module, name, wrapper, mp_group=None, num_heads=None, num_kv_heads=None)`` binds
  ``wrapper`` over ``module``'s own method ``name`` (the original kept as ``<name>_orig``) on that instance only, so
  another instance, or a subclass, keeps its own method; with ``num_heads`` the cut of the heads is computed now and
  frozen (a later ``set_num_kv_heads`` does not move it).
* ``build_bloom_alibi_tensor``, ``build_mpt_alibi_tensor``, ``get_alibi_mask``, ``build_mpt_atten_bias_tensor``:
  the wrappers, each computing the whole table for the model's total head count and keeping this rank's heads
  (``head_shard_sizes``, else the shard sizes of the heads over the group).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from dsrun import comm

from .shard_sizes import get_shard_size_list

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _HeadCountProxy:
    """The module, except that ``n_head`` reads the model's total head count (for an original helper that sizes
    its table by ``self.n_head``, which AutoTP set to this rank's count)."""

    def __init__(self, module: nn.Module, total_num_heads: int):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "n_head", total_num_heads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "n_head":
            object.__setattr__(self, name, value)
        else:
            setattr(self._module, name, value)


def _group_size(group: ProcessGroup | None) -> int:
    return comm.get_world_size(group=group) if comm.is_initialized() else 1


def _group_rank(group: ProcessGroup | None) -> int:
    return comm.get_rank(group=group) if comm.is_initialized() else 0


def get_head_shard_sizes(num_heads: int, mp_group: ProcessGroup | None = None, num_kv_heads: int | None = None
                         ) -> list[int]:
    """Every rank's head count: ``num_heads`` cut over the group as AutoTP cuts them."""
    return get_shard_size_list(num_heads, _group_size(mp_group), num_kv_heads=num_kv_heads)


def install_head_sharded_helper(module: nn.Module, name: str, wrapper: Callable[..., Any],
                                mp_group: ProcessGroup | None = None, num_heads: int | None = None,
                                num_kv_heads: int | None = None) -> None:
    """Bind ``wrapper`` over ``module``'s method ``name`` on this instance (the original kept as
    ``<name>_orig`` once); with ``num_heads``, the cut of the heads is frozen now."""
    original = f"{name}_orig"
    if original not in module.__dict__:
        setattr(module, original, getattr(module, name))
    sizes = get_head_shard_sizes(num_heads, mp_group, num_kv_heads) if num_heads is not None else None
    setattr(module, name, functools.partial(wrapper, module, mp_group=mp_group, head_shard_sizes=sizes,
                                            total_num_heads=num_heads))


def _head_shard(num_heads: int, mp_group: ProcessGroup | None = None, head_shard_sizes: list[int] | None = None,
                total_num_heads: int | None = None) -> tuple[int, int]:
    """This rank's head count and the index of its first head."""
    size, rank = _group_size(mp_group), _group_rank(mp_group)
    total = total_num_heads if total_num_heads is not None else num_heads
    sizes = list(head_shard_sizes) if head_shard_sizes else get_shard_size_list(total, size)
    if len(sizes) != size or sum(sizes) != total:
        raise ValueError(f"head shard sizes {sizes} do not cut {total} heads over {size} tensor-parallel ranks")
    return sizes[rank], sum(sizes[:rank])


def _alibi_slopes(num_heads: int, device: torch.device | None) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.; BLOOM's reading for a head count that is not a power of two)."""
    power = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(power) - 3)))
    slopes = base ** torch.arange(1, 1 + power, device=device, dtype=torch.float32)
    if power != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * power) - 3)))
        remaining = min(power, num_heads - power)
        slopes = torch.cat([slopes, extra ** torch.arange(1, 1 + 2 * remaining, 2, device=device,
                                                          dtype=torch.float32)])
    return slopes


def build_bloom_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype,
                             mp_group: ProcessGroup | None = None, head_shard_sizes: list[int] | None = None,
                             total_num_heads: int | None = None) -> torch.Tensor:
    """BLOOM's ALiBi tensor ``[batch * heads, 1, seq]`` for the model's heads (``total_num_heads`` when given:
    ``num_heads`` is then this rank's count), keeping this rank's heads when a process group is up."""
    heads = total_num_heads if total_num_heads is not None else num_heads
    batch, length = attention_mask.shape
    positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = _alibi_slopes(heads, attention_mask.device)[..., None] * positions
    if comm.is_initialized():
        mine, first = _head_shard(num_heads, mp_group, head_shard_sizes, total_num_heads)
        alibi = alibi.view(batch, heads, 1, length)[:, first:first + mine]
        return alibi.reshape(batch * mine, 1, length).to(dtype)
    return alibi.reshape(batch * heads, 1, length).to(dtype)


def get_alibi_mask(self: nn.Module, tensor: torch.Tensor, seq_length_with_past: int,
                   mp_group: ProcessGroup | None = None, head_shard_sizes: list[int] | None = None,
                   total_num_heads: int | None = None) -> torch.Tensor:
    """Wrapper of a model's ``get_alibi_mask`` (Baichuan's): the original's mask for the total head count, this
    rank's heads kept."""
    original = self.get_alibi_mask_orig
    if total_num_heads is not None and self.n_head != total_num_heads:
        function = getattr(original, "__func__", None)
        if function is None:
            raise TypeError("get_alibi_mask: the original is not a bound method, so it cannot be called with the "
                            "model's total head count")
        mask = function(_HeadCountProxy(self, total_num_heads), tensor, seq_length_with_past)
    else:
        mask = original(tensor, seq_length_with_past)
    if comm.is_initialized():
        mine, first = _head_shard(self.n_head, mp_group, head_shard_sizes, total_num_heads)
        mask = mask[first:first + mine, :seq_length_with_past, :seq_length_with_past]
    return mask


def build_mpt_atten_bias_tensor(self: nn.Module, device: torch.device, dtype: torch.dtype,
                                attention_mask: torch.Tensor | None = None, prefix_mask: torch.Tensor | None = None,
                                sequence_id: torch.Tensor | None = None, mp_group: ProcessGroup | None = None,
                                head_shard_sizes: list[int] | None = None, total_num_heads: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Wrapper of MPT's ``_attn_bias``: its bias ``[batch, heads, ...]`` with this rank's heads kept."""
    bias, mask = self._attn_bias_orig(device, dtype, attention_mask=attention_mask, prefix_mask=prefix_mask,
                                      sequence_id=sequence_id)
    if comm.is_initialized():
        mine, first = _head_shard(self.config.n_heads, mp_group, head_shard_sizes, total_num_heads)
        bias = bias[:, first:first + mine]
    return bias, mask


def build_mpt_alibi_tensor(self: nn.Module, num_heads: int, sequence_length: int, alibi_bias_max: int = 8,
                           device: torch.device | None = None, mp_group: ProcessGroup | None = None,
                           head_shard_sizes: list[int] | None = None, total_num_heads: int | None = None
                           ) -> torch.Tensor:
    """Wrapper of MPT's ``build_mpt_alibi_tensor``: the original's table for the total head count, this rank's
    heads kept."""
    heads = total_num_heads if total_num_heads is not None else num_heads
    alibi = self.build_mpt_alibi_tensor_orig(heads, sequence_length, alibi_bias_max, device)
    if comm.is_initialized():
        mine, first = _head_shard(num_heads, mp_group, head_shard_sizes, total_num_heads)
        alibi = alibi[first:first + mine]
    return alibi
