"""The per-node agent: ``python -m dsrun.launcher.agent [FLAGS] TARGET [ARGS...]``.

One agent runs on every node of a job. It is a :class:`torch.distributed.elastic` ``LocalElasticAgent``
(the machinery behind ``torchrun``) with a static rendezvous at ``MASTER_ADDR:MASTER_PORT`` whose store is
hosted by node 0's agent and shared with the ranks (``TORCHELASTIC_USE_AGENT_STORE``). torch elastic spawns
the node's ranks, sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT``, writes per-rank logs, restarts the whole group on failure (``--max_restarts``) and stops
the ranks on a signal. dsrun adds what a multi-node job needs on top:

- **failure fan-out:** the agent that sees a rank fail publishes a report (rank, host, exit code, last log
  lines) in the store; every other agent checks the store each monitor tick (0.25 s) and stops its ranks,
  so one dead rank stops the whole job within seconds instead of leaving the rest hung in a collective;
- **liveness:** agents bump a heartbeat counter; an agent whose peer stops beating for
  ``--peer_timeout`` seconds (or that loses the store) stops its ranks too;
- **no orphans:** ranks start through :mod:`dsrun.launcher.rank_exec` and die with their agent; with
  ``--watch_stdin`` (the ssh runner) the agent stops everything when its ssh connection goes away;
- ``CROSS_RANK``/``CROSS_SIZE``/``LOCAL_SIZE``, ``--local_rank=N``, ``OMP_NUM_THREADS`` and core binding;
- **stop signals:** SIGINT, SIGTERM and SIGUSR1 (Slurm's ``--signal=USR1@N``; torch elastic alone would die of
  it) are passed on to the ranks as they came, which get ``--stop_grace`` seconds (default 30) to finish their
  step and save before they are killed; ranks that exit with 138 (preempted, checkpoint saved) are not
  restarted here: the job ends for the scheduler to requeue it.

The agent prints each failure as one line ``@@dsrun-failure@@ {json}`` on stderr for the launcher to
collect, and exits with the failed rank's exit code (128+signal for a rank killed by a signal).

With ``--elastic_training`` the agent is :class:`~dsrun.launcher.elastic_agent.ElasticNodeAgent` instead: a
dynamic rendezvous between ``--min_elastic_nodes`` and ``--max_elastic_nodes`` nodes, where a node leaving or
joining restarts the ranks at the new world size.
"""
from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from dsrun.launcher.protocol import STOP_SIGNALS, debug_requested, decode_world_info

MONITOR_INTERVAL = 0.25
SHUTDOWN_GRACE = 5  # seconds between SIGTERM and SIGKILL when stopping the ranks of a failed job
STOP_GRACE = 30  # ... when the agent was told to stop (Ctrl-C): time for a step, a checkpoint, the monitors
_ALSO_HANDLED = (signal.SIGHUP, signal.SIGQUIT)  # the rest of torch elastic's own list
_SCHEDULER_RANK_VARIABLES = ("SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def _cores_for_ranks(local_world_size: int, core_list: list[int] | None) -> list[list[int]]:
    from dsrun.launcher.core_binding import cores_for_ranks, describe

    try:
        groups = cores_for_ranks(local_world_size, core_list)
    except ValueError as err:
        raise SystemExit(f"dsrun: --bind_cores_to_rank: {err}") from None
    print(f"dsrun: binding cores on {os.environ.get('DSRUN_HOST', 'this node')}: {describe(groups)}", flush=True)
    return groups


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dsrun.launcher.agent",
                                     description="dsrun per-node agent (started by the launcher)")
    parser.add_argument("--world_info", required=True, help="base64 JSON {host: [slots]} in node order")
    parser.add_argument("--node_rank", type=int, default=-1,
                        help="this node's index; -1 reads it from SLURM_NODEID / OMPI_COMM_WORLD_RANK / PMI_RANK")
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--job_id", default="dsrun")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--max_restarts", type=int, default=0)
    parser.add_argument("--log_dir", default=None)
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list", default=None)
    parser.add_argument("--save_pid", type=int, default=0, help="launcher PID; write /tmp/dsrun-PID-nodeN.json")
    parser.add_argument("--watch_stdin", action="store_true", help="stop everything when stdin closes")
    parser.add_argument("--rdzv_timeout", type=int, default=300)
    parser.add_argument("--peer_timeout", type=float, default=30.0)
    parser.add_argument("--stop_grace", type=int, default=STOP_GRACE,
                        help="seconds the ranks have to stop after SIGINT/SIGTERM/SIGUSR1 before they are killed")
    parser.add_argument("--elastic_training", action="store_true", help="nodes may leave and join (c10d rendezvous)")
    parser.add_argument("--min_elastic_nodes", type=int, default=1)
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="-1: the nodes of --world_info")
    parser.add_argument("--rdzv_last_call_timeout", type=float, default=30.0,
                        help="seconds a round with enough nodes waits for more")
    parser.add_argument("--rdzv_keep_alive_interval", type=int, default=5,
                        help="seconds between this node's rendezvous heartbeats (3 missed: a node left)")
    parser.add_argument("target")
    parser.add_argument("target_args", nargs=argparse.REMAINDER)
    return parser


