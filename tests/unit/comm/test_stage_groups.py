"""Groups across pipeline stages (a PipelineModule's weights tied between stages) come from the topology's
``ProcessGroups``: their rank lists, their collective creation order, the cache and their destruction. torch's
group calls are recorded instead of made, so a world of 8 is seen from any of its ranks in one process."""
from __future__ import annotations

import pytest

from dsrun.comm import comm
from dsrun.comm.groups import ProcessGroups
from dsrun.comm.topology import PipeDataParallelTopology, PipeModelDataParallelTopology


class Recorder:
    def __init__(self) -> None:
        self.created: list[tuple[int, ...]] = []
        self.destroyed: list[tuple[int, ...]] = []

    def new_group(self, ranks, timeout=None, local=False):
        self.created.append(tuple(ranks))
        return ("group", tuple(ranks))

    def destroy_process_group(self, group=None):
        self.destroyed.append(group[1])


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(comm, "new_group", rec.new_group)
    monkeypatch.setattr(comm, "destroy_process_group", rec.destroy_process_group)
    return rec


def test_stage_lists_hold_the_stages_at_each_data_and_model_coordinate() -> None:
    groups = ProcessGroups.__new__(ProcessGroups)  # the rank lists only: no torch groups
    groups.topology = PipeModelDataParallelTopology(num_pp=3, num_mp=2, num_dp=2)  # rank = (pipe*2 + data)*2 + model
    assert groups.stage_lists([0, 2]) == [[0, 8], [1, 9], [2, 10], [3, 11]]
    groups.topology = PipeDataParallelTopology(num_pp=4, num_dp=2)
    assert groups.stage_lists([1, 3]) == [[2, 6], [3, 7]]


def test_every_rank_creates_every_group_in_request_order_and_keeps_its_own(recorder: Recorder) -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=4)  # ranks 0-3 stage 0, 4-7 stage 1
    groups = ProcessGroups(topology=topo, world_size=8, rank=5)
    recorder.created.clear()  # the axes' groups
    head = groups.stage_group([0, 1], name="embed")
    assert recorder.created == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert head is not None and head.ranks == [1, 5] and head.group == ("group", (1, 5))
    assert groups.stage_group([0, 1], name="embed") is head and len(recorder.created) == 4  # cached
    # another name is another group, even on the same ranks (one per tie key, as DeepSpeed makes them)
    other = groups.stage_group([0, 1], name="pos")
    assert other is not None and other is not head and len(recorder.created) == 8
    groups.destroy()
    assert recorder.destroyed.count((1, 5)) == 3  # its pipe-axis group, and the two stage groups
    assert not any(ranks in recorder.destroyed for ranks in [(0, 4), (2, 6), (3, 7)])  # not this rank's


def test_a_rank_outside_the_stages_gets_none_and_release_keeps_what_is_named(recorder: Recorder) -> None:
    topo = PipeDataParallelTopology(num_pp=3, num_dp=1)
    groups = ProcessGroups(topology=topo, world_size=3, rank=1)
    assert groups.stage_group([0, 2], name="embed") is None  # stage 1 holds no copy, but took part in creating it
    assert recorder.created[-1] == (0, 2)
    kept = groups.stage_group([1, 2], name="head")
    groups.release_stage_groups(keep=[("head", [1, 2])])
    assert recorder.destroyed == [] and groups.stage_group([1, 2], name="head") is kept
    groups.release_stage_groups()
    assert recorder.destroyed == [(1, 2)]
    before = len(recorder.created)
    assert groups.stage_group([1, 2], name="head") is not kept and len(recorder.created) == before + 1
