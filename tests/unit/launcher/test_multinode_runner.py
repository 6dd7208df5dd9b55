"""DeepSpeed's runner classes (``deepspeed.launcher.multinode_runner``) are views of dsrun's launch plan: the
same command lines, from one source."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsrun.cli.deepspeed_runner import encode_world_info, parse_args
from dsrun.launcher import LaunchOptions, plan_launch
from dsrun.launcher import multinode_runner as mn

POOL = {"worker-0": 2, "worker-1": 2}
ENVIRON = {"HOME": "/home/user", "PYTHONPATH": "/lib", "NCCL_DEBUG": "INFO"}


@pytest.fixture
def job(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("cls", [mn.OpenMPIRunner, mn.MPICHRunner, mn.IMPIRunner, mn.SlurmRunner, mn.MVAPICHRunner,
                                 mn.JSRunner, mn.PDSHRunner])
def test_each_class_runs_the_command_dsrun_launch_plans(job, cls):
    flags = ["--hostfile", "hostfile", "--master_port", "29600", "--launcher_args", "--extra 1"]
    args = parse_args([*flags, "train.py", "--lr", "0.1"])
    runner = cls(args, encode_world_info(POOL)) if cls is mn.PDSHRunner else cls(args, encode_world_info(POOL), POOL)
    runner.add_export(" OMP_NUM_THREADS ", " 4 ")
    got = runner.get_cmd(ENVIRON, POOL)
    if cls is mn.PDSHRunner:
        got, kill_cmd, env = got
        assert env["PDSH_RCMD_TYPE"] == "ssh" and env["NCCL_DEBUG"] == "INFO"
        assert kill_cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
        assert kill_cmd[-1].startswith("pkill -f 'dsrun.launcher.agent --world_info=")
    plan = plan_launch(LaunchOptions(target="train.py", target_args=["--lr", "0.1"], runner=runner.name,
                                     hostfile="hostfile", master_port=29600, launcher_args="--extra 1",
                                     cwd=str(job)), environ={**ENVIRON, "OMP_NUM_THREADS": "4"})
    (command,) = plan.commands
    assert got == list(command.argv)
    assert (runner.user_script, runner.user_arguments, runner.name) == ("train.py", ["--lr", "0.1"], plan.runner)
    assert runner.backend_exists() in (True, False)
    assert "OMP_NUM_THREADS" in " ".join(got)  # the export added through the class reaches the ranks


def test_slot_counts_and_slot_lists_give_the_same_command(job):
    args = parse_args(["train.py"])
    runner = mn.MPICHRunner(args, encode_world_info(POOL), POOL)
    assert runner.get_cmd(ENVIRON, POOL) == runner.get_cmd(ENVIRON, {"worker-0": [0, 1], "worker-1": [0, 1]})


def test_openmpi_takes_deepspeeds_tcp_interface_unless_told(job):
    default = mn.OpenMPIRunner(parse_args(["train.py"]), encode_world_info(POOL), POOL).get_cmd(ENVIRON, POOL)
    assert default[default.index("btl_tcp_if_include") + 1] == "eth0"
    chosen = mn.OpenMPIRunner(parse_args(["--launcher_arg", "--mca btl_tcp_if_include ib0", "train.py"]),
                              encode_world_info(POOL), POOL).get_cmd(ENVIRON, POOL)
    assert "eth0" not in chosen and chosen[chosen.index("btl_tcp_if_include") + 1] == "ib0"


def test_an_inconsistent_flag_set_is_a_value_error():
    with pytest.raises(ValueError, match="--comment"):
        mn.OpenMPIRunner(parse_args(["--comment", "x", "train.py"]), encode_world_info(POOL), POOL)


def test_the_module_resolves_through_the_alias():
    import subprocess

    from tests.helpers import REPO

    code = ("import deepspeed.launcher.multinode_runner as m, dsrun.launcher.multinode_runner as d; "
            "from deepspeed.launcher import multinode_runner; assert m is d is multinode_runner; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{REPO / 'dsrun/alias/site'}:{REPO}", "PATH": "/usr/bin:/bin"})
    assert done.stdout.strip() == "ok", done.stderr


def test_an_export_a_shell_would_misread_is_shown_quoted_and_reaches_the_ranks_as_is(job):
    args = parse_args(["--hostfile", "hostfile", "--master_port", "29600", "train.py"])
    runner = mn.OpenMPIRunner(args, encode_world_info(POOL), POOL)
    runner.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
    runner.add_export("PYTHONPATH", " /usr/lib/python3/site-packages ")
    assert runner.exports == {"SLURM_JOB_CPUS_PER_NODE": '"64(x2)"', "PYTHONPATH": "/usr/lib/python3/site-packages"}
    argv = runner.get_cmd(ENVIRON, POOL)
    assert "SLURM_JOB_CPUS_PER_NODE=64(x2)" in argv  # mpirun's -x gets the value, no shell strips quotes there


def test_a_runner_class_of_the_users_own_takes_deepspeeds_namespace():
    from types import SimpleNamespace

    class Mine(mn.MultiNodeRunner):
        def backend_exists(self) -> bool:
            return True

    runner = Mine(SimpleNamespace(user_args=["--lr", "0.1"], user_script="train.py"), "world_info")
    assert (runner.user_script, runner.user_arguments, runner.exports) == ("train.py", ["--lr", "0.1"], {})
