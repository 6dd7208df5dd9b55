"""MiCS shard and replica groups, hpZ secondary groups and the hierarchical gather's node groups, as rank lists
(no process group is created: a world of one data-parallel group needs none), and the comms logger's record
of which group each collective ran over."""
from __future__ import annotations

import pytest

from dsrun.comm.groups import ProcessGroups, split_consecutive
from dsrun.comm.logger import CommsLogger
from dsrun.comm.topology import PipeModelDataParallelTopology


def test_split_consecutive_cuts_blocks_and_their_strided_replicas():
    assert split_consecutive([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert split_consecutive([4, 5, 6, 7, 8, 9], 3) == ([[4, 5, 6], [7, 8, 9]], [[4, 7], [5, 8], [6, 9]])


def test_shard_lists_per_data_group_and_per_node():
    groups = ProcessGroups(world_size=8, rank=0)
    assert groups.shard_lists(4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    # two nodes of 2 inside each shard group of 4: node-local pieces, then the ranks at the same place
    assert groups.shard_lists(4, ranks_per_node=2) == ([[0, 1], [2, 3], [4, 5], [6, 7]],
                                                       [[0, 2], [1, 3], [4, 6], [5, 7]])
    with pytest.raises(ValueError, match="must divide the data-parallel size 8"):
        groups.shard_lists(3)
    # with tensor parallelism the data-parallel groups are strided: shards are cut inside each of them
    tp = ProcessGroups.__new__(ProcessGroups)  # the rank lists only: no torch groups
    tp.topology = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=4)
    assert tp.shard_lists(2)[0] == [[0, 2], [4, 6], [1, 3], [5, 7]]


def test_comms_logger_counts_per_group():
    logger = CommsLogger()
    logger.record("all_gather", 100, 50.0, group=(0, 1))
    logger.record("all_gather", 100, 50.0, group=(0, 1))
    logger.record("all_gather", 400, 300.0, group=(0, 1, 2, 3))
    logger.record("barrier", 0, 0)  # no group known: in the op totals only
    stats = logger.group_snapshot()
    assert stats["all_gather"]["0,1"]["count"] == 2 and stats["all_gather"]["0,1"]["traffic_bytes"] == 100.0
    assert stats["all_gather"]["0,1,2,3"]["message_bytes"] == 400 and "barrier" not in stats
    logger.reset()
    assert logger.group_snapshot() == {}
