"""``dsrun train -m hydra/launcher=submitit_slurm|submitit_local``: the two sides of a submitted sweep
(docs/cluster.md, "Slurm"; the launcher's settings and the Slurm side are :mod:`dsrun.launcher.slurm_jobs`).

Before Hydra starts (:func:`prepare_submission`): the launcher is installed and, for Slurm, reachable, or one line
says why not (exit code 2, nothing submitted); dsrun's settings of the launcher join the overrides.

In a job (:class:`JobPlace`): a task of a Slurm job's ``srun`` step is one rank of the run (every task checks the
recipe against the step, the ranks meet on the store rank 0 opens once every task arrived,
:class:`~dsrun.launcher.slurm_jobs.TaskRendezvous`, rank 0 runs the job as ``dsrun train`` does under srun and hands
its run directory to the others: :mod:`dsrun.cli.outer_rank`; the tasks of ``dsrun export-job --target sbatch``'s
script meet the same way, :func:`meet_in_run_dir`); a task that stops before the ranks met says why to
the others, which leave with that one line instead of waiting; a local submitit job starts its ranks with dsrun's
own launcher. A job Slurm runs again after it was stopped resumes from its own run directory's checkpoint
(:func:`dsrun.cli.resume.settle_requeued`); a run stopped by the notice or by preemption raises
:class:`~dsrun.launcher.slurm_jobs.JobStopped` when the job may be requeued, for the launcher to requeue it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from dsrun.launcher.slurm_jobs import (LOCAL, SLURM, JobStopped, TaskRendezvous, TasksApart, in_submitted_job,
                                       job_rank, launcher_choice, launcher_overrides, restarts, unreachable)
from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dsrun.cli.outer_rank import RunHandoff
    from dsrun.launcher.outer import OuterRank


def prepare_submission(overrides: Sequence[str], first: DictConfig) -> list[str]:
    """The overrides a sweep runs with: ``overrides``, plus dsrun's settings of a submitit launcher they pick
    (``first``: the RunSpec of the sweep's first job). Raises :class:`UserError` when the launcher is not
    installed or Slurm is not reachable."""
    choice = launcher_choice(overrides)
    if choice not in (SLURM, LOCAL):
        return list(overrides)
    from hydra_plugins.dsrun_submitit import register_with_hydra

    if not register_with_hydra():
        raise UserError(Problem(f"hydra/launcher={choice}", "hydra-submitit-launcher is not installed",
                                "pip install 'dsrun[slurm]' (or pip install hydra-submitit-launcher)"))
    if choice == SLURM:
        problem = unreachable()
        if problem is not None:
            raise UserError(problem)
    launcher, train = first.launcher, first.train
    return [*overrides, *launcher_overrides(choice, overrides, int(launcher.num_procs), launcher.get("num_nodes"),
                                            float(train.preemption.grace_s))]


@dataclass
class JobPlace:
    """Where a sweep's job runs: ``executor`` ("slurm", "local": a submitted job; None: in ``dsrun train -m``
    itself); ``rank``: the rank this task of a Slurm job is, ``rendezvous`` where the job's tasks meet, ``met``
    once they did; ``handoff``: rank 0's, once the ranks met."""

    executor: str | None
    rank: OuterRank | None = None
    rendezvous: TaskRendezvous | None = None
    met: bool = False
    handoff: RunHandoff | None = None

    @property
    def reports(self) -> bool:
        """Whether this process writes the submitted job's row: a submitted job's process, rank 0 of its ranks."""
        return self.executor is not None and (self.rank is None or self.rank.rank == 0)

    @classmethod
    def here(cls, run_dir: Path) -> JobPlace:
        """This process's place; ``run_dir``: the job's run directory (every task of a Slurm job composes the
        same one), where the tasks meet."""
        executor = in_submitted_job()
        rank = job_rank() if executor else None
        rendezvous = TaskRendezvous.for_run(run_dir, rank.rank, rank.world_size) if rank is not None else None
        return cls(executor, rank, rendezvous)

    def meet(self) -> bool:
        """Meet the job's other ranks (after every rank checked the recipe against the step) on the store rank 0
        opens (:func:`meet_in_run_dir`); True on rank 0, which goes on with the run. Raises
        :class:`~dsrun.launcher.slurm_jobs.TasksApart` when a task stopped before or did not come in time."""
        from dsrun.cli.outer_rank import RunHandoff

        assert self.rank is not None and self.rendezvous is not None
        meet_in_run_dir(self.rank, self.rendezvous)
        self.met = True
        if self.rank.rank == 0:
            self.handoff = RunHandoff()
        return self.handoff is not None

    def close(self, error: str | None) -> None:
        """The job ended (``error``: why it failed, None when it did not). Rank 0: tell the others when it ended
        before its run; a task that stopped before the ranks met: tell the tasks waiting for it."""
        if self.handoff is not None:
            self.handoff.close(RuntimeError(error) if error else None)
        elif self.rendezvous is not None and not self.met:
            self.rendezvous.fail(error or "it ended before the ranks met")

    def stopped(self, exit_code: int, max_requeues: int) -> str:
        """The run stopped on a signal with ``exit_code``: raise :class:`JobStopped` when Slurm may run the job
        again (it has been requeued fewer than ``max_requeues`` times); else the job's error text."""
        if self.executor == "slurm" and restarts() < max_requeues:
            raise JobStopped(exit_code)
        why = (f"hydra.launcher.max_num_timeout={max_requeues} requeues done" if self.executor == "slurm"
               else "a local submitit job is not requeued")
        return f"stopped (exit code {exit_code}); not requeued: {why}"


def meet_in_run_dir(rank: OuterRank, rendezvous: TaskRendezvous) -> None:
    """Join the world of the srun tasks that meet through ``rendezvous`` (a submitted sweep's job, ``dsrun export-job
    --target sbatch``'s script): rank 0's store listens on a port the system gives it, which rank 0 writes in the
    run directory once every task arrived; the others read it and connect. Raises
    :class:`~dsrun.launcher.slurm_jobs.TasksApart` when a task stopped before or did not come in time."""
    from dsrun.cli.outer_rank import join_world
    from dsrun.comm.comm import rendezvous_store

    rendezvous.arrive()
    limit = timedelta(seconds=rendezvous.timeout_s)
    host = rank.master_addr or "127.0.0.1"
    if rank.rank == 0:  # its store listens before the others hear of its port
        store = rendezvous_store(host, 0, rank.world_size, True, limit)
        rendezvous.open_port(store.port)
    else:
        port = rendezvous.port()
        try:
            store = rendezvous_store(host, port, rank.world_size, False, limit)
        except Exception as err:  # noqa: BLE001 - torch's connect errors differ by version; all mean the same
            first_line = (str(err).splitlines() or [""])[0].strip()
            raise TasksApart(f"rank {rank.rank} of {rank.world_size}: rank 0's store at {host}:{port} did not "
                             f"answer within {rendezvous.timeout_s:g} s ({first_line})") from err
    join_world(replace(rank, master_port=store.port), store)


def follow_job_rank_zero(place: JobPlace, max_requeues: int) -> None:
    """A task other than rank 0: train as rank 0's run's rank; a run stopped on a signal stops the job (the
    launcher requeues it) as rank 0's does."""
    from dsrun.cli.outer_rank import follow_rank_zero
    from dsrun.launcher.protocol import EXIT_PREEMPTED, EXIT_STOPPED

    code = follow_rank_zero()
    if code in (EXIT_PREEMPTED, EXIT_STOPPED):
        place.stopped(code, max_requeues)
