"""The ``srun`` tasks of ``dsrun export-job --target sbatch``'s script meet as a submitted sweep's jobs do
(dsrun/launcher/sbatch.py, docs/cluster.md): in the run directory the batch shell fixed (``DSRUN_RUN_DIR``), on the
port the system gave rank 0's store, even with the port the script once derived from the job id
(``29500 + SLURM_JOB_ID % 1000``) held by something else on the node. Two fresh ranks (``run_ranks``) with the
variables an ``srun`` task of that script has, meeting through dsrun train's own code (``batch_rendezvous``,
``meet_in_run_dir``); the real Slurm runs the sweep's: tests/e2e/slurm."""
from __future__ import annotations

import os
import socket
from pathlib import Path

from tests.helpers import run_ranks

JOB_ID = 4242


def batch_task(rank: int, world_size: int, run_dir: Path) -> tuple[int, float]:
    """This rank as an srun task of the exported script (no MASTER_PORT: the script exports none), met with the
    others; returns the port its world met on and an all-reduced sum."""
    import torch

    from dsrun import comm
    from dsrun.cli.submitted import meet_in_run_dir
    from dsrun.launcher.outer import detect_outer_launcher
    from dsrun.launcher.slurm_jobs import batch_rendezvous

    os.environ.pop("MASTER_PORT", None)
    os.environ.update({"SLURM_JOB_ID": str(JOB_ID), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
                       "SLURM_STEP_NUM_TASKS": str(world_size), "SLURM_STEP_TASKS_PER_NODE": str(world_size),
                       "SLURM_NODEID": "0", "SLURM_LOCALID": str(rank), "SLURM_STEP_NUM_NODES": "1",
                       "DSRUN_RUN_DIR": str(run_dir)})
    outer = detect_outer_launcher()
    meet_in_run_dir(outer, batch_rendezvous(outer))
    total = torch.tensor([float(rank + 1)])
    comm.all_reduce(total)
    port = int(os.environ["MASTER_PORT"])
    comm.destroy_process_group()
    return port, total.item()


def test_the_tasks_of_the_batch_script_meet_on_the_port_rank_0_was_given_not_the_job_ids(tmp_path):
    run_dir = tmp_path / "outputs" / "2026-12-06" / "10-00-00"
    with socket.socket() as holder:  # another job on the node holds the port derived from the job id
        holder.bind(("127.0.0.1", 29500 + JOB_ID % 1000))
        holder.listen()
        met = run_ranks(batch_task, 2, run_dir, timeout=120)
    (port, total), (other_port, other_total) = met
    assert port == other_port != 29500 + JOB_ID % 1000 and total == other_total == 3.0
    assert (run_dir / ".slurm_rendezvous" / f"job{JOB_ID}.0-run0" / "port").read_text() == str(port)
