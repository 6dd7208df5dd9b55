"""A real one-node Slurm cluster for the tests: Debian's ``slurm-wlm`` (``slurmctld`` + ``slurmd``) and ``munge``,
started on this machine from a generated ``slurm.conf`` in a temporary folder (docs/cluster.md, "Slurm in the
tests").

Everything lives in that folder: munge's key, socket, pid, seed and log files; the controller's state and the
node's spool; the daemons' logs. ``munged`` runs with its own socket (``AuthInfo=socket=...`` points Slurm's
``auth/munge`` and ``cred/munge`` at it), so a munge or Slurm the machine already runs is neither used nor
touched. ``slurmctld`` and ``slurmd`` run in the foreground (``-D``) as children of the test process; stopping
the cluster signals only the PIDs started here (and cancels the jobs first, so no job step outlives it).
The client commands (``sbatch``, ``srun``, ``sinfo``, ``scontrol``) find the cluster through ``SLURM_CONF``.

What Slurm needs in this container (a Firecracker VM, root, no systemd, no cgroup delegation): ``SlurmUser=root``,
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroup plugin, so no ``cgroup.conf``),
no accounting (``AccountingStorageType=accounting_storage/none``, ``JobAcctGatherType=jobacct_gather/none``; so
no ``sacct``), and the node named ``localhost`` (``slurmd -N localhost``, ``NodeAddr=127.0.0.1``) whatever the
VM's host name is. Ports are free ones, so two clusters (two test sessions) never meet.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

# the daemons and clients the cluster runs, and munge's: tests skip without them (tests/helpers.SYSTEM_PACKAGES)
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel", "squeue", "munged", "mungekey")
START_TIMEOUT_S = 60
# the xdist group of every test that uses the cluster (``pytest.mark.xdist_group(SLURM_GROUP)``): the session fixture
# runs once per worker, and a second cluster would give its jobs the same ids as the first's
SLURM_GROUP = "slurm"


@dataclass
class SlurmCluster:
    """A running one-node cluster: its folder, its ``slurm.conf`` and the environment its clients need."""

    folder: Path
    conf: Path
    cpus: int
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (the process's environment) with ``SLURM_CONF`` naming this cluster's config."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout, check=check)

    def node_state(self) -> str:
        done = self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False)
        return done.stdout.strip() if done.returncode == 0 else f"sinfo failed: {done.stderr.strip()}"

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait (bounded) until the node is idle: every job of an earlier test has left it."""
        deadline = time.monotonic() + timeout
        state = self.node_state()
        while state != "idle":
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}: {self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is not idle after {timeout:.0f} s (state: {state}); "
                                   f"slurmctld: {self.log_tail('slurmctld')}; slurmd: {self.log_tail('slurmd')}")
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
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
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


def write_conf(folder: Path, cpus: int) -> Path:
    """The smallest ``slurm.conf`` that runs batch jobs, arrays and ``srun`` steps on this machine."""
    ctld_port, slurmd_port = _free_port(), _free_port()
    while slurmd_port == ctld_port:
        slurmd_port = _free_port()
    lines = [
        "ClusterName=dsrun-tests",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also delays a requeued job's start (120 s by default)
        f"AuthInfo=socket={folder}/munge.socket,cred_expire=5",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd.log",
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
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
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


def start_cluster(folder: Path) -> SlurmCluster:
    """munged, slurmctld and slurmd on this machine, configured in ``folder``; returns once the node is idle.
    On a failure to start, what did start is stopped before the error is raised."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # munged refuses a key or socket folder others can write to
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    cpus = 2 * (os.cpu_count() or 1)
    cluster = SlurmCluster(folder, write_conf(folder, cpus), cpus)
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
        for name, argv in (("slurmctld", ["slurmctld", "-D", "-i"]), ("slurmd", ["slurmd", "-D", "-N", "localhost"])):
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
