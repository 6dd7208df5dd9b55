"""The MPI family of runners as launch plans: the exact command lines against DeepSpeed's forms, what they
refuse, and the rank side (``rank_exec --mpi``) reading each MPI library's variables.

DeepSpeed documents the MPI launch as ``mpirun -np [#processes] -ppn [#GPUs on each node] -hostfile
[hostfile] [MPI flags] python [training_script.py]`` (1-bit Adam / 1-bit LAMB tutorials; getting started);
its launcher's runners build: openmpi ``mpirun -n N -hostfile H --mca btl ^openib --mca btl_tcp_if_include eth0
[args] -x K=V python -u script``, mpich ``mpirun -n N -ppn P [args] -genv ... -hosts h1,h2 python -u ...``, impi ``mpirun -ppn P
[args] -genv K V ... -genv I_MPI_PIN 0 -hosts h1,h2 ...``, mvapich ``mpirun -np N -ppn P --hostfile F [args]
-env K=V ... python -u script``, jsrun ``jsrun -n N -c 7 -g 1 -a 1 [args] -E K=V python -u script``. dsrun
keeps each form; the program is dsrun's rank shim followed by ``python -u script``."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from dsrun.launcher import LaunchOptions, plan_launch
from dsrun.launcher.protocol import encode_world_info
from dsrun.launcher.rank_exec import mpi_rank_environment
from dsrun.utils.errors import UserError
from tests.helpers import run_cli

HOSTS = {"worker-0": [0, 1], "worker-1": [0, 1]}
PY = sys.executable


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    (tmp_path / "train.py").write_text("")
    return tmp_path


def _plan(folder: Path, runner: str, **kwargs):
    kwargs.setdefault("hostfile", str(folder / "hostfile"))
    kwargs.setdefault("launcher_args", "--mpi-flag x")
    return plan_launch(LaunchOptions(target="train.py", target_args=["--lr", "0.1"], runner=runner, cwd=str(folder),
                                     master_port=29600, **kwargs),
                       environ={"HOME": str(folder), "PYTHONPATH": "/lib"})


def _rank_command(folder: Path) -> list[str]:
    return [PY, "-u", "-m", "dsrun.launcher.rank_exec", "--mpi", f"--world_info={encode_world_info(HOSTS)}",
            f"--chdir={folder}", "--append_local_rank", "--", PY, "-u", "train.py", "--lr", "0.1"]


def _exports(folder: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{folder}:/lib", "MASTER_ADDR": "worker-0", "MASTER_PORT": "29600", "WORLD_SIZE": "4",
            "LOCAL_SIZE": "2"}


def test_openmpi(job):
    (command,) = _plan(job, "openmpi").commands
    exports = [a for k, v in _exports(job).items() for a in ("-x", f"{k}={v}")]
    assert list(command.argv) == ["mpirun", "-n", "4", "-hostfile", str(job / "hostfile"), "--mca", "btl", "^openib",
                                  "--mca", "btl_tcp_if_include", "eth0", "--mpi-flag", "x", *exports,
                                  *_rank_command(job)]
    # DeepSpeed's default TCP interface gives way to the one the launcher arguments choose
    for flag in ("-mca", "--mca"):
        words = list(_plan(job, "openmpi", launcher_args=f"{flag} btl_tcp_if_include eth1").commands[0].argv)
        assert "eth0" not in words and words[words.index("^openib") + 1:][:3] == [flag, "btl_tcp_if_include", "eth1"]
    # hosts chosen by a filter cannot come from the hostfile: they are listed with their rank counts
    (filtered,) = _plan(job, "openmpi", num_procs=1).commands
    assert list(filtered.argv[:5]) == ["mpirun", "-n", "2", "-H", "worker-0:1,worker-1:1"]


def test_mpich_and_impi(job):
    genv = [a for k, v in _exports(job).items() for a in ("-genv", k, v)]
    (mpich,) = _plan(job, "mpich").commands
    assert list(mpich.argv) == ["mpirun", "-n", "4", "-ppn", "2", "--mpi-flag", "x", *genv, "-hosts",
                                "worker-0,worker-1", *_rank_command(job)]
    (impi,) = _plan(job, "impi").commands
    assert list(impi.argv) == ["mpirun", "-n", "4", "-ppn", "2", "--mpi-flag", "x", *genv, "-genv", "I_MPI_PIN", "0",
                               "-hosts", "worker-0,worker-1", *_rank_command(job)]


def test_mvapich_writes_its_hosts_file(job):
    p = _plan(job, "mvapich")
    ((path, text),) = p.files.items()
    assert text == "worker-0\nworker-1\n"
    mv2 = ["MV2_SMP_USE_CMA=0", "MV2_DEBUG_SHOW_BACKTRACE=1", "MV2_SUPPORT_DL=1", "MV2_ENABLE_AFFINITY=0",
           "MV2_INTER_ALLGATHER_TUNING=5", "MV2_CUDA_USE_NAIVE=0"]
    env = [a for v in mv2 + [f"{k}={v}" for k, v in _exports(job).items()] for a in ("-env", v)]
    assert list(p.commands[0].argv) == ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", path, "--mpi-flag", "x",
                                        *env, *_rank_command(job)]


def test_jsrun(job):
    (command,) = _plan(job, "jsrun").commands
    exports = [a for k, v in _exports(job).items() for a in ("-E", f"{k}={v}")]
    assert list(command.argv) == ["jsrun", "-n", "4", "-c", "7", "-g", "1", "-a", "1", "--mpi-flag", "x", *exports,
                                  *_rank_command(job)]


def test_the_documented_shape_holds_for_every_runner(job):
    """``LAUNCHER -np N [-ppn P] [hosts] [MPI flags] ... python [script]``: the process count first, the user's
    MPI flags after the runner's own placement flags, and the training script with its arguments last."""
    for runner in ("openmpi", "mpich", "impi", "mvapich", "jsrun"):
        argv = list(_plan(job, runner).commands[0].argv)
        assert argv[0] in ("mpirun", "jsrun") and argv[1] in ("-n", "-np") and argv[2] == "4"
        assert argv.index("--mpi-flag") < argv.index("dsrun.launcher.rank_exec")
        assert argv[-5:] == [PY, "-u", "train.py", "--lr", "0.1"]


