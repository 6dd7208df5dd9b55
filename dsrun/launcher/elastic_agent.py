"""The node agent of an elastic job (``--elastic_training``): nodes may leave and join while it runs.

Instead of the static rendezvous (a fixed list of nodes), the agents meet in torch elastic's *dynamic*
rendezvous over a c10d store at ``MASTER_ADDR:MASTER_PORT``, hosted by node 0's agent (as DeepSpeed's
``DSElasticAgent`` and ``torchrun --rdzv_backend c10d`` do). A round of the rendezvous admits between
``--min_elastic_nodes`` and ``--max_elastic_nodes`` nodes: once it has the minimum it waits
``--rdzv_last_call_timeout`` seconds for more (none when it has the maximum), then numbers the nodes and the
ranks afresh. The ranks of every node of the round start with the new ``WORLD_SIZE``.

- **A node leaves** (its machine dies, its agent is killed): the other nodes' ranks fail in their next
  collective, or, when no connection error reaches them (power loss, a pulled cable), their agents notice
  that the node stopped its rendezvous heartbeats (3 missed: 15 s at ``--rdzv_keep_alive_interval``'s default
  5 s, torch's) and stop their ranks themselves, as DeepSpeed's agent does. Either way they restart the group
  (one of ``--max_restarts``, DeepSpeed's 100 by default) and the next round goes on without it.
- **A node joins** (``dsrun launch --elastic_training --no_ssh --node_rank N ...`` on it): it waits in the
  rendezvous; the running agents see it within a monitor tick and restart their ranks (not counted as a
  restart) in a round that includes it.

A restarted rank starts from the beginning of its script: resuming from the last checkpoint is the script's
part (``dsrun train`` does it with ``train.resume=auto``; the elastic batch keeps the global batch size, see
docs/elasticity.md). If node 0's agent (the store's host) goes, the job goes with it.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from dsrun.launcher.options import KEEP_ALIVE_MISSES
from dsrun.launcher.supervision import NodeAgent, RankLogs

EXIT_BARRIER_TIMEOUT = 300  # seconds the agents of a finished round wait for each other (torch elastic's default)


def build_elastic_spec(*, rank_exec: list[str], command: list[str], local_world_size: int, master_addr: str,
                       master_port: int, job_id: str, local_addr: str, is_host: bool, min_nodes: int, max_nodes: int,
                       max_restarts: int, rdzv_timeout: int, last_call_timeout: float, keep_alive_interval: int,
                       monitor_interval: float) -> WorkerSpec:
    """The worker spec of an elastic node: like :func:`~dsrun.launcher.supervision.build_spec`, over a dynamic
    c10d rendezvous whose store ``is_host`` hosts; ``local_addr`` is how the other nodes reach this one. A node
    that sends no heartbeat for ``KEEP_ALIVE_MISSES`` x ``keep_alive_interval`` seconds has left its round."""
    # torch shares the rendezvous store with the ranks unless told not to, but then publishes the ranks' master
    # address only in the first round a node is rank 0: a node joining in a later round waits for it forever
    # (torch 2.13). Each round's rank 0 publishes a fresh address and port when sharing is off.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    params = RendezvousParameters(backend="c10d", endpoint=f"{master_addr}:{master_port}", run_id=job_id,
                                  min_nodes=min_nodes, max_nodes=max_nodes, local_addr=local_addr, is_host=is_host,
                                  join_timeout=rdzv_timeout, last_call_timeout=last_call_timeout,
                                  keep_alive_interval=keep_alive_interval, keep_alive_max_attempt=KEEP_ALIVE_MISSES)
    backend, store = create_backend(params)  # node 0: a TCPStore server, with its thread
    try:
        handler = create_handler(store, backend, params)
    except Exception as err:
        # the traceback would keep the store (node 0: its server thread) alive into the interpreter's finalization
        traceback.clear_frames(err.__traceback__)
        del backend, store
        raise
    return WorkerSpec(role="rank", local_world_size=local_world_size, rdzv_handler=handler,
                      entrypoint=rank_exec[0], args=tuple(rank_exec[1:] + ["--"] + command),
                      max_restarts=max_restarts, monitor_interval=monitor_interval)


class ElasticNodeAgent(NodeAgent):
    """The node agent without the fixed-membership protocol (fan-out of one failure to every node, heartbeats,
    the all-nodes exit barrier): in an elastic job a failure elsewhere is a membership change, handled by a
    new rendezvous round. Keeps the per-rank logs, PID files and the failure report of the last round."""

    def __init__(self, spec: WorkerSpec, logs: RankLogs, *, host: str, host_names: list[str], node_rank: int,
                 save_pid: int, shutdown_grace: int, stop_grace: int | None = None) -> None:
        super().__init__(spec, logs, host=host, host_names=host_names, node_rank=node_rank, save_pid=save_pid,
                         peer_timeout=0.0, shutdown_grace=shutdown_grace, stop_grace=stop_grace)
        self._exit_barrier_timeout = EXIT_BARRIER_TIMEOUT
        self._members = 0  # nodes in the current round

    def _participants(self) -> int | None:
        """Nodes of the current round still sending heartbeats, as this agent last synced the rendezvous state
        (torch's handler drops a node 3 keep-alive intervals after its last heartbeat); None if torch keeps it
        elsewhere."""
        holder = getattr(self._worker_group.spec.rdzv_handler, "_state_holder", None)
        participants = getattr(getattr(holder, "state", None), "participants", None)
        return len(participants) if participants is not None else None

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._members = self._participants() or 0

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = LocalElasticAgent._monitor_workers(self, worker_group)
        alive = self._participants()
        if result.state == WorkerState.HEALTHY and alive is not None and alive < self._members:
            self._say(f"a node of this round stopped its heartbeats ({alive} of {self._members} left); restarting "
                      f"this node's ranks in a new rendezvous round")
            self._members = alive
            return RunResult(state=WorkerState.UNHEALTHY)
        self._keep_preempted_down(result)
        if result.state == WorkerState.FAILED and result.failures:
            self._cause = self._local_report(worker_group, result)
            if self._remaining_restarts > 0:
                self._say(f"{self._cause['message']}; restarting this node's ranks in a new rendezvous round "
                          f"({self._remaining_restarts} restart(s) left)")
        return result

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        self._say(f"elastic round: {self._host} is node {worker_group.group_rank} of {worker_group.group_world_size}; "
                  f"world size {world}")
        return pids

    def _say(self, text: str) -> None:
        sys.stderr.write(f"[dsrun] {text}\n")
        sys.stderr.flush()

    def _exit_barrier(self) -> None:
        LocalElasticAgent._exit_barrier(self)  # the nodes of the last round only

    def _stop_heartbeats(self) -> None:
        """Stop torch's keep-alive thread (it writes to the store every few seconds). Torch has no public call
        for it but ``shutdown``, which also closes the rendezvous for good: wrong for a node that only leaves."""
        stop = getattr(self._worker_group.spec.rdzv_handler, "_stop_heartbeats", None)
        if stop is not None:  # another torch: the handler's timer stops when release() drops the handler
            stop()

    def _store_users(self) -> int:
        # the nodes of the last round once they all finished; after a failure the others go on to a new round
        # and never leave this one, so node 0 does not wait for them
        group = self._worker_group
        return group.group_world_size if group.state == WorkerState.SUCCEEDED else 0

    def _leave(self) -> None:
        self._stop_heartbeats()  # the keep-alive thread must be done with the store before node 0 takes it down
        super()._leave()

    def release(self) -> None:
        if self._worker_group.spec.rdzv_handler is not None:
            self._stop_heartbeats()
        super().release()

    def _announce_stop(self, report: dict[str, Any]) -> None:
        return None  # the others see this node leave as a membership change
