"""The node agent's cross-node protocol, driven against an in-memory store with a controllable clock:
failure causes, abort, heartbeats, lost store, and the exit barrier."""
from __future__ import annotations

import json

import pytest
from torch.distributed import HashStore

from dsrun.launcher import supervision
from dsrun.launcher.supervision import NodeAgent, RankLogs, build_spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(supervision.time, "monotonic", fake)
    monkeypatch.setattr(supervision.time, "sleep", lambda seconds: setattr(fake, "now", fake.now + seconds))
    return fake


def make_agent(tmp_path, node_rank: int = 0, nnodes: int = 2, max_restarts: int = 0) -> NodeAgent:
    spec = build_spec(rank_exec=["python", "-m", "dsrun.launcher.rank_exec"], command=["train.py"],
                      local_world_size=1, master_addr="127.0.0.1", master_port=1, job_id="t", node_rank=node_rank,
                      nnodes=nnodes, max_restarts=max_restarts, rdzv_timeout=1, monitor_interval=0.25)
    return NodeAgent(spec, RankLogs(str(tmp_path)), host=f"h{node_rank}",
                     host_names=[f"h{i}" for i in range(nnodes)], node_rank=node_rank, save_pid=0,
                     peer_timeout=30, shutdown_grace=1)


def rank_failure(rank: int, signal_name: str | None = "SIGKILL") -> dict:
    return {"rank": rank, "signal": signal_name, "exitcode": -9, "message": f"rank {rank} died", "round": 0}


def test_a_published_cause_fails_every_other_node(tmp_path, clock):
    store, agent = HashStore(), make_agent(tmp_path)
    assert agent._check_peers(store, 0) is None
    store.set("dsrun/cause/0", json.dumps(rank_failure(3)))
    assert agent._check_peers(store, 0)["rank"] == 3
    assert agent._check_peers(store, 1) is None  # a later round starts clean


def test_the_first_failure_is_the_cause_later_ones_adopt_it(tmp_path, clock):
    store = HashStore()
    first, second = make_agent(tmp_path / "a", node_rank=1), make_agent(tmp_path / "b", node_rank=0)
    assert first._publish_cause(store, 0, rank_failure(3))["rank"] == 3
    # rank 0 then exits with an error because its peer vanished: a consequence, not the cause
    assert second._publish_cause(store, 0, rank_failure(0, signal_name=None))["rank"] == 3
    assert store.check(["dsrun/abort"])  # no restarts left: nobody may restart after this


def test_abort_stops_restarts(tmp_path, clock):
    store, agent = HashStore(), make_agent(tmp_path, max_restarts=3)
    store.set("dsrun/abort", "1")
    report = agent._check_peers(store, 0)
    assert report["message"] == "another node left the job after a failure"
    assert agent._remaining_restarts == 0


def test_a_silent_peer_is_declared_lost_after_the_timeout_unless_it_finished(tmp_path, clock):
    store, agent = HashStore(), make_agent(tmp_path, nnodes=3)
    store.add("dsrun/beat/1", 1)
    store.add("dsrun/beat/2", 1)
    assert agent._check_peers(store, 0) is None
    store.set("dsrun/done/2", "1")  # node 2's ranks finished: it stops beating, and that is fine
    for _ in range(29):
        clock.now += 1.0
        store.add("dsrun/beat/1", 0)
        assert agent._check_peers(store, 0) is None
    clock.now += 2.0
    report = agent._check_peers(store, 0)
    assert report["message"] == "the agent on node 1 (h1) sent no heartbeat for 30 s"
    assert store.add("dsrun/beat/0", 0) >= 30  # and our own heartbeat kept going


def test_a_beating_peer_is_never_lost(tmp_path, clock):
    store, agent = HashStore(), make_agent(tmp_path)
    for _ in range(100):
        clock.now += 1.0
        store.add("dsrun/beat/1", 1)
        assert agent._check_peers(store, 0) is None


class BrokenStore:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_losing_the_store_stops_the_node(tmp_path, clock):
    agent = make_agent(tmp_path, node_rank=1, max_restarts=2)
    report = agent._check_peers(BrokenStore(), 0)
    assert report["message"] == "lost contact with the job store on node 0 (h0): Connection reset by peer"
    assert agent._remaining_restarts == 0


def test_exit_barrier_waits_for_every_node_but_not_for_a_failed_one(tmp_path, clock):
    store = HashStore()
    agent = make_agent(tmp_path, node_rank=0)
    agent._store = store
    store.add("dsrun/done_count", 1)  # node 1 finished already
    agent._exit_barrier()
    assert agent._late_cause is None and store.add("dsrun/done_count", 0) == 2

    store, agent = HashStore(), make_agent(tmp_path, node_rank=0)
    agent._store = store
    store.set("dsrun/cause/0", json.dumps(rank_failure(2)))
    agent._exit_barrier()
    assert agent._late_cause["rank"] == 2 and store.check(["dsrun/abort"])


def test_exit_barrier_notices_a_silent_peer(tmp_path, clock):
    store, agent = HashStore(), make_agent(tmp_path, node_rank=0)
    agent._store = store
    agent._exit_barrier()  # node 1 neither finishes nor beats
    assert agent._late_cause["message"] == "the agent on node 1 (h1) sent no heartbeat for 30 s"


def test_exit_barrier_gives_up_after_its_timeout(tmp_path, clock, monkeypatch):
    store, agent = HashStore(), make_agent(tmp_path, node_rank=0)
    monkeypatch.setattr(agent, "_peer_timeout", float("inf"))
    agent._store = store
    agent._exit_barrier_timeout = 120
    started = clock.now
    agent._exit_barrier()  # node 1 never finishes and never fails (and keeps beating)
    assert clock.now - started >= agent._exit_barrier_timeout and agent._late_cause is None


def test_a_stopped_agent_tells_the_others_at_once(tmp_path, clock):
    store = HashStore()
    stopped, other = make_agent(tmp_path / "a", node_rank=1), make_agent(tmp_path / "b", node_rank=0)
    stopped._store = store
    stopped._announce_stop(stopped._agent_report("the agent on h1 was stopped by SIGTERM"))
    assert other._check_peers(store, 0)["message"] == "the agent on h1 was stopped by SIGTERM"
    assert store.check(["dsrun/abort"])


def test_ranks_that_saved_on_preemption_are_not_restarted_here(tmp_path):
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    agent = make_agent(tmp_path, max_restarts=3)
    agent._keep_preempted_down(RunResult(state=WorkerState.FAILED, failures={0: SimpleNamespace(exitcode=1)}))
    assert agent._remaining_restarts == 3  # a crash is restarted
    agent._keep_preempted_down(RunResult(state=WorkerState.FAILED, failures={1: SimpleNamespace(exitcode=138)}))
    assert agent._remaining_restarts == 0  # preempted: the job ends for the scheduler to requeue
