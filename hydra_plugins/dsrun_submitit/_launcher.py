"""hydra-submitit-launcher's Slurm and local launchers as ``dsrun train -m`` runs them (docs/cluster.md, "Slurm").

Submitting (``launch``, in ``dsrun train -m``): the Slurm parameters get dsrun's additions
(:func:`dsrun.launcher.slurm_jobs.batch_settings`: the notice as SIGUSR1 ``signal_delay_s`` before the time limit,
``--requeue``); the sweep's jobs go out as one array (submitit's ``map_array``); once they are all
done, each job's result (its run directory's ``job.json``, which also says what a failed job raised) goes to
``dsrun train -m``'s summary table.

In the job (``__call__``): Hydra composes the job's config and runs dsrun's task. When its run stops on the notice
or on preemption's SIGTERM (the ranks saved at a step boundary: exit code 138; or could not: 143), the task raises
:class:`~dsrun.launcher.slurm_jobs.JobStopped`; rank 0 then requeues the job (``scontrol requeue``, at most
``hydra.launcher.max_num_timeout`` times as Slurm counts them, ``SLURM_RESTART_COUNT``) and every task exits with
that code and no result, so submitit keeps waiting for the requeued job, whose run resumes from its checkpoint. A
notice that comes before the ranks started is submitit's own to handle (``SUBMITIT_PREEMPT_SIGNAL=USR1``:
it requeues the job through this launcher's ``checkpoint``, the same call again).
"""
from __future__ import annotations

import gc
import sys
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

from dsrun.launcher.slurm_jobs import JobStopped, batch_settings, requeue, restarts, slurm_job_id


class _DsrunJobs:
    """What dsrun adds to a submitit launcher, on either side of the submission."""

    _EXECUTOR: str
    params: dict

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from dsrun.cli.multirun import record_submitted_jobs

        if self._EXECUTOR == "slurm":
            self.params = batch_settings(self.params)
        returns = super().launch(job_overrides, initial_job_idx)  # type: ignore[misc]
        record_submitted_jobs(returns)
        for ret in returns:
            if ret.status is JobStatus.FAILED:
                # what the job raised is in its row (job.json, read above): a failed job in the table, as for a
                # job run in this process, not a traceback of Hydra's sweeper
                ret.status, ret.return_value = JobStatus.COMPLETED, None
        return returns

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        except JobStopped as stopped:
            if self._EXECUTOR == "slurm":
                self._requeue(stopped.exit_code)
            sys.stdout.flush()
            sys.exit(stopped.exit_code)
        finally:
            # the job's work is done: what is left (submitit's result file, the exit) needs none of the objects
            # torch, Hydra and the run made, and the interpreter's last garbage collection over all of them took
            # 10 s and more of CPU per task on a busy machine (the node stays taken until the tasks end)
            gc.freeze()

    def _requeue(self, exit_code: int) -> None:
        """Rank 0 puts the job back in the queue (the ranks have saved); the others only leave."""
        import os

        if os.environ.get("SLURM_PROCID", "0") != "0":
            return
        allowed, done = int(self.params.get("max_num_timeout") or 0), restarts()
        job = slurm_job_id()
        if done >= allowed:
            print(f"[dsrun] job {job} stopped (exit code {exit_code}); not requeued: it ran {done + 1} time(s), "
                  f"hydra.launcher.max_num_timeout={allowed} requeues allowed", flush=True)
            return
        why_not = requeue(job)
        print(f"[dsrun] job {job} stopped (exit code {exit_code}); " + (
            f"requeued ({done + 1} of {allowed}): the run resumes from its checkpoint" if why_not is None
            else f"scontrol requeue failed: {why_not}"), flush=True)


class DsrunSlurmLauncher(_DsrunJobs, SlurmLauncher):
    """``hydra/launcher=submitit_slurm`` under ``dsrun train -m``: every job a Slurm job, every rank an ``srun``
    task."""


class DsrunLocalLauncher(_DsrunJobs, LocalLauncher):
    """``hydra/launcher=submitit_local`` under ``dsrun train -m``: every job a process of submitit's, dsrun's own
    launcher starting its ranks."""

