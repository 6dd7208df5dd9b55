"""Ranks started by an MPI launcher: the rank shim (``rank_exec --mpi``) turns the MPI library's variables into
the world a script expects, and a real ``mpirun`` (Open MPI, which ``tests/run`` installs) runs a 2-rank job
through ``dsrun launch --launcher openmpi``."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsrun.launcher.protocol import encode_world_info
from tests.helpers import free_port, require_programs
from tests.integration.launcher.jobs import EXAMPLE, dsrun_launch, job_env, kill_job, new_tag, read_ranks


def test_the_shim_turns_open_mpi_variables_into_a_world(tmp_path):
    """Two processes carrying what Open MPI's mpirun would set form a gloo world through the shim alone."""
    tag, port = new_tag(), free_port()
    hosts = {"localhost": [0, 1]}
    processes = []
    try:
        for rank in range(2):
            env = job_env(tag, tmp_path, OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                          OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                env.pop(name, None)
            processes.append(subprocess.Popen(
                [sys.executable, "-u", "-m", "dsrun.launcher.rank_exec", "--mpi",
                 f"--world_info={encode_world_info(hosts)}", f"--chdir={tmp_path}", "--append_local_rank", "--",
                 sys.executable, "-u", EXAMPLE, "--out", str(tmp_path / "out")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for process in processes:
            _, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr
    finally:
        kill_job(tag)
    for rank, report in enumerate(read_ranks(tmp_path / "out", 2)):
        assert (report["RANK"], report["LOCAL_RANK"], report["WORLD_SIZE"], report["local_rank_arg"]) == (
            str(rank), str(rank), "2", rank)
        assert (report["CROSS_RANK"], report["CROSS_SIZE"], report["sum"]) == ("0", "1", 3.0)


@pytest.mark.slow
def test_openmpi_runner_runs_two_ranks(tmp_path):
    require_programs("mpirun")
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    tag = new_tag()
    extra = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    try:
        done = subprocess.run(dsrun_launch("-H", "hostfile", "--launcher", "openmpi", "--master_port", str(free_port()),
                                           EXAMPLE, "--out", str(tmp_path / "out")),
                              env=job_env(tag, tmp_path, **extra), capture_output=True, text=True, timeout=180,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        kill_job(tag)
    reports = read_ranks(tmp_path / "out", 2)
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["sum"]) for r in reports] == [
        ("0", "0", "2", 3.0), ("1", "1", "2", 3.0)]
    assert "[localhost] rank 1/2: all-reduce sum 3.0" in done.stdout
