"""``dsrun train -m hydra/launcher=submitit_slurm|submitit_local``: the two sides of a submitted sweep
(docs/cluster.md, "Slurm"; the launcher's settings and the Slurm side are :mod:`dsrun.launcher.slurm_jobs`).

Before Hydra starts (:func:`prepare_submission`): the launcher is installed and, for Slurm, reachable, or one line
says why not (exit code 2, nothing submitted); dsrun's settings of the launcher join the overrides.

In a job (:class:`JobPlace`): a task of a Slurm job's ``srun`` step is one rank of the run (every task checks the
recipe against the step, the ranks meet, rank 0 runs the job as ``dsrun train`` does under srun and hands its run
directory to the others: :mod:`dsrun.cli.outer_rank`); a local submitit job starts its ranks with dsrun's own
launcher. A job Slurm runs again after it was stopped resumes from its own run directory's checkpoint
(:func:`dsrun.cli.resume.settle_requeued`); a run stopped by the notice or by preemption raises
:class:`~dsrun.launcher.slurm_jobs.JobStopped` when the job may be requeued, for the launcher to requeue it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from dsrun.launcher.slurm_jobs import (LOCAL, SLURM, JobStopped, in_submitted_job, job_rank, launcher_choice,
                                       launcher_overrides, restarts, unreachable)
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
    itself); ``rank``: the rank this task of a Slurm job is; ``handoff``: rank 0's, once the ranks met."""

    executor: str | None
    rank: OuterRank | None = None
    handoff: RunHandoff | None = None

    @property
    def reports(self) -> bool:
        """Whether this process writes the submitted job's row: a submitted job's process, rank 0 of its ranks."""
        return self.executor is not None and (self.rank is None or self.rank.rank == 0)

    @classmethod
    def here(cls) -> JobPlace:
        executor = in_submitted_job()
        return cls(executor, job_rank() if executor else None)

    def meet(self) -> bool:
        """Meet the job's other ranks (after every rank checked the recipe against the step); True on rank 0,
        which goes on with the run."""
        from dsrun.cli.outer_rank import RunHandoff, join_world

        assert self.rank is not None
        join_world(self.rank)
        if self.rank.rank == 0:
            self.handoff = RunHandoff()
        return self.handoff is not None

    def close(self, error: str | None) -> None:
        """Rank 0: tell the others the job ended before its run when it did (``error``: why)."""
        if self.handoff is not None:
            self.handoff.close(RuntimeError(error) if error else None)

    def stopped(self, exit_code: int, max_requeues: int) -> str:
        """The run stopped on a signal with ``exit_code``: raise :class:`JobStopped` when Slurm may run the job
        again (it has been requeued fewer than ``max_requeues`` times); else the job's error text."""
        if self.executor == "slurm" and restarts() < max_requeues:
            raise JobStopped(exit_code)
        why = (f"hydra.launcher.max_num_timeout={max_requeues} requeues done" if self.executor == "slurm"
               else "a local submitit job is not requeued")
        return f"stopped (exit code {exit_code}); not requeued: {why}"


def follow_job_rank_zero(place: JobPlace, max_requeues: int) -> None:
    """A task other than rank 0: train as rank 0's run's rank; a run stopped on a signal stops the job (the
    launcher requeues it) as rank 0's does."""
    from dsrun.cli.outer_rank import follow_rank_zero
    from dsrun.launcher.protocol import EXIT_PREEMPTED, EXIT_STOPPED

    code = follow_rank_zero()
    if code in (EXIT_PREEMPTED, EXIT_STOPPED):
        place.stopped(code, max_requeues)
