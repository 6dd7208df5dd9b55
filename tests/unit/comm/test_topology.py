"""ProcessTopology against the examples in DeepSpeed's documentation (api-inventory.md, ProcessTopology)."""
from __future__ import annotations

import pytest

from dsrun.comm import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from dsrun.comm.groups import ProcessGroups


def test_documented_examples() -> None:
    x = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert x.get_rank(x=0, y=1) == 1
    assert x.get_dim("y") == 3
    assert (x.get_coord(rank=1).x, x.get_coord(rank=1).y) == (0, 1)
    assert x.get_axis_list(axis="x", idx=0) == [0, 1, 2] and x.get_axis_list(axis="y", idx=0) == [0, 3]
    ab = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert ab.get_rank_repr(rank=3) == "a_01-b_01" and ab.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"
    pdm = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert pdm.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert pdm.filter_match(pipe=0, data=1) == [2, 3]
    assert [tuple(pdm.get_coord(r)) for r in pdm.filter_match(pipe=0, data=1)] == [(0, 1, 0), (0, 1, 1)]
    assert pdm.get_axis_names() == ["pipe", "data", "model"] and pdm.world_size() == 8


def test_pipe_data_and_pipe_model_data_axis_orders() -> None:
    pd = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert pd.get_axis_names() == ["pipe", "data"]
    assert pd.get_axis_comm_lists("data") == [[0, 1], [2, 3]] and pd.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    pmd = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2)
    assert pmd.get_axis_names() == ["pipe", "data", "model"] and pmd.dims == [1, 2, 2]
    assert pmd.get_axis_comm_lists("model") == [[0, 1], [2, 3]]


def test_expert_lists_split_each_data_parallel_group() -> None:
    # deepspeed.utils.groups' example: 16 ranks, expert parallel 2
    groups = ProcessGroups.__new__(ProcessGroups)
    groups.world_size, groups.rank = 16, 0
    groups.topology = PipeModelDataParallelTopology(1, 1, 16)
    experts, replicas = groups.expert_lists(2)
    assert experts == [[2 * i, 2 * i + 1] for i in range(8)]
    assert replicas == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    with pytest.raises(ValueError, match="divide"):
        groups.expert_lists(3)


def test_data_before_expert_layout_makes_replicas_consecutive() -> None:
    # use_data_before_expert_parallelism: 8 data-parallel ranks, expert parallel 2
    groups = ProcessGroups.__new__(ProcessGroups)
    groups.world_size, groups.rank, groups._expert = 8, 0, {}
    groups.topology = PipeModelDataParallelTopology(1, 1, 8)
    groups.set_expert_layout(True)
    experts, replicas = groups.expert_lists(2)
    assert replicas == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert experts == [[0, 4], [1, 5], [2, 6], [3, 7]]
    groups.set_expert_layout(False)
    assert groups.expert_lists(2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        ProcessTopology(["a", "a"], [1, 2])
    with pytest.raises(ValueError):
        ProcessTopology(["a"], [0])