def test_module_no_python_core_binding_and_no_local_rank(job):
    words = list(_plan(job, "openmpi", module=True, bind_cores_to_rank=True, bind_core_list="0-3",
                       no_local_rank=True).commands[0].argv)
    assert ["--bind-to", "none"] == words[words.index("eth0") + 1:words.index("eth0") + 3]
    shim = words[words.index("dsrun.launcher.rank_exec"):]
    assert shim[shim.index("--"):] == ["--", PY, "-u", "-m", "train.py", "--lr", "0.1"]
    assert "--bind_cores_to_rank" in shim and "--bind_core_list=0-3" in shim and "--append_local_rank" not in shim
    words = list(_plan(job, "mpich", no_python=True).commands[0].argv)
    assert words[words.index("--") + 1:] == ["train.py", "--lr", "0.1"]


def test_what_mpirun_cannot_place_is_refused(job):
    with pytest.raises(UserError, match="cannot skip slots"):
        _plan(job, "mpich", include="worker-0:1@worker-1")
    (job / "uneven").write_text("worker-0 slots=2\nworker-1 slots=1\n")
    with pytest.raises(UserError, match="same number of ranks on every host"):
        _plan(job, "impi", hostfile=str(job / "uneven"))
    assert _plan(job, "openmpi", hostfile=str(job / "uneven")).world_size == 3  # -hostfile places them
    with pytest.raises(UserError, match="elastic_training"):
        _plan(job, "openmpi", elastic_training=True)


def test_dry_run_from_the_cli(job):
    done = run_cli("launch", "-H", str(job / "hostfile"), "--launcher", "IMPI", "--dry-run", "train.py", cwd=job)
    assert done.returncode == 0, done.stderr
    assert '"launcher": "impi"' in done.stdout and "I_MPI_PIN 0" in done.stdout


@pytest.mark.parametrize("variables, expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ("3", "4", "1", "2", "1")),
    ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0",
      "MV2_COMM_WORLD_LOCAL_SIZE": "2"}, ("2", "4", "0", "2", "1")),
    ({"JSM_NAMESPACE_RANK": "1", "JSM_NAMESPACE_SIZE": "4", "JSM_NAMESPACE_LOCAL_RANK": "1",
      "JSM_NAMESPACE_LOCAL_SIZE": "2"}, ("1", "4", "1", "2", "0")),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, ("2", "4", "0", "2", "1")),
    ({"PMI_RANK": "3", "PMI_SIZE": "4"}, ("3", "4", "1", "2", "1")),  # no local rank: from the hosts' slots
], ids=["openmpi", "mvapich", "jsrun", "hydra", "pmi-only"])
def test_rank_environment_of_each_mpi_family(variables, expected):
    env = mpi_rank_environment(variables, HOSTS)
    got = (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["CROSS_RANK"])
    assert got == expected and env["CROSS_SIZE"] == "2" and env["LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"]


def test_rank_environment_needs_an_mpi_launcher():
    with pytest.raises(ValueError, match="not started by an MPI launcher"):
        mpi_rank_environment({"RANK": "0"})


def test_display_is_a_shell_command(job):
    (command,) = _plan(job, "openmpi").commands
    assert shlex.split(command.display()) == list(command.argv)
