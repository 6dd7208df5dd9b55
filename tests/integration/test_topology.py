"""Process groups on 4 gloo ranks against DeepSpeed's documented layouts.

pipe=2 x data=2 (PipeDataParallelTopology: rank = pipe * 2 + data): data groups [0, 1] and [2, 3], pipe
groups [0, 2] and [1, 3]. Expert parallel 2 over data 4 (deepspeed.utils.groups): expert groups [0, 1] and
[2, 3], expert-data groups [0, 2] and [1, 3], the data group all four.
"""
from __future__ import annotations

import pytest

from tests.helpers import run_ranks
from tests.integration._topology_workloads import group_members

DATA = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
PIPE = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
EXPERT = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
EXPERT_DATA = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}


@pytest.mark.slow
def test_group_members_match_deepspeed() -> None:
    results = run_ranks(group_members, 4, timeout=240)
    for rank, got in enumerate(results):
        assert got["pd/data"] == DATA[rank] and got["pd/pipe"] == PIPE[rank] and got["pd/model"] == [rank]
        assert got["pd/coords"] == (rank // 2, rank % 2)
        assert got["ep/data"] == [0, 1, 2, 3]
        assert got["ep/expert"] == EXPERT[rank] and got["ep/expert_data"] == EXPERT_DATA[rank]
        assert tuple(got["ep/members"]) == (EXPERT[rank], EXPERT_DATA[rank])
