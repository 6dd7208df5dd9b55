"""``dsrun train -m hydra/launcher=submitit_slurm|submitit_local``: each job of a Hydra sweep as a Slurm job (an
array for a sweep) or a local submitit job, through hydra-submitit-launcher (docs/cluster.md, "Slurm").

The submitting side (``dsrun train -m``, before Hydra starts): :func:`launcher_choice` reads which launcher the
overrides pick, :func:`unreachable` says in one line why Slurm cannot take jobs from here (no ``sbatch`` on
``PATH``, no controller answering), and :func:`launcher_overrides` adds dsrun's settings of the launcher to the
user's own (which win): dsrun's launcher classes (``hydra_plugins.dsrun_submitit``), and for Slurm one task per
rank (``tasks_per_node`` = ``launcher.num_procs``, ``nodes`` = ``launcher.num_nodes``), the preemption notice
``train.preemption.grace_s`` + :data:`NOTICE_MARGIN_S` before the time limit, and :data:`DEFAULT_REQUEUES`
requeues.

The job side (the submitted function, in the job): :func:`job_rank` is the rank an ``srun`` task of the job is
(:mod:`dsrun.launcher.outer`'s contract: every task of the step becomes one rank of ``dsrun train``); the tasks of
one run of the job meet through :class:`TaskRendezvous` (rank 0 opens the port the ranks meet on once every task
arrived; a task that stops before says why, and the others leave with that line); a run stopped by the notice (or
by preemption's SIGTERM) raises :class:`JobStopped`, and :func:`requeue` puts the job back in the queue once the
ranks saved, as ``dsrun export-job --target sbatch``'s script does (``scontrol requeue``). That script's tasks meet
the same way (:func:`batch_rendezvous`): its batch shell fixes the run directory (:data:`RUN_DIR_VARIABLE`) for
every task before ``srun`` starts them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from dsrun.launcher.outer import SYSTEM_PORT, OuterRank, detect_outer_launcher
from dsrun.utils.errors import Problem

SLURM, LOCAL = "submitit_slurm", "submitit_local"
LAUNCHER_GROUP = "hydra/launcher"
# dsrun's subclasses of hydra-submitit-launcher's launchers (they requeue a stopped job, collect the jobs' results)
LAUNCHER_CLASSES = {SLURM: "hydra_plugins.dsrun_submitit._launcher.DsrunSlurmLauncher",
                    LOCAL: "hydra_plugins.dsrun_submitit._launcher.DsrunLocalLauncher"}
# seconds between the notice (Slurm's --signal) and the time limit beyond the ranks' own grace period: a step to
# finish, the save, the job's exit (dsrun export-job's sbatch script keeps the same margin)
NOTICE_MARGIN_S = 30
# how many times a job stopped by the notice or by preemption is requeued (hydra.launcher.max_num_timeout)
DEFAULT_REQUEUES = 3
# the signal Slurm sends as the notice: the one dsrun's ranks save on (SIGUSR1), not submitit's default SIGUSR2;
# submitit reads the same name in the job (SUBMITIT_PREEMPT_SIGNAL), so a notice that comes before the ranks
# started requeues the job through submitit's own handler
NOTICE_SIGNAL = "USR1"
PING_TIMEOUT_S = 15
# how long the tasks of a job's run wait for each other before the ranks meet (every task imports torch and composes
# the recipe first: tens of seconds on a busy node); past it a task stops with one line naming the missing one
RENDEZVOUS_TIMEOUT_S = 300.0
RENDEZVOUS_DIR = ".slurm_rendezvous"  # in the run directory, which every task of the job shares
# dsrun export-job --target sbatch: the run directory its batch shell chose for this run of the job, which every srun
# task's dsrun train runs in (hydra.run.dir) and meets the others in
RUN_DIR_VARIABLE = "DSRUN_RUN_DIR"


class JobStopped(BaseException):
    """The run of a submitted job stopped on a signal (the time-limit notice, preemption): ``exit_code`` 138 when
    the ranks saved where they stopped, 143 when not. A BaseException, so that Hydra's job runner does not record
    it as the job's failure: the job is requeued, or ends with that code."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"stopped, exit code {exit_code}")
        self.exit_code = exit_code


