"""Process groups on 4 gloo ranks against DeepSpeed's documented layouts.

pipe=2 x data=2 (PipeDataParallelTopology: rank = pipe * 2 + data): data groups [0, 1] and [2, 3], pipe
groups [0, 2] and [1, 3]. Expert parallel 2 over data 4 (deepspeed.utils.groups): expert groups [0, 1] and
[2, 3], expert-data groups [0, 2] and [1, 3], the data group all four.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness.launch import Launch

DATA = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
PIPE = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
EXPERT = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
EXPERT_DATA = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}


def group_members(rank: int, world: int) -> dict[str, Any]:
    """Rank entry point: build the groups of pipe=2 x data=2 and of expert parallel 2 over data 4; report each
    group's members as torch.distributed sees them and prove each group communicates (a sum of the members'
    ranks)."""
    import torch.distributed as dist

    import dsrun
    from dsrun import comm
    from dsrun.comm import ProcessGroups

    dsrun.init_distributed(verbose=False)

    def seen(group: Any) -> list[int]:
        ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
        total = torch.tensor([float(rank)])
        comm.all_reduce(total, group=group)
        assert total.item() == sum(ranks)
        return sorted(ranks)

    pipe_data = ProcessGroups(pipe=2)
    out = {"pd/data": seen(pipe_data.data), "pd/pipe": seen(pipe_data.pipe), "pd/model": seen(pipe_data.model),
           "pd/coords": (pipe_data.coord("pipe"), pipe_data.coord("data"))}
    flat = ProcessGroups()
    out.update({"ep/data": seen(flat.data), "ep/expert": seen(flat.expert(2)),
                "ep/expert_data": seen(flat.expert_data(2)), "ep/members": flat.expert_members(2)})
    pipe_data.destroy()
    flat.destroy()
    return out


LAUNCHES = {"groups": Launch(group_members, 4, timeout=240)}


@pytest.mark.slow
def test_group_members_match_deepspeed(runs) -> None:
    for rank, got in enumerate(runs["groups"]):
        assert got["pd/data"] == DATA[rank] and got["pd/pipe"] == PIPE[rank] and got["pd/model"] == [rank]
        assert got["pd/coords"] == (rank // 2, rank % 2)
        assert got["ep/data"] == [0, 1, 2, 3]
        assert got["ep/expert"] == EXPERT[rank] and got["ep/expert_data"] == EXPERT_DATA[rank]
        assert tuple(got["ep/members"]) == (EXPERT[rank], EXPERT_DATA[rank])
