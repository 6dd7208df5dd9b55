"""The torch.distributed.elastic side of the node agent: worker spec, per-rank logs, and the agent class.

:class:`NodeAgent` is a ``LocalElasticAgent`` whose monitor tick also talks to the other nodes through
the rendezvous store (keys under ``dsrun/``):

- ``dsrun/failed/R`` (counter) and ``dsrun/cause/R`` (JSON report): the first agent to see a rank fail in
  restart round R publishes the cause; every agent that reads it fails its own group, so torch elastic
  stops (or, with restarts left, restarts) every node's ranks in the same round;
- ``dsrun/beat/N``: node N's heartbeat counter, bumped once a second while its ranks run;
- ``dsrun/done/N``, ``dsrun/done_count``: node N's ranks all finished; replaces torch's exit barrier with
  one that keeps making the monitor tick's checks, so it stops waiting when another node fails or goes silent;
- ``dsrun/abort``: a node left the job for good while others may still run; nobody restarts after it;
- ``dsrun/left``: agents that are about to exit, so node 0 (which hosts the store) leaves last.

Before it exits the agent releases the store and the rendezvous (:meth:`NodeAgent.release`): no thread of
theirs is left for the interpreter's finalization.

Imports torch; :mod:`dsrun.launcher.agent` imports this module only after its cheap checks.
"""
from __future__ import annotations

import gc
import inspect
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from dsrun.launcher.protocol import EXIT_PREEMPTED, exit_code_for, log_tails, report_failure

_LEAVE_WAIT = 5.0  # how long node 0 keeps the store up for the other agents to read the outcome
_CONSEQUENCE_WAIT = 0.5  # how long an exit-code failure waits for an earlier failure elsewhere


