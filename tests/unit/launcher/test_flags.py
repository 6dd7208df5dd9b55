"""The ``deepspeed`` launcher flags beyond placement: elastic training, --force_multi, srun's --comment and
--account, --autotuning, and the checks ``dsrun train`` makes for an elastic job."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from dsrun.launcher import LaunchOptions, options_from_mapping, plan_launch
from dsrun.utils.errors import UserError
from tests.helpers import run_cli


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\nworker-2 slots=2\n")
    (tmp_path / "train.py").write_text("")
    return tmp_path


def _plan(folder: Path, **kwargs):
    kwargs.setdefault("hostfile", str(folder / "hostfile"))
    return plan_launch(LaunchOptions(target="train.py", cwd=str(folder), **kwargs), environ={"HOME": str(folder)})


def _agent_flags(argv) -> dict[str, str]:
    words = shlex.split(argv[-1])
    return {w[2:].partition("=")[0]: w.partition("=")[2] for w in words if w.startswith("--")}


def test_elastic_training_reaches_every_agent_with_deepspeeds_defaults(job):
    p = _plan(job, elastic_training=True, runner="ssh")
    for command in p.commands:
        flags = _agent_flags(command.argv)
        assert (flags["min_elastic_nodes"], flags["max_elastic_nodes"], flags["max_restarts"]) == ("1", "3", "100")
        assert "elastic_training" in flags and flags["rdzv_last_call_timeout"] == "30"
        assert flags["rdzv_keep_alive_interval"] == "5"  # torch elastic's
    p = _plan(job, elastic_training=True, min_elastic_nodes=2, max_elastic_nodes=5, max_restarts=0, runner="pdsh",
              rdzv_last_call_timeout=2.5, rdzv_keep_alive_interval=2)
    flags = _agent_flags(p.commands[0].argv)
    assert (flags["min_elastic_nodes"], flags["max_elastic_nodes"], flags["rdzv_last_call_timeout"],
            flags["rdzv_keep_alive_interval"]) == ("2", "5", "2.5", "2")
    assert "max_restarts" not in flags  # 0 restarts: the agent's default


def test_the_plan_says_how_a_node_joins(job):
    plan = _plan(job, elastic_training=True, runner="ssh", module=True, master_port=29700,
                 rdzv_keep_alive_interval=2).to_json()
    assert plan["elastic"]["min_nodes"] == 1 and plan["elastic"]["max_nodes"] == 3
    join = shlex.split(plan["elastic"]["join"])
    assert join[:3] == ["dsrun", "launch", "--elastic_training"]
    assert ["--node_rank", "NODE_RANK"] == join[join.index("--node_rank"):join.index("--node_rank") + 2]
    assert "--no_ssh" in join and "--master_addr=worker-0" in join and "--master_port=29700" in join
    assert "--rdzv_keep_alive_interval=2" in join  # the joining node beats as often as the others
    assert f"--hostfile={job / 'hostfile'}" in join and join[-2:] == ["--module", "train.py"]


@pytest.mark.parametrize("kwargs, path, text", [
    ({"min_elastic_nodes": 2}, "--min_elastic_nodes", "needs --elastic_training"),
    ({"elastic_training": True, "runner": "slurm"}, "--elastic_training", "not the slurm runner"),
    ({"elastic_training": True, "no_local_rank": True}, "--no_local_rank", "not supported"),
    ({"elastic_training": True, "min_elastic_nodes": 3, "max_elastic_nodes": 2}, "--max_elastic_nodes", "below"),
    ({"elastic_training": True, "max_elastic_nodes": 2}, "--max_elastic_nodes", "starts on 3 nodes"),
    ({"elastic_training": True, "rdzv_last_call_timeout": 0.5}, "--rdzv_last_call_timeout", "at least 1 second"),
    ({"elastic_training": True, "rdzv_keep_alive_interval": 0}, "--rdzv_keep_alive_interval", "at least 1"),
    ({"rdzv_keep_alive_interval": 2}, "--rdzv_keep_alive_interval", "needs --elastic_training"),
    ({"comment": "x"}, "--comment", "slurm runner only"),
    ({"account": "a", "runner": "ssh"}, "--account", "slurm runner only"),
])
def test_inconsistent_flags_are_refused(job, kwargs, path, text):
    with pytest.raises(UserError) as excinfo:
        _plan(job, **kwargs)
    assert [p.path for p in excinfo.value.problems] == [path] and text in str(excinfo.value.problems[0])


def test_srun_gets_comment_and_account(job):
    (command,) = _plan(job, runner="slurm", comment="nightly run", account="proj1").commands
    assert list(command.argv[5:9]) == ["--comment", "nightly run", "--account", "proj1"]


def test_force_multi_uses_ssh_for_one_host(job):
    (job / "one").write_text("worker-0 slots=2\n")
    assert _plan(job, hostfile=str(job / "one"), master_addr="127.0.0.1").runner == "local"
    assert _plan(job, hostfile=str(job / "one"), force_multi=True).runner == "ssh"


def test_mapping_takes_the_new_keys(job):
    options = options_from_mapping({"elastic_training": True, "min_elastic_nodes": 1, "max_elastic_nodes": 4,
                                    "rdzv_last_call_timeout": 5, "rdzv_keep_alive_interval": 2, "force_multi": False,
                                    "comment": None}, "t.py")
    assert (options.elastic_training, options.elastic_range(2), options.restarts()) == (True, (1, 4), 100)
    assert options.keep_alive_interval() == 2


def test_autotuning_needs_the_scripts_config(job):
    done = run_cli("launch", "--autotuning", "run", "train.py", cwd=job)
    assert done.returncode == 2 and "--deepspeed ds_config.json" in done.stderr
    planned = run_cli("launch", "--autotuning", "tune", "--dry-run", "train.py", cwd=job)
    assert planned.returncode == 0 and json.loads(planned.stdout)["autotuning"] == "tune"


def test_help_lists_deepspeeds_launcher_flags():
    text = run_cli("launch", "--help").stdout
    for flag in ("--hostfile", "--include", "--exclude", "--num_nodes", "--num_gpus", "--num_accelerators",
                 "--min_elastic_nodes", "--max_elastic_nodes", "--master_port", "--master_addr", "--node_rank",
                 "--launcher", "--launcher_args", "--module", "--no_python", "--no_local_rank", "--no_ssh",
                 "--no_ssh_check", "--force_multi", "--save_pid", "--enable_each_rank_log", "--autotuning",
                 "--elastic_training", "--bind_cores_to_rank", "--bind_core_list", "--ssh_port", "--comment",
                 "--account"):
        assert flag in text, flag
    for runner in ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi", "jsrun"):
        assert runner in text


def test_dry_run_of_an_elastic_job(job):
    done = run_cli("launch", "-H", str(job / "hostfile"), "--elastic_training", "--dry-run", "train.py", cwd=job)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["elastic"]["max_nodes"] == 3


def test_train_refuses_an_elastic_launch_that_could_not_resume(job):
    done = run_cli("train", "--dry-run", "launcher=elastic", f"launcher.hostfile={job / 'hostfile'}", cwd=job)
    assert done.returncode == 2
    assert "ds.elasticity.enabled: launcher.elastic_training restarts the ranks" in done.stderr
    assert "train.resume: is null" in done.stderr
    done = run_cli("train", "--dry-run", "+recipe=gpt_elastic", f"launcher.hostfile={job / 'hostfile'}", cwd=job)
    assert done.returncode == 0, done.stderr
    assert "train_batch_size = 48 (elasticity v0.1" in done.stdout and "world size 6" in done.stdout
