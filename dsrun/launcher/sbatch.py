"""A Slurm batch script that runs a :class:`~dsrun.launcher.cluster_job.ClusterJob`: ``srun`` starts one task per
rank and each task's ``dsrun train`` becomes that rank (:mod:`dsrun.launcher.outer` reads ``SLURM_PROCID``,
``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE``, ... and meets at the step's first node). docs/kubernetes.md.

The ranks meet as the ``srun`` tasks of a ``hydra/launcher=submitit_slurm`` job do
(:class:`~dsrun.launcher.slurm_jobs.TaskRendezvous`): the batch shell fixes this run's directory
(``DSRUN_RUN_DIR``, time-stamped as Hydra's, under ``--runs-dir``) before ``srun`` starts the tasks, every task's
``dsrun train`` runs in it (``hydra.run.dir``), and in its ``.slurm_rendezvous/`` rank 0 tells the others the port
its store was given by the system as it bound: no port derived from the job id, which another job on the node may
hold. A recipe's ``launcher.master_port`` is exported as ``MASTER_PORT`` instead, and the ranks meet there.

Preemption and the time limit: ``--signal=B:USR1@S`` tells the batch shell S seconds before the time limit (S: the
ranks' ``train.preemption.grace_s`` plus 30, so a step and a save fit before Slurm kills the job);
its trap sends SIGTERM to the step (srun hands it to every task: each rank stops at a step boundary and saves a
checkpoint), waits for it, and requeues the job (``--requeue``; a job preempted
with Slurm's ``PreemptMode=REQUEUE`` is requeued by Slurm itself). The requeued job runs the same script, and
``train.resume=auto`` resumes from the newest checkpoint of the same recipe and overrides.
"""
from __future__ import annotations

import shlex

from dsrun.launcher.cluster_job import RESUME_OVERRIDE, SIGNAL_MARGIN_S, ClusterJob
from dsrun.launcher.slurm_jobs import RENDEZVOUS_DIR, RUN_DIR_VARIABLE

# Hydra's run directory name (outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}) as the batch shell's date writes it
RUN_DIR_DATE = "$(date +%Y-%m-%d/%H-%M-%S)"


def signal_lead_s(job: ClusterJob) -> int:
    """Seconds before the time limit that the batch shell is told (``--signal=B:USR1@...``): the ranks' grace
    period, the shell's own margin and srun's."""
    return job.rank_grace_s + 3 * SIGNAL_MARGIN_S


def batch_script(job: ClusterJob) -> str:
    """The ``sbatch`` script of ``job``: ``#SBATCH`` lines for its world and resources, then ``srun``."""
    res = job.resources
    options = [f"--job-name={job.name}", f"--nodes={job.nodes}", f"--ntasks-per-node={job.procs_per_node}",
               *([f"--cpus-per-task={res.cpus}"] if res.cpus else []),
               *([f"--mem={res.memory}"] if res.memory else []),
               *([f"--gpus-per-node={res.gpus}"] if res.gpus else []),
               *([f"--time={job.time}"] if job.time else []),
               *([f"--partition={job.partition}"] if job.partition else []),
               f"--signal=B:USR1@{signal_lead_s(job)}", "--requeue", "--open-mode=append",
               "--output=%x-%j.out"]
    argv = [arg for arg in job.rank_argv() if arg != RESUME_OVERRIDE]
    # the run directory the batch shell chose, expanded by it (double quotes): every task's, and their meeting place
    rank = " ".join([*(shlex.quote(arg) for arg in argv), f'"hydra.run.dir=${RUN_DIR_VARIABLE}"', RESUME_OVERRIDE])
    runs = f"{job.runs_dir.rstrip('/')}/outputs" if job.runs_dir else "outputs"
    store = job.mlflow_store()
    mlflow = (["# the local MLflow store beside the run directories, unless you name one",
               f"export MLFLOW_TRACKING_URI=${{MLFLOW_TRACKING_URI:-{shlex.quote(store)}}}", ""] if store else [])
    lines = [
        "#!/bin/bash",
        f"# written by dsrun export-job: {job.world_size} rank(s), {job.procs_per_node} per node on {job.nodes} "
        "node(s); each srun task becomes one rank of dsrun train",
        *(f"#SBATCH {option}" for option in options),
        "",
        "# this run's directory, every task's (a requeued run gets one beside it, where train.resume=auto finds its",
        "# checkpoint)" + (f"; the ranks meet in its {RENDEZVOUS_DIR}/, on a port the system gives rank 0's store"
                           if not job.master_port else ""),
        f"export {RUN_DIR_VARIABLE}={shlex.quote(runs)}/{RUN_DIR_DATE}",
        *(["# the recipe's launcher.master_port: the ranks meet there, on node 0 (the step's first node)",
           f"export MASTER_PORT={job.master_port}"] if job.master_port else []),
        "",
        *mlflow,
        f"# {signal_lead_s(job)} s before the time limit: every rank stops at a step boundary and saves, then the job "
        "requeues",
        "step=",
        "stop_and_requeue() {",
        '    [ -n "$step" ] || { stop_pending=1; return; }  # the notice came before srun started: act once it has',
        '    echo "[dsrun] time limit near: stopping the ranks at a step boundary, then requeueing job $SLURM_JOB_ID"',
        '    kill -TERM "$step" 2>/dev/null',
        '    wait "$step"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "}",
        "trap stop_and_requeue USR1",
        "",
        f"srun --ntasks-per-node={job.procs_per_node} --kill-on-bad-exit=1 {rank} &",
        "step=$!",
        '[ -z "$stop_pending" ] || stop_and_requeue',
        'wait "$step"',
        'status=$?',
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)
