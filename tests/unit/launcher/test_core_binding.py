"""Core binding: NUMA-aware shares, and ``dsrun train``'s default (on for offload runs with several ranks per host).

The rank side (each rank's ``os.sched_getaffinity`` is the share the agent gave it, ``OMP_NUM_THREADS`` its size)
is tests/integration/launcher/test_local.py's ``test_bind_cores_to_rank_pins_each_rank_to_its_share``."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from dsrun.cli.train import _default_core_binding
from dsrun.compose import compose_runspec
from dsrun.launcher.core_binding import binds_by_default, cores_for_ranks, describe, numa_nodes, offloads
from dsrun.runspec import resolve_run

TWO_NODES = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_each_rank_takes_a_share_of_one_numa_node() -> None:
    everything = range(8)
    assert cores_for_ranks(2, nodes=TWO_NODES, available=everything) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cores_for_ranks(4, nodes=TWO_NODES, available=everything) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # interleaved numbering (core ids alternate between sockets): a rank still stays on its node
    assert cores_for_ranks(2, nodes=[[0, 2, 4, 6], [1, 3, 5, 7]], available=everything) == [[0, 2, 4, 6],
                                                                                             [1, 3, 5, 7]]
    # only the cores this process may use; a node left without any drops out
    assert cores_for_ranks(2, nodes=TWO_NODES, available=[0, 1, 2, 3]) == [[0, 1], [2, 3]]


def test_ranks_the_nodes_cannot_share_evenly_split_the_cores_in_order() -> None:
    assert cores_for_ranks(3, nodes=TWO_NODES, available=range(8)) == [[0, 1], [2, 3], [4, 5]]
    assert cores_for_ranks(2, nodes=[], available=[5, 1, 3]) == [[1], [3]]  # no NUMA information
    assert cores_for_ranks(2, core_list=[9, 8, 10, 11], nodes=TWO_NODES) == [[8, 9], [10, 11]]  # a list wins
    with pytest.raises(ValueError, match="1 cores cannot be split among 2 ranks"):
        cores_for_ranks(2, nodes=[], available=[0])


def test_numa_nodes_are_read_from_sysfs(tmp_path) -> None:
    for node, cpulist in (("node1", "4-5,7\n"), ("node0", "0-3\n"), ("node2", "\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist)
    (tmp_path / "possible").write_text("0-2\n")
    assert numa_nodes(tmp_path) == [[0, 1, 2, 3], [4, 5, 7]]  # node order; the memory-only node2 left out
    assert numa_nodes(tmp_path / "missing") == []
    assert describe([[0, 1, 2, 3], [4, 5, 7]]) == "local rank 0: cores 0-3; local rank 1: cores 4-5,7"


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)


def _binding(run: object, launcher: dict) -> tuple[object, str]:
    launcher = dict(launcher)
    log = _Log()
    _default_core_binding(run, launcher, log)
    return launcher.get("bind_cores_to_rank"), "\n".join(log.lines)


def test_train_binds_offload_runs_with_several_ranks_per_host_by_default() -> None:
    run = resolve_run(compose_runspec(["offload=cpu", "zero=stage2", "launcher.num_procs=2"]))
    bound, said = _binding(run, run.runspec.launcher)  # the conf's launcher says null: dsrun decides
    if len(os.sched_getaffinity(0)) >= 2:
        assert bound is True and "binding each rank to its share" in said and "bind_cores_to_rank=false" in said
    else:  # a one-core machine: the next test's case
        assert bound is None and "not binding cores" in said
    # the user's word stands either way
    assert _binding(run, {"bind_cores_to_rank": False}) == (False, "")
    plain = SimpleNamespace(ds=_config({"stage": 2}), plan=run.plan)
    assert _binding(plain, {"bind_cores_to_rank": None}) == (None, "")  # nothing offloaded
    assert _binding(plain, {"bind_cores_to_rank": True}) == (True, "")
    one_rank = SimpleNamespace(ds=run.ds, plan=SimpleNamespace(hosts={"localhost": [0]}))
    assert _binding(one_rank, {"bind_cores_to_rank": None}) == (None, "")  # one rank per host


def test_the_default_does_not_bind_fewer_cores_than_ranks() -> None:
    """Under ``taskset -c 0`` (or a one-core cpuset) the default leaves the ranks unbound and says why; it never
    fails the run, as an explicit ``--bind_cores_to_rank`` does (its split would give a rank no core)."""
    run = resolve_run(compose_runspec(["offload=cpu", "zero=stage2", "launcher.num_procs=2"]))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        bound, said = _binding(run, run.runspec.launcher)
    finally:
        os.sched_setaffinity(0, before)
    assert bound is None
    assert said == ("not binding cores: 2 ranks per host share the 1 core(s) this process may run on, fewer than "
                    "one each (launcher.bind_cores_to_rank=false says not to try)")


def _config(zero: dict) -> object:
    from dsrun.config import DSConfig

    return DSConfig.model_validate({"train_batch_size": 2, "zero_optimization": zero})


def test_offloads_reads_both_offload_sections() -> None:
    assert not offloads(_config({"stage": 2}))
    assert offloads(_config({"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    assert offloads(_config({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}))
    assert not binds_by_default(_config({"stage": 2, "offload_optimizer": {"device": "cpu"}}), 1)


def test_the_agent_splits_this_machines_cores_and_prints_the_binding_once(capsys) -> None:
    from dsrun.launcher.agent import _cores_for_ranks

    ranks = min(2, len(os.sched_getaffinity(0)))
    groups = _cores_for_ranks(ranks, None)  # no --bind_core_list: this machine's NUMA nodes or its cores in order
    assert groups == cores_for_ranks(ranks) and all(groups)
    assert capsys.readouterr().out.count("dsrun: binding cores on") == 1
