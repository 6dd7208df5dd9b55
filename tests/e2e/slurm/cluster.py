"""A real Slurm cluster for the tests: Debian's ``slurm-wlm`` (``slurmctld`` + ``slurmd``) and ``munge``, started on
this machine from a generated ``slurm.conf`` in a temporary folder (docs/cluster.md, "Slurm in the tests"): one
node, this machine, or several, each a :class:`Node` that runs its ``slurmd`` as a machine of its own (a network
namespace with its own address, host name and ``/etc/hosts``: tests/namespaces.py), the controller on the first.

Everything lives in that folder: munge's key, socket, pid, seed and log files; the controller's state and the
node's spool; the daemons' logs. ``munged`` runs with its own socket (``AuthInfo=socket=...`` points Slurm's
``auth/munge`` and ``cred/munge`` at it), so a munge or Slurm the machine already runs is neither used nor
touched (a unix socket: the nodes' network namespaces reach it too). ``slurmctld`` and each ``slurmd`` run in the
foreground (``-D``) as children of the test process; stopping the cluster signals only the PIDs started here (and
cancels the jobs first, so no job step outlives it). The client commands (``sbatch``, ``srun``, ``sinfo``,
``scontrol``) find the cluster through ``SLURM_CONF``, run where the controller runs (:meth:`SlurmCluster.client`).
Each ``slurmd`` has its own spool folder, pid file and log (``%n`` in ``slurm.conf``: the node's name), so two
of them run on one machine.

What Slurm needs in this container (a Firecracker VM, root, no systemd, no cgroup delegation): ``SlurmUser=root``,
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroup plugin, so no ``cgroup.conf``),
no accounting (``AccountingStorageType=accounting_storage/none``, ``JobAcctGatherType=jobacct_gather/none``; so
no ``sacct``), and the one-node cluster's node named ``localhost`` (``slurmd -N localhost``, ``NodeAddr=127.0.0.1``)
whatever the VM's host name is (``SlurmctldHost=localhost`` is always this machine's). Ports are free ones, so two
clusters (two test sessions) never meet.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

# the daemons and clients the cluster runs, and munge's: tests skip without them (tests/helpers.SYSTEM_PACKAGES)
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel", "squeue", "munged", "mungekey")
START_TIMEOUT_S = 60
# the xdist group of every test that uses the cluster (``pytest.mark.xdist_group(SLURM_GROUP)``): the session fixture
# runs once per worker, and a second cluster would give its jobs the same ids as the first's
SLURM_GROUP = "slurm"


@dataclass(frozen=True)
class Node:
    """A node of the cluster: its ``NodeName`` and ``NodeAddr``, and the prefix that runs a command on it (empty:
    this machine as it is; a network-namespace machine's: tests/namespaces.py's ``Host.machine``)."""

    name: str
    address: str
    on_node: tuple[str, ...] = ()

    def argv(self, *argv: str) -> list[str]:
        return [*self.on_node, *argv]


LOCAL_NODE = Node("localhost", "127.0.0.1")


@dataclass
class SlurmCluster:
    """A running cluster: its folder, its ``slurm.conf``, its nodes (the controller on the first) and the
    environment its clients need."""

    folder: Path
    conf: Path
    cpus: int  # each node's
    nodes: tuple[Node, ...] = (LOCAL_NODE,)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (the process's environment) with ``SLURM_CONF`` naming this cluster's config."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def client(self, *argv: str) -> list[str]:
        """``argv`` (a Slurm client command, or one that runs them) where the controller runs: the first node."""
        return self.nodes[0].argv(*argv)

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(self.client(*argv), env=self.env(), capture_output=True, text=True, timeout=timeout,
                              check=check)

    def node_state(self) -> str:
        """Every node's state, one per line (``idle``)."""
        done = self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False)
        return done.stdout.strip() if done.returncode == 0 else f"sinfo failed: {done.stderr.strip()}"

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait (bounded) until every node is idle: every job of an earlier test has left it."""
        deadline = time.monotonic() + timeout
        state = self.node_state()
        while state.split() != ["idle"] * len(self.nodes):
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}: {self.log_tail(name)}")
            if time.monotonic() > deadline:
                logs = "; ".join(f"{name}: {self.log_tail(name)}" for name in self.processes if name != "munged")
                raise RuntimeError(f"the nodes are not idle after {timeout:.0f} s (state: {state!r}); {logs}")
            time.sleep(0.3)
            state = self.node_state()

    def log_tail(self, name: str, lines: int = 8) -> str:
        path = self.folder / f"{name}.log"
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this cluster started (by PID: munged last, the clients of
        the others need it until they are gone)."""
        if self.processes.get("slurmctld") is not None and self.processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", "root", check=False)
            deadline = time.monotonic() + 15
            while self.run("squeue", "--noheader", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.3)
        for name in reversed(list(self.processes)):  # the reverse of their start: each slurmd, slurmctld, munged
            process = self.processes[name]
            if process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def _free_port() -> int:
    from tests.helpers import free_port

    return free_port()