class RankLogs(LogsSpecs):
    """Per-rank log files ``LOG_DIR/rank<R>.stdout.log`` and ``.stderr.log`` (``.attempt<K>`` after a
    restart), also copied to the agent's console with a ``[rank<R>]:`` prefix."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        stdouts, stderrs, error_files = {}, {}, {}
        for local_rank, env in envs.items():
            attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
            stem = f"rank{env['RANK']}" + ("" if attempt == "0" else f".attempt{attempt}")
            base = Path(self.root_log_dir) / stem
            stdouts[local_rank] = f"{base}.stdout.log"
            stderrs[local_rank] = f"{base}.stderr.log"
            error_files[local_rank] = f"{base}.error.json"
            env["TORCHELASTIC_ERROR_FILE"] = error_files[local_rank]
        return LogsDest(stdouts=stdouts, stderrs=stderrs, tee_stdouts=dict(stdouts),
                        tee_stderrs=dict(stderrs), error_files=error_files)


def build_spec(*, rank_exec: list[str], command: list[str], local_world_size: int, master_addr: str,
               master_port: int, job_id: str, node_rank: int, nnodes: int, max_restarts: int,
               rdzv_timeout: int, monitor_interval: float) -> WorkerSpec:
    """The worker spec: ``local_world_size`` copies of ``rank_exec -- command`` under a static rendezvous
    whose store node 0 hosts at ``master_addr:master_port``."""
    rendezvous = StaticTCPRendezvous(master_addr, master_port, node_rank, nnodes, job_id, rdzv_timeout)
    return WorkerSpec(role="rank", local_world_size=local_world_size, rdzv_handler=rendezvous,
                      entrypoint=rank_exec[0], args=tuple(rank_exec[1:] + ["--"] + command),
                      max_restarts=max_restarts, monitor_interval=monitor_interval)


_AGENT_TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters


class NodeAgent(LocalElasticAgent):
    """torch elastic's local agent plus cross-node failure fan-out, heartbeats and a watchful exit."""

    def __init__(self, spec: WorkerSpec, logs: RankLogs, *, host: str, host_names: list[str], node_rank: int,
                 save_pid: int, peer_timeout: float, shutdown_grace: int, stop_grace: int | None = None) -> None:
        # torch elastic waits shutdown_timeout after passing on a signal the agent got (Ctrl-C, SIGTERM): the
        # ranks then finish their step, save a checkpoint and close their monitors, which takes longer than
        # stopping the ranks of a failed job (_stop_workers passes shutdown_grace itself). torch < 2.13's agent
        # has no shutdown_timeout and waits its own 30 s there.
        stop = shutdown_grace if stop_grace is None else stop_grace
        extra = {"shutdown_timeout": stop} if _AGENT_TAKES_SHUTDOWN_TIMEOUT else {}
        super().__init__(spec, logs, start_method="spawn", exit_barrier_timeout=24 * 3600,
                         log_line_prefix_template="[rank${rank}]:", **extra)
        self._host = host
        self._host_names = host_names
        self._node_rank = node_rank
        self._nnodes = len(host_names)
        self._grace = shutdown_grace
        self._peer_timeout = peer_timeout
        self._pid_file = Path(f"/tmp/dsrun-{save_pid}-node{node_rank}.json") if save_pid else None
        self._cause: dict[str, Any] | None = None
        self._late_cause: dict[str, Any] | None = None
        self._beats: dict[int, tuple[int, float]] = {}
        self._last_beat = 0.0

    # ---- rounds and reports -------------------------------------------------------------------------

    def _round(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _local_report(self, worker_group: WorkerGroup, result: RunResult) -> dict[str, Any]:
        # torch elastic stops a failed rank's siblings with SIGTERM and lists them as failures too; the
        # rank that failed on its own is the one that did not die of that SIGTERM.
        rank, failure = min(result.failures.items(), key=lambda item: (
            item[1].exitcode == -signal.SIGTERM, item[1].timestamp, item[0]))
        local_rank = failure.local_rank
        pcontext = self._pcontext
        stderr = pcontext.stderrs.get(local_rank, "") if pcontext else ""
        stdout = pcontext.stdouts.get(local_rank, "") if pcontext else ""
        how = f"exit code {failure.exitcode}"
        signal_name = None
        if failure.exitcode < 0:
            signal_name = failure.signal_name()
            how += f" ({signal_name})"
        return {
            "rank": rank, "local_rank": local_rank, "host": self._host, "node_rank": self._node_rank,
            "exitcode": failure.exitcode, "signal": signal_name, "pid": failure.pid,
            "logs": log_tails([p for p in (stdout, stderr) if p]),
            "round": self._round(),
            "message": f"rank {rank} (local rank {local_rank}) on host {self._host} exited with {how}",
        }

    def _agent_report(self, message: str, node_rank: int | None = None) -> dict[str, Any]:
        node = self._node_rank if node_rank is None else node_rank
        return {"rank": None, "local_rank": None, "host": self._host_names[node], "node_rank": node,
                "exitcode": None, "signal": None, "pid": None, "logs": [],
                "round": self._round(), "message": message}

    # ---- torch elastic hooks ------------------------------------------------------------------------

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if _AGENT_TAKES_SHUTDOWN_TIMEOUT:
            self._shutdown(timeout=self._grace)
        else:  # torch < 2.13 waits its own fixed grace
            self._shutdown()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        if self._pid_file is not None:
            ranks = {str(w.global_rank): pids[w.local_rank] for w in worker_group.workers}
            self._pid_file.write_text(json.dumps({"agent": os.getpid(), "host": self._host, "ranks": ranks}))
        return pids

    def _keep_preempted_down(self, result: RunResult) -> None:
        """Ranks that exited with EXIT_PREEMPTED saved a checkpoint because the machines are going away:
        restarting them here would only be preempted again. The job ends; the scheduler requeues it."""
        if result.state == WorkerState.FAILED and any(
                failure.exitcode == EXIT_PREEMPTED for failure in result.failures.values()):
            self._remaining_restarts = 0

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        store = worker_group.store
        current = self._round()
        self._keep_preempted_down(result)
        if result.state == WorkerState.FAILED:
            self._cause = self._publish_cause(store, current, self._local_report(worker_group, result))
            return result
        if result.state == WorkerState.HEALTHY:
            peer = self._check_peers(store, current)
            if peer is not None:
                self._cause = peer
                return RunResult(state=WorkerState.FAILED, failures={})
        return result

    def _publish_cause(self, store: Store, current: int, local: dict[str, Any]) -> dict[str, Any]:
        """Publish ``local`` as the round's cause unless another node's failure came first; return the cause.

        A rank that dies because a peer vanished (a collective fails, the rank exits with an error) is a
        consequence, not the cause. Such exits are seen a moment after the real failure, so an exit code
        (not a signal) waits briefly for another node's report before claiming to be the cause.
        """
        cause_key = f"dsrun/cause/{current}"
        try:
            if local["signal"] in (None, "SIGTERM"):
                deadline = time.monotonic() + _CONSEQUENCE_WAIT
                while time.monotonic() < deadline and not store.check([cause_key]):
                    time.sleep(0.05)
            if store.add(f"dsrun/failed/{current}", 1) == 1:
                store.set(cause_key, json.dumps(local))
                cause = local
            else:
                cause = json.loads(store.get(cause_key))
            if self._remaining_restarts == 0:
                store.set("dsrun/abort", "1")
            return cause
        except Exception:  # noqa: BLE001 - the store host is gone; our own report still reaches the launcher
            return local

    def _check_peers(self, store: Store, current: int) -> dict[str, Any] | None:
        try:
            if store.check([f"dsrun/cause/{current}"]):
                return json.loads(store.get(f"dsrun/cause/{current}"))
            if store.check(["dsrun/abort"]):
                self._remaining_restarts = 0
                return self._agent_report("another node left the job after a failure")
            now = time.monotonic()
            if now - self._last_beat < 1.0:
                return None
            self._last_beat = now
            store.add(f"dsrun/beat/{self._node_rank}", 1)
            for node in range(self._nnodes):
                if node == self._node_rank or store.check([f"dsrun/done/{node}"]):
                    continue
                count = store.add(f"dsrun/beat/{node}", 0)
                previous = self._beats.get(node)
                if previous is None or previous[0] != count:
                    self._beats[node] = (count, now)
                elif now - previous[1] > self._peer_timeout:
                    self._remaining_restarts = 0
                    return self._agent_report(
                        f"the agent on node {node} ({self._host_names[node]}) sent no heartbeat for "
                        f"{self._peer_timeout:.0f} s", node)
        except Exception as err:  # noqa: BLE001 - any store error means node 0's agent is gone
            self._remaining_restarts = 0
            return self._agent_report(f"lost contact with the job store on node 0 ({self._host_names[0]}): "
                                      f"{str(err).splitlines()[0] if str(err) else type(err).__name__}", 0)
        return None

    def _exit_barrier(self) -> None:
        """Wait until every node's ranks finished, unless some node fails meanwhile."""
        store = self._store
        try:
            store.set(f"dsrun/done/{self._node_rank}", "1")
            done = store.add("dsrun/done_count", 1)
            deadline = time.monotonic() + self._exit_barrier_timeout
            while done < self._nnodes and time.monotonic() < deadline:
                # the same checks as while the ranks ran: a failure, an abort, a silent peer, a lost store
                problem = self._check_peers(store, self._round())
                if problem is not None:
                    self._late_cause = problem
                    store.set("dsrun/abort", "1")  # nodes about to restart would wait for us forever
                    return
                time.sleep(0.25)
                done = store.add("dsrun/done_count", 0)
        except Exception as err:  # noqa: BLE001
            self._late_cause = self._agent_report(f"lost contact with the job store: {err}", 0)

    # ---- the whole life of the agent ----------------------------------------------------------------

    def _announce_stop(self, report: dict[str, Any]) -> None:
        """We were told to stop (Ctrl-C, SIGTERM): make the other nodes stop now, not at a heartbeat timeout."""
        store = self._store
        if store is None:  # stopped before the rendezvous: nobody depends on us yet
            return
        try:
            current = self._round()
            if store.add(f"dsrun/failed/{current}", 1) == 1:
                store.set(f"dsrun/cause/{current}", json.dumps(report))
            store.set("dsrun/abort", "1")
        except Exception:  # noqa: BLE001 - the store is gone; the others notice that on their own
            pass

    def _store_users(self) -> int:
        """How many agents (this one included) node 0 lets finish with the store before it takes it down."""
        return self._nnodes

    def _leave(self) -> None:
        """Tell node 0 we are done with the store; node 0 waits (briefly) until everyone has."""
        store = self._store
        if store is None:
            return
        try:
            left = store.add("dsrun/left", 1)
            deadline = time.monotonic() + _LEAVE_WAIT
            while self._node_rank == 0 and left < self._store_users() and time.monotonic() < deadline:
                time.sleep(0.1)
                left = store.add("dsrun/left", 0)
        except Exception:  # noqa: BLE001 - the store is gone already; nothing to wait for
            pass

    def release(self) -> None:
        """Drop the rendezvous and the store now, while the interpreter is whole.

        Node 0's TCPStore server runs a C++ thread, and torch's rendezvous handlers keep store clients (the
        elastic one a keep-alive thread too). Left to the garbage collector they can outlive ``main`` and be torn
        down by the interpreter's finalization, where a thread still inside C++ aborts the finished agent
        ("terminate called without an active exception"). Called last, on every way out of
        :meth:`run_to_exit_code`; the ranks are stopped by then (torch's ``run`` does it on every path).
        """
        group = self._worker_group
        self._store = None
        group.store = None
        group.spec.rdzv_handler = None  # the handler owns the TCPStore (server on node 0)
        gc.collect()  # a store caught in a reference cycle goes now, not at exit

    def run_to_exit_code(self) -> int:
        """Run the node's ranks to the end; print failure reports; return the agent's exit code."""
        try:
            try:
                result = self.run()
            except SignalException as err:
                report = self._agent_report(f"the agent on {self._host} was stopped by "
                                            f"{getattr(err.sigval, 'name', err.sigval)}")
                self._announce_stop(report)
                report_failure(report)
                return 128 + int(err.sigval)
            except Exception as err:  # noqa: BLE001 - rendezvous/store errors: one clear line, not a traceback
                text = str(err).splitlines()[0] if str(err) else type(err).__name__
                report_failure(self._agent_report(f"the agent on {self._host} failed: {text}"))
                return 1
            if result is None:
                report_failure(self._agent_report("the rendezvous was closed"))
                return 1
            if result.is_failed():
                cause = self._cause or self._agent_report("the ranks failed")
                report_failure(cause)
                self._leave()
                return exit_code_for(cause["exitcode"]) if cause.get("exitcode") is not None else 1
            if self._late_cause is not None:
                report_failure(self._late_cause)
                self._leave()
                return exit_code_for(self._late_cause["exitcode"]) if self._late_cause.get("exitcode") else 1
            self._leave()
            return 0
        finally:
            if self._pid_file is not None:
                self._pid_file.unlink(missing_ok=True)
            self.release()
