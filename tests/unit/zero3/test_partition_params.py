"""Per-parameter partitioning in one process (a world of one): layout, padding, gather/release, writes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dsrun.zero.partition_params import (ParamStatus, full_tensor, gather_params, partition_numel,
                                                 partition_param, release_param, shard_padding,
                                                 write_full_value)


@pytest.mark.parametrize("numel, world, expected", [(10, 4, 3), (12, 4, 3), (1, 8, 1), (0, 4, 0), (7, 1, 7)])
def test_each_rank_keeps_ceil_numel_over_world(numel: int, world: int, expected: int) -> None:
    assert partition_numel(numel, world) == expected


def test_padding_sits_at_the_end_of_the_last_ranks_shards() -> None:
    p = nn.Parameter(torch.zeros(10))
    p.ds_numel, p.ds_partition_numel = 10, 3  # 10 elements over 4 ranks: 3 + 3 + 3 + 1, padded to 12
    assert [shard_padding(p, r) for r in range(4)] == [0, 0, 0, 2]
    p.ds_numel, p.ds_partition_numel = 5, 1  # 5 elements over 8 ranks: ranks 5-7 hold only padding
    assert [shard_padding(p, r) for r in range(8)] == [0, 0, 0, 0, 0, 1, 1, 1]


def test_partition_keeps_the_parameter_object_and_frees_its_data() -> None:
    lin = nn.Linear(3, 4)
    weight = lin.weight
    expected = weight.detach().clone()
    partition_param(weight)
    assert lin.weight is weight and weight.numel() == 0
    assert weight.ds_shape == torch.Size([4, 3]) and weight.ds_numel == 12
    assert weight.ds_status is ParamStatus.NOT_AVAILABLE
    torch.testing.assert_close(weight.ds_tensor, expected.reshape(-1))
    partition_param(weight)  # idempotent
    assert weight.ds_numel == 12


def test_gather_gives_the_full_value_and_release_drops_it() -> None:
    lin = nn.Linear(3, 4)
    expected = lin.weight.detach().clone()
    partition_param(lin.weight)
    gather_params([lin.weight])
    assert lin.weight.ds_status is ParamStatus.AVAILABLE
    torch.testing.assert_close(lin.weight.data, expected)
    out = lin(torch.ones(2, 3))  # usable as a normal parameter while gathered
    assert out.shape == (2, 4)
    release_param(lin.weight)
    assert lin.weight.numel() == 0 and lin.weight.ds_status is ParamStatus.NOT_AVAILABLE
    torch.testing.assert_close(full_tensor(lin.weight), expected)
    assert lin.weight.ds_status is ParamStatus.NOT_AVAILABLE  # full_tensor leaves it as it found it


def test_write_full_value_updates_the_shard_and_the_optimizer_copy() -> None:
    p = nn.Parameter(torch.zeros(2, 3))
    partition_param(p)
    p.ds_fp32_shard = torch.zeros(6)
    write_full_value(p, torch.arange(6.0).view(2, 3))
    torch.testing.assert_close(p.ds_tensor, torch.arange(6.0))
    torch.testing.assert_close(p.ds_fp32_shard, torch.arange(6.0))


def test_partition_converts_dtype() -> None:
    p = nn.Parameter(torch.ones(5))
    partition_param(p, dtype=torch.bfloat16)
    assert p.ds_tensor.dtype == torch.bfloat16 and p.dtype == torch.bfloat16