def write_conf(folder: Path, cpus: int, nodes: Sequence[Node] = (LOCAL_NODE,)) -> Path:
    """The smallest ``slurm.conf`` that runs batch jobs, arrays and ``srun`` steps on ``nodes`` (``cpus`` each),
    the controller on the first."""
    ctld_port, slurmd_port = _free_port(), _free_port()
    while slurmd_port == ctld_port:
        slurmd_port = _free_port()
    lines = [
        "ClusterName=dsrun-tests",
        f"SlurmctldHost={nodes[0].name}({nodes[0].address})",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also delays a requeued job's start (120 s by default)
        f"AuthInfo=socket={folder}/munge.socket,cred_expire=5",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={folder}/state",
        # each node's slurmd its own (%n: the node's name): two slurmds on one machine never share one
        f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",  # a requeued job starts within seconds of its begin time
        "ReturnToService=2",
        "SlurmctldTimeout=10",
        "SlurmdTimeout=10",
        "InactiveLimit=0",
        "KillWait=10",
        "MinJobAge=300",
        "MessageTimeout=10",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # the node's CPUs as this file says, not as slurmd counts them: CPUs is twice the machine's cores, so the two
        # 2-task jobs of a sweep's array run side by side (a job's ranks wait on each other, and on Slurm, for much of
        # its time) instead of one after the other
        "SlurmdParameters=config_overrides",
        *(f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus} RealMemory=1000 State=UNKNOWN" for node in nodes),
        f"PartitionName=debug Nodes={','.join(node.name for node in nodes)} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]
    conf = folder / "slurm.conf"
    conf.write_text("\n".join(lines))
    return conf


def _wait_for(path: Path, process: subprocess.Popen, name: str, folder: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            log = folder / f"{name}.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
            raise RuntimeError(f"{name} did not start (exit {process.poll()}): {tail}")
        time.sleep(0.1)


def start_cluster(folder: Path, nodes: Sequence[Node] = (LOCAL_NODE,), cpus: int | None = None) -> SlurmCluster:
    """munged on this machine, slurmctld on the first of ``nodes`` and a slurmd on each, configured in ``folder``,
    each node with ``cpus`` CPUs (default: twice this machine's cores); returns once every node is idle. On a
    failure to start, what did start is stopped before the error is raised."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # munged refuses a key or socket folder others can write to
    for sub in ("state", *(f"spool/{node.name}" for node in nodes)):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    cpus = cpus or 2 * (os.cpu_count() or 1)
    cluster = SlurmCluster(folder, write_conf(folder, cpus, nodes), cpus, tuple(nodes))
    devnull = subprocess.DEVNULL
    try:
        key = folder / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=30)
        os.chmod(key, 0o600)
        socket = folder / "munge.socket"
        cluster.processes["munged"] = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={socket}", f"--key-file={key}",
             f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed",
             f"--log-file={folder}/munged.log"], stdin=devnull, stdout=devnull, stderr=devnull,
            start_new_session=True)
        _wait_for(socket, cluster.processes["munged"], "munged", folder)
        env = cluster.env()
        daemons = [("slurmctld", nodes[0].argv("slurmctld", "-D", "-i")),
                   *((f"slurmd-{node.name}", node.argv("slurmd", "-D", "-N", node.name)) for node in nodes)]
        for name, argv in daemons:  # each prefix execs the daemon: the PID is the daemon's
            with open(folder / f"{name}.out", "wb") as out:
                cluster.processes[name] = subprocess.Popen(argv, env=env, stdin=devnull, stdout=out,
                                                           stderr=subprocess.STDOUT, start_new_session=True)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None]