def launcher_choice(overrides: Sequence[str]) -> str | None:
    """The ``hydra/launcher=NAME`` the overrides pick (the last one), or None."""
    choice = None
    for text in overrides:
        key, sep, value = text.lstrip("+").partition("=")
        if sep and key == LAUNCHER_GROUP:
            choice = value.strip()
    return choice


def _user_keys(overrides: Sequence[str]) -> set[str]:
    return {text.lstrip("+~").partition("=")[0] for text in overrides}


def unreachable(environ: Mapping[str, str] | None = None, where: str = f"hydra/launcher={SLURM}",
                local: str = f"or run the jobs on this machine with hydra/launcher={LOCAL}",
                clients: Sequence[str] = ("sbatch", "scontrol")) -> Problem | None:
    """Why no Slurm job can be started from here, in one problem naming ``where`` (what asked for Slurm) and
    ``local`` (how to do without); None when the ``clients`` are on ``PATH`` and the controller answers
    ``scontrol ping``."""
    environ = os.environ if environ is None else environ
    path = environ.get("PATH", os.defpath)
    missing = [name for name in clients if shutil.which(name, path=path) is None]
    if missing:
        return Problem(where, f"Slurm is not reachable: {' and '.join(missing)} not found on PATH",
                       f"run dsrun on a Slurm login node (Debian: apt-get install slurm-client) {local}")
    try:
        done = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=PING_TIMEOUT_S,
                              env=dict(environ), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Problem(where, f"Slurm is not reachable: scontrol ping did not answer within {PING_TIMEOUT_S} s",
                       f"check that slurmctld runs and SLURM_CONF names its slurm.conf, {local}")
    if done.returncode != 0 or " is UP" not in done.stdout:
        # scontrol's verdict on the controller ("Slurmctld(primary) at HOST is DOWN"), else its last error
        verdicts = [line.strip() for line in done.stdout.splitlines() if line.startswith("Slurmctld")]
        errors = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        text = (verdicts or errors[-1:] or [f"exit code {done.returncode}"])[0]
        conf = environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
        return Problem(where, f"Slurm is not reachable: scontrol ping says {text!r}",
                       f"start slurmctld or point SLURM_CONF (now {conf}) at your cluster's slurm.conf, {local}")
    return None


