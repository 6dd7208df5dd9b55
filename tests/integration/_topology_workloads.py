"""Rank entry points for tests/integration/test_topology.py (4 gloo ranks)."""
from __future__ import annotations

from typing import Any

import torch


def group_members(rank: int, world: int) -> dict[str, Any]:
    """Build the groups of pipe=2 x data=2 and of expert parallel 2 over data 4; report each group's members
    as torch.distributed sees them and prove each group communicates (a sum of the members' ranks)."""
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
