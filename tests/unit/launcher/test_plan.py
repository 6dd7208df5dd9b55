"""World plans, runner command lines, quoting for the remote shell, the RunSpec mapping, and the CLI's
dry run and usage errors."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun.launcher import LaunchOptions, options_from_mapping, plan_launch
from dsrun.launcher.protocol import decode_world_info
from dsrun.utils.errors import UserError
from tests.helpers import run_cli


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=2\n")
    return path


def _agent_flags(command: str) -> dict[str, str]:
    words = shlex.split(command)
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


def plan(tmp_path: Path, **kwargs) -> object:
    kwargs.setdefault("target", "train.py")
    return plan_launch(LaunchOptions(cwd=str(tmp_path), **kwargs), environ={"HOME": str(tmp_path)})


# ---- world plans ---------------------------------------------------------------------------------------

def test_no_hostfile_on_cpu_is_one_local_process(tmp_path):
    (tmp_path / "train.py").write_text("")
    p = plan(tmp_path)
    assert (p.hosts, p.world_size, p.runner, p.master_addr) == ({"localhost": [0]}, 1, "local", "127.0.0.1")


def test_a_local_job_without_a_port_takes_a_free_one_and_a_given_port_is_kept(tmp_path):
    import socket

    (tmp_path / "train.py").write_text("")
    local = plan(tmp_path)
    with socket.socket() as probe:  # free: it does not clash with 29500 or any other job's port
        probe.bind(("127.0.0.1", local.master_port))
    assert f"--master_port={local.master_port} " in local.commands[0].argv[-1]
    assert plan(tmp_path, master_port=29611).master_port == 29611


def test_a_multi_node_job_without_a_port_uses_29500_as_deepspeed_does(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "hostfile").write_text("worker-0 slots=1\nworker-1 slots=1\n")
    assert plan(tmp_path, hostfile=str(tmp_path / "hostfile"), runner="pdsh").master_port == 29500


def test_num_procs_without_hostfile(tmp_path):
    (tmp_path / "train.py").write_text("")
    assert plan(tmp_path, num_procs=3).hosts == {"localhost": [0, 1, 2]}


def test_hostfile_plan_uses_ssh_and_the_first_host_as_master(tmp_path, hostfile):
    p = plan(tmp_path, hostfile=str(hostfile), exclude="worker-1:0,1")
    assert p.hosts == {"worker-0": [0, 1, 2, 3], "worker-1": [2, 3], "worker-2": [0, 1]}
    assert (p.world_size, p.runner, p.master_addr) == (8, "ssh", "worker-0")
    assert [c.label for c in p.commands] == ["worker-0", "worker-1", "worker-2"]
    for node_rank, command in enumerate(p.commands):
        remote = command.argv[-1]
        flags = _agent_flags(remote)
        assert flags["node_rank"] == str(node_rank) and flags["master_addr"] == "worker-0"
        assert decode_world_info(flags["world_info"]) == p.hosts
        assert "--watch_stdin" in shlex.split(remote)


def test_num_nodes_and_num_procs_take_the_first_hosts_and_slots(tmp_path, hostfile):
    p = plan(tmp_path, hostfile=str(hostfile), num_nodes=2, num_procs=2)
    assert p.hosts == {"worker-0": [0, 1], "worker-1": [0, 1]}


@pytest.mark.parametrize("kwargs, message", [
    ({"num_nodes": 4}, "--num_nodes: asks for 4 nodes but the hostfile has 3"),
    ({"num_procs": 3}, "--num_procs: asks for 3 ranks per node but host 'worker-2' has 2 slots"),
    ({"include": "worker-0", "num_procs": 1}, "--include: cannot be combined with --num_nodes/--num_procs"),
    ({"runner": "local"}, "--launcher: the local runner runs on this machine only"),
    ({"runner": "no_ssh", "node_rank": 3, "master_addr": "w"}, "--node_rank: is 3 but the job has 3 nodes"),
    ({"runner": "no_ssh", "node_rank": 1}, "--master_addr: is required with --no_ssh on several nodes"),
    ({"runner": "no_ssh"}, "--node_rank: is required with --no_ssh"),
    ({"runner": "rsh"}, "--launcher: unknown runner 'rsh'"),
    ({"master_port": 70000}, "--master_port: must be a TCP port 1..65535, got 70000"),
    ({"bind_core_list": "0-3"}, "--bind_core_list: needs --bind_cores_to_rank"),
    ({"bind_cores_to_rank": True, "bind_core_list": "0-2"}, "--bind_core_list: has 3 cores for 4 ranks per node"),
])
def test_plan_errors(tmp_path, hostfile, kwargs, message):
    with pytest.raises(UserError) as excinfo:
        plan(tmp_path, hostfile=str(hostfile), **kwargs)
    assert any(str(p).startswith(message) for p in excinfo.value.problems), excinfo.value.problems


def test_num_nodes_without_hostfile_is_an_error(tmp_path):
    with pytest.raises(UserError, match="--num_nodes: asks for 2 nodes but there is no hostfile"):
        plan(tmp_path, num_nodes=2)


def test_missing_local_script_is_an_error(tmp_path):
    with pytest.raises(UserError, match="script: 'train.py' does not exist"):
        plan(tmp_path, num_procs=2)


def test_no_ssh_runs_only_this_nodes_agent(tmp_path, hostfile):
    (tmp_path / "train.py").write_text("")
    p = plan(tmp_path, hostfile=str(hostfile), runner="no_ssh", node_rank=1, master_addr="10.0.0.1")
    (command,) = p.commands
    assert command.label == "worker-1" and command.argv[:2] == ("/bin/sh", "-c")
    flags = _agent_flags(command.argv[2])
    assert (flags["node_rank"], flags["master_addr"]) == ("1", "10.0.0.1")


# ---- runners -------------------------------------------------------------------------------------------

def test_ssh_command_line(tmp_path, hostfile):
    p = plan(tmp_path, hostfile=str(hostfile), ssh_port=2222, launcher_args="-F /etc/cluster_ssh -o LogLevel=ERROR",
             num_nodes=1, runner="ssh")
    (command,) = p.commands
    assert list(command.argv[:-1]) == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o",
                                       "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-p", "2222", "-F",
                                       "/etc/cluster_ssh", "-o", "LogLevel=ERROR", "worker-0"]


@pytest.mark.parametrize("runner, head", [
    ("pdsh", ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1,worker-2"]),
    ("slurm", ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--nodelist=worker-0,worker-1,worker-2"]),
])
def test_one_command_for_all_nodes_runners(tmp_path, hostfile, runner, head):
    p = plan(tmp_path, hostfile=str(hostfile), runner=runner, launcher_args="--extra 1")
    (command,) = p.commands
    assert list(command.argv[:len(head)]) == head
    assert list(command.argv[len(head):len(head) + 2]) == ["--extra", "1"]
    node_rank = _agent_flags(command.argv[-1])["node_rank"]
    assert node_rank == ("%n" if runner == "pdsh" else "-1")  # pdsh fills in %n; the agent reads the scheduler's


def test_everything_is_quoted_for_the_remote_shell(tmp_path):
    """Run the exact remote command through /bin/sh with a stand-in interpreter that prints its argv."""
    cwd = tmp_path / "my dir; $(touch pwned)"
    cwd.mkdir()
    echo = tmp_path / "fake python"
    echo.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'V': os.environ.get('PYTHON_V')}))\n")
    echo.chmod(0o755)
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    nasty = ["it's", '"quoted"', "$HOME", "`id`", "a;b", "x && y", "|", "*", "\\", "new\nline"]
    options = LaunchOptions(target="scr ipt.py", target_args=nasty, hostfile=str(tmp_path / "hosts"), cwd=str(cwd),
                            python=str(echo), runner="ssh")
    p = plan_launch(options, environ={"HOME": str(tmp_path), "PYTHON_V": "a b 'c' $d"})
    remote = p.commands[1].argv[-1]
    done = subprocess.run(["/bin/sh", "-c", remote], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["cwd"] == str(cwd) and seen["V"] == "a b 'c' $d"
    assert seen["argv"][:3] == ["-u", "-m", "dsrun.launcher.agent"]
    assert seen["argv"][-len(nasty) - 1:] == ["scr ipt.py", *nasty]
    assert not list(tmp_path.glob("**/pwned")) and not os.path.exists("pwned")


# ---- the RunSpec mapping -------------------------------------------------------------------------------

def test_options_from_mapping(tmp_path):
    options = options_from_mapping({"runner": "no_ssh", "num_procs": 2, "node_rank": 0, "master_port": 1234,
                                    "max_restarts": 1, "log_dir": "logs", "bind_cores_to_rank": False},
                                   "dsrun.worker", ["--run-dir", "x"], module=True, cwd=str(tmp_path))
    assert (options.runner, options.num_procs, options.node_rank, options.master_port, options.max_restarts,
            options.log_dir, options.module, options.target_args) == (
        "no_ssh", 2, 0, 1234, 1, "logs", True, ["--run-dir", "x"])


def test_mapping_errors_name_the_key_path():
    with pytest.raises(UserError) as excinfo:
        options_from_mapping({"num_proc": 2, "master_port": "x", "bind_cores_to_rank": "yes"}, "t.py")
    assert [str(p) for p in excinfo.value.problems] == [
        "launcher.num_proc: is not a launcher key (did you mean 'num_procs'?)",
        "launcher.master_port: must be int, got 'x'",
        "launcher.bind_cores_to_rank: must be bool, got 'yes'",
    ]
    with pytest.raises(UserError) as excinfo:
        options_from_mapping({"runner": "sshh", "include": "a", "exclude": "b"}, "t.py")
    assert [p.path for p in excinfo.value.problems] == ["launcher.runner", "launcher.include/launcher.exclude"]


def test_mapping_rejects_a_bool_where_an_int_belongs():
    with pytest.raises(UserError, match="launcher.num_procs: must be int, got True"):
        options_from_mapping({"num_procs": True}, "t.py")


# ---- the CLI -------------------------------------------------------------------------------------------

def test_dry_run_prints_the_plan_as_json_and_launches_nothing(tmp_path, hostfile):
    done = run_cli("launch", "-H", str(hostfile), "--include", "worker-0:0,1@worker-2", "--master_port", "29555",
                   "--dry-run", "train.py", "--lr", "0.1", cwd=tmp_path,
                   env={"NCCL_DEBUG": "INFO", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    plan_json = json.loads(done.stdout)
    assert list(plan_json) == ["hosts", "world_size", "master_addr", "master_port", "launcher", "commands", "env"]
    assert plan_json["hosts"] == {"worker-0": [0, 1], "worker-2": [0, 1]}
    assert (plan_json["world_size"], plan_json["master_addr"], plan_json["master_port"], plan_json["launcher"]) == (
        4, "worker-0", 29555, "ssh")
    assert [host for host, _ in plan_json["commands"]] == ["worker-0", "worker-2"]
    assert all(cmd.startswith("ssh -o BatchMode=yes") and "train.py --lr 0.1" in cmd
               for _, cmd in plan_json["commands"])
    assert plan_json["env"]["NCCL_DEBUG"] == "INFO"
    assert plan_json["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)


def test_invalid_input_exits_2_with_one_line_per_problem(tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("a slots=1\nb; rm -rf / slots=2\na slots=3\n")
    done = run_cli("launch", "-H", str(bad), "--dry-run", "train.py", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"error: {bad}:2: bad entry 'b; rm -rf / slots=2' (expected 'HOST slots=N')",
                                        f"error: {bad}:3: host 'a' is listed more than once (first listed on line 1)"]


def test_conflicting_flags_exit_2(tmp_path, hostfile):
    done = run_cli("launch", "-H", str(hostfile), "--include", "worker-0", "--num_procs", "1", "--master_port", "0",
                   "--no_ssh", "--dry-run", "train.py", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: --include: cannot be combined with --num_nodes/--num_procs (a filter already says which hosts "
        "and slots to use)",
        "error: --master_port: must be a TCP port 1..65535, got 0",
        "error: --node_rank: is required with --no_ssh (run one launcher per node with --node_rank 0, 1, ...)",
    ]


def test_everything_after_the_script_belongs_to_the_script(tmp_path):
    (tmp_path / "train.py").write_text("")
    done = run_cli("launch", "--num_procs", "2", "--dry-run", "train.py", "-a", "--b", "c", "--num_procs", "3",
                   "--master_port", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan_json = json.loads(done.stdout)
    assert plan_json["world_size"] == 2 and plan_json["master_port"] != 1  # the script's flag is the script's
    assert plan_json["commands"][0][1].endswith("train.py -a --b c --num_procs 3 --master_port 1")