def launcher_overrides(choice: str, overrides: Sequence[str], num_procs: int, num_nodes: int | None,
                       grace_s: float) -> list[str]:
    """dsrun's settings of the submitit launcher ``choice`` as Hydra overrides, leaving out each key the user set
    in ``overrides``. ``num_procs``, ``num_nodes``, ``grace_s``: the recipe's ``launcher.num_procs``,
    ``launcher.num_nodes`` and ``train.preemption.grace_s`` (of the sweep's first job: one executor submits every
    job of a sweep with the same resources)."""
    mine = {"hydra.launcher._target_": LAUNCHER_CLASSES[choice]}
    if choice == SLURM:
        mine.update({"hydra.launcher.tasks_per_node": str(num_procs), "hydra.launcher.nodes": str(num_nodes or 1),
                     "hydra.launcher.signal_delay_s": str(int(-(-grace_s // 1)) + NOTICE_MARGIN_S),
                     "hydra.launcher.max_num_timeout": str(DEFAULT_REQUEUES)})
    given = _user_keys(overrides)
    return [f"{key}={value}" for key, value in mine.items() if key not in given]


def batch_settings(params: dict) -> dict:
    """hydra-submitit-launcher's Slurm parameters with dsrun's additions: the notice as SIGUSR1 (``--signal``,
    ``signal_delay_s`` before the time limit), ``--requeue``, logs opened for appending (``--open-mode=append``, on
    sbatch and on srun: a requeued job's run writes after its first run's lines, which Slurm's default would
    truncate), and submitit's notice signal before the user's ``setup`` lines (no ``MASTER_PORT``: the ranks meet
    where rank 0 says, :class:`TaskRendezvous`). The user's own ``additional_parameters`` and ``srun_args`` win."""
    params = dict(params)
    extra = dict(params.get("additional_parameters") or {})
    extra.setdefault("signal", f"{NOTICE_SIGNAL}@{params.get('signal_delay_s', 120)}")
    extra.setdefault("requeue", True)
    extra.setdefault("open_mode", "append")
    params["additional_parameters"] = extra
    srun = list(params.get("srun_args") or [])
    if not any(arg.startswith("--open-mode") for arg in srun):
        srun.append(f"--open-mode={extra['open_mode']}")
    params["srun_args"] = srun
    params["setup"] = [f"export SUBMITIT_PREEMPT_SIGNAL={NOTICE_SIGNAL}", *(params.get("setup") or [])]
    return params


def in_submitted_job(environ: Mapping[str, str] | None = None) -> str | None:
    """``"slurm"`` or ``"local"`` in a job submitit started (its ``SUBMITIT_EXECUTOR``), else None."""
    environ = os.environ if environ is None else environ
    return environ.get("SUBMITIT_EXECUTOR") or None


def job_rank(environ: Mapping[str, str] | None = None) -> OuterRank | None:
    """The rank this task of a submitted Slurm job is (every ``srun`` task of the step one rank); None outside
    one, and in a local submitit job (dsrun's own launcher starts the ranks there)."""
    environ = os.environ if environ is None else environ
    rank = detect_outer_launcher(environ) if in_submitted_job(environ) == "slurm" else None
    return replace(rank, master_port=SYSTEM_PORT) if rank is not None else None  # TaskRendezvous gives the port


def batch_rendezvous(outer: OuterRank | None, environ: Mapping[str, str] | None = None) -> TaskRendezvous | None:
    """Where the ``srun`` tasks of ``dsrun export-job --target sbatch``'s script meet: the run directory its batch
    shell fixed (:data:`RUN_DIR_VARIABLE`), as a submitted sweep's jobs do; None for any other rank, and when
    ``MASTER_PORT`` names the port (the recipe's ``launcher.master_port``, which the script then exports)."""
    environ = os.environ if environ is None else environ
    if outer is None or outer.launcher != "srun" or not environ.get(RUN_DIR_VARIABLE) or environ.get("MASTER_PORT"):
        return None
    return TaskRendezvous.for_run(Path(environ[RUN_DIR_VARIABLE]), outer.rank, outer.world_size, environ)


def restarts(environ: Mapping[str, str] | None = None) -> int:
    """How many times Slurm has requeued this job (``SLURM_RESTART_COUNT``)."""
    value = (os.environ if environ is None else environ).get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str:
    """This job's id as ``scontrol`` names it: ``ARRAY_TASK`` for a task of an array, else the job's own."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ["SLURM_JOB_ID"]


def requeue(job_id: str) -> str | None:
    """``scontrol requeue JOB``: the job goes back in the queue and runs again from its start (the run resumes
    from its checkpoint). Returns why it could not (None: requeued)."""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return None if done.returncode == 0 else " ".join(done.stderr.split()) or f"exit code {done.returncode}"


class TasksApart(Exception):
    """The tasks of a submitted job's run did not meet: the message is the one line that says which and why."""


@dataclass(frozen=True)
class TaskRendezvous:
    """How the ``srun`` tasks of one run of a submitted job meet, through files in the run directory they share:
    each task says it arrived (or, stopping before the ranks met, why); rank 0 waits for every task, then gives
    them the port of the store it listens on, one the system gave it as it bound (a port derived from the job's id
    may be held on the node by anything else: another job, another cluster's job of the same id), and the others
    wait for it. Every wait is
    bounded (``timeout_s``) and ends early when a task says it stopped: no task waits for one that is gone. The
    folder is the run's own (the job's id and step, and ``SLURM_RESTART_COUNT``): a requeued job's run never reads
    its first run's files."""

    folder: Path
    rank: int
    world_size: int
    timeout_s: float = RENDEZVOUS_TIMEOUT_S
    poll_s: float = 0.2

    @classmethod
    def for_run(cls, run_dir: Path, rank: int, world_size: int,
                environ: Mapping[str, str] | None = None) -> TaskRendezvous:
        environ = os.environ if environ is None else environ
        name = (f"job{environ.get('SLURM_JOB_ID', '0')}.{environ.get('SLURM_STEP_ID', '0')}"
                f"-run{restarts(environ)}")
        return cls(run_dir / RENDEZVOUS_DIR / name, rank, world_size)

    def _write(self, name: str, text: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.folder / f".{name}.{os.getpid()}"
        temporary.write_text(text)
        os.replace(temporary, self.folder / name)  # a reader sees all of it or nothing

    def arrive(self) -> None:
        self._write(f"rank{self.rank}.arrived", "")

    def fail(self, why: str) -> None:
        """This task stops before the ranks met: ``why`` goes to the tasks that wait for it."""
        self._write(f"rank{self.rank}.failed", " ".join(why.split()) or "it stopped")

    def _failure(self) -> str | None:
        for path in sorted(self.folder.glob("rank*.failed")):
            rank = path.name[len("rank"):-len(".failed")]
            if rank != str(self.rank):
                return f"rank {rank} stopped before the ranks met: {path.read_text(errors='replace')}"
        return None

    def _wait(self, ready: Callable[[], bool], waiting_for: Callable[[], str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            failure = self._failure()
            if failure is not None:
                raise TasksApart(f"rank {self.rank} of {self.world_size}: {failure}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise TasksApart(f"rank {self.rank} of {self.world_size}: {waiting_for()} within "
                                 f"{self.timeout_s:g} s (the tasks' output: the job's folder in .submitit/ of "
                                 "the sweep directory)")
            time.sleep(self.poll_s)

    def open_port(self, port: int) -> None:
        """Rank 0: wait for every task, then give them ``port`` (its store's, listening already)."""
        def missing() -> list[int]:
            return [rank for rank in range(self.world_size)
                    if not (self.folder / f"rank{rank}.arrived").exists()]

        self._wait(lambda: not missing(),
                   lambda: f"rank(s) {', '.join(map(str, missing()))} did not reach the rendezvous")
        self._write("port", str(port))

    def port(self) -> int:
        """A rank other than 0: the port rank 0 opened."""
        path = self.folder / "port"
        self._wait(path.exists, lambda: "rank 0 did not open the port the ranks meet on")
        return int(path.read_text())


@dataclass(frozen=True)
class SrunTrials:
    """``dsrun tune --slurm``: every trial's ``dsrun train`` a Slurm job of its own, ``srun`` (outside any
    allocation: it asks for one and waits) starting one task per rank, ``procs_per_node`` on each of ``nodes``,
    each task becoming that rank through the outer-launcher contract; ``srun_args``: the user's own options
    (``--partition=gpu --time=20``)."""

    nodes: int
    procs_per_node: int
    srun_args: tuple[str, ...] = ()

    def wrap(self, command: Sequence[str], name: str) -> tuple[list[str], dict[str, str]]:
        """(the trial's command under ``srun``, its environment): the ranks meet at the port the trial names
        (``launcher.master_port=P``, which must then agree with the srun step's ``MASTER_PORT``)."""
        port = next((arg.split("=", 1)[1] for arg in command if arg.startswith("launcher.master_port=")), None)
        argv = ["srun", f"--job-name={name}", f"--nodes={self.nodes}", f"--ntasks-per-node={self.procs_per_node}",
                "--kill-on-bad-exit=1", *self.srun_args, *command]
        return argv, ({"MASTER_PORT": port} if port else {})