def _resolve_node_rank(requested: int, nnodes: int) -> int:
    node_rank = requested
    if node_rank < 0:
        for variable in _SCHEDULER_RANK_VARIABLES:
            if os.environ.get(variable, "").isdigit():
                node_rank = int(os.environ[variable])
                break
    if not 0 <= node_rank < nnodes:
        raise SystemExit(f"dsrun: node rank {node_rank} is outside 0..{nnodes - 1} "
                         f"(no --node_rank and none of {', '.join(_SCHEDULER_RANK_VARIABLES)} set)")
    return node_rank


def _worker_command(ns: argparse.Namespace) -> list[str]:
    if ns.no_python:
        command = [ns.target]
    elif ns.module:
        command = [sys.executable, "-u", "-m", ns.target]
    else:
        command = [sys.executable, "-u", ns.target]
    command += list(ns.target_args)
    if not ns.no_local_rank:
        command.append("--local_rank=${local_rank}")  # torch elastic substitutes the macro per rank
    return command


def _watch_stdin() -> Callable[[], None]:
    """Send ourselves SIGTERM when stdin closes (the ssh runner's connection went away); returns the function
    that ends the watch. The watching thread must be gone before the interpreter finalizes: the agent leaves no
    thread behind at exit (see :meth:`~dsrun.launcher.supervision.NodeAgent.release`)."""
    wake_read, wake_write = os.pipe()

    def wait_for_eof() -> None:
        # os.read on the raw descriptor: a thread blocked inside sys.stdin's buffered reader would hold its lock
        try:
            while True:
                ready, _, _ = select.select([0, wake_read], [], [])
                if wake_read in ready:
                    return
                if not os.read(0, 4096):
                    break
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=wait_for_eof, name="dsrun-stdin-watch", daemon=True)
    watcher.start()

    def stop() -> None:
        os.write(wake_write, b"x")
        watcher.join(timeout=5)
        os.close(wake_write)
        os.close(wake_read)

    return stop


def _quiet_torch_elastic() -> None:
    """torch elastic's warnings ("Received 2 death signal", "Sending process N closing signal SIGTERM") say
    in its words what the launcher reports in one line; they stay for ``--debug`` (``DSRUN_DEBUG=1``)."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    hosts = decode_world_info(ns.world_info)
    node_rank = _resolve_node_rank(ns.node_rank, len(hosts))
    stop_watching = _watch_stdin() if ns.watch_stdin else None
    try:
        return _run_node(ns, hosts, node_rank)
    finally:
        if stop_watching is not None:
            stop_watching()


def _run_node(ns: argparse.Namespace, hosts: dict[str, list[int]], node_rank: int) -> int:
    """Run this node's agent to its exit code. Everything it built (the rendezvous, the store, the agent) is
    released before this returns, so nothing of it reaches the interpreter's finalization."""
    host_names = list(hosts)
    nnodes = len(host_names)
    host = host_names[node_rank]
    slots = hosts[host]
    local_world_size = len(slots)
    os.environ.update(CROSS_RANK=str(node_rank), CROSS_SIZE=str(nnodes), LOCAL_SIZE=str(local_world_size),
                      DSRUN_JOB_ID=ns.job_id, DSRUN_HOST=host)
    core_groups: list[list[int]] = []
    if ns.bind_cores_to_rank:
        from dsrun.launcher.hostfile import parse_core_list

        core_list = parse_core_list(ns.bind_core_list) if ns.bind_core_list else None
        core_groups = _cores_for_ranks(local_world_size, core_list)
    elif "OMP_NUM_THREADS" not in os.environ:
        from dsrun.launcher.environment import default_omp_threads

        os.environ["OMP_NUM_THREADS"] = str(default_omp_threads(local_world_size))

    # the signals torch elastic's agent passes on to the ranks (its default list lacks SIGUSR1, which would kill it)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(sig.name for sig in (*STOP_SIGNALS, *_ALSO_HANDLED))

    # torch is imported only now: the checks above fail fast without paying for it.
    from dsrun.launcher.supervision import NodeAgent, RankLogs, build_spec

    import torch

    if not debug_requested():
        _quiet_torch_elastic()

    if torch.cuda.is_available():
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)

    temporary_logs = ns.log_dir is None
    log_dir = Path(ns.log_dir) if ns.log_dir else Path(tempfile.mkdtemp(prefix=f"dsrun-logs-node{node_rank}-"))
    rank_exec = [sys.executable, "-m", "dsrun.launcher.rank_exec"]
    if core_groups:
        # every rank gets all groups and picks its own by local rank (torch elastic substitutes the macro)
        rank_exec += ["--core_groups=" + "/".join(",".join(map(str, g)) for g in core_groups),
                      "--local_rank=${local_rank}"]
    if ns.elastic_training:
        from dsrun.launcher.elastic_agent import ElasticNodeAgent, build_elastic_spec

        spec = build_elastic_spec(
            rank_exec=rank_exec, command=_worker_command(ns), local_world_size=local_world_size,
            master_addr=ns.master_addr, master_port=ns.master_port, job_id=ns.job_id,
            local_addr=host.split("@", 1)[-1], is_host=node_rank == 0, min_nodes=ns.min_elastic_nodes,
            max_nodes=ns.max_elastic_nodes if ns.max_elastic_nodes > 0 else max(nnodes, ns.min_elastic_nodes),
            max_restarts=ns.max_restarts, rdzv_timeout=ns.rdzv_timeout, last_call_timeout=ns.rdzv_last_call_timeout,
            keep_alive_interval=ns.rdzv_keep_alive_interval, monitor_interval=MONITOR_INTERVAL)
        agent = ElasticNodeAgent(spec, RankLogs(str(log_dir)), host=host, host_names=host_names,
                                 node_rank=node_rank, save_pid=ns.save_pid, shutdown_grace=SHUTDOWN_GRACE,
                                 stop_grace=ns.stop_grace)
    else:
        spec = build_spec(
            rank_exec=rank_exec, command=_worker_command(ns), local_world_size=local_world_size,
            master_addr=ns.master_addr, master_port=ns.master_port, job_id=ns.job_id, node_rank=node_rank,
            nnodes=nnodes, max_restarts=ns.max_restarts, rdzv_timeout=ns.rdzv_timeout,
            monitor_interval=MONITOR_INTERVAL)
        agent = NodeAgent(spec, RankLogs(str(log_dir)), host=host, host_names=host_names, node_rank=node_rank,
                          save_pid=ns.save_pid, peer_timeout=ns.peer_timeout,
                          shutdown_grace=SHUTDOWN_GRACE, stop_grace=ns.stop_grace)
    code = agent.run_to_exit_code()
    if temporary_logs and code == 0:
        shutil.rmtree(log_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
