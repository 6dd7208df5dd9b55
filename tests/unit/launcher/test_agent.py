"""Pieces of the node agent that need no processes: node ranks, core splitting, the rank exec shim,
the failure protocol, and the ``dsrun train`` entry (launch_from_mapping) in dry-run mode."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsrun.launcher import launch_from_mapping
from dsrun.launcher.agent import _cores_for_ranks, _resolve_node_rank, _worker_command, build_parser
from dsrun.launcher.protocol import decode_world_info, encode_world_info, exit_code_for, log_tails
from tests.helpers import REPO


def test_world_info_round_trips_in_order():
    hosts = {"b": [2, 3], "a": [0]}
    assert list(decode_world_info(encode_world_info(hosts)).items()) == [("b", [2, 3]), ("a", [0])]


@pytest.mark.parametrize("variable", ["SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])
def test_node_rank_comes_from_the_scheduler_when_not_given(monkeypatch, variable):
    for name in ("SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "2")
    assert _resolve_node_rank(-1, 3) == 2
    assert _resolve_node_rank(0, 3) == 0  # an explicit rank wins


def test_node_rank_outside_the_world_is_refused(monkeypatch):
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    with pytest.raises(SystemExit, match="node rank 3 is outside 0..1"):
        _resolve_node_rank(3, 2)


def test_cores_are_split_evenly_and_leftovers_stay_idle():
    assert _cores_for_ranks(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    with pytest.raises(SystemExit, match="1 cores cannot be split among 2 ranks"):
        _cores_for_ranks(2, [7])


def test_worker_command_forms():
    parse = build_parser().parse_args
    base = ["--world_info=x", "--master_addr=a", "--master_port=1"]
    assert _worker_command(parse(base + ["t.py", "--x", "1"])) == [sys.executable, "-u", "t.py", "--x", "1",
                                                                 "--local_rank=${local_rank}"]
    assert _worker_command(parse(base + ["--module", "--no_local_rank", "pkg.mod"])) == [sys.executable, "-u", "-m",
                                                                                         "pkg.mod"]
    assert _worker_command(parse(base + ["--no_python", "--no_local_rank", "/bin/app", "-v"])) == ["/bin/app", "-v"]


def test_exit_codes_follow_the_failed_rank():
    assert (exit_code_for(3), exit_code_for(-9), exit_code_for(-15), exit_code_for(300)) == (3, 137, 143, 1)


def test_log_tails_keep_the_last_lines_of_each_non_empty_log(tmp_path):
    out, err, empty = tmp_path / "o", tmp_path / "e", tmp_path / "x"
    out.write_text("".join(f"line {i}\n" for i in range(30)))
    err.write_text("boom\n")
    empty.write_text("")
    tails = log_tails([str(out), str(empty), str(err), str(tmp_path / "missing")], lines=3)
    assert tails == [{"path": str(out), "tail": ["line 27", "line 28", "line 29"]},
                     {"path": str(err), "tail": ["boom"]}]


def test_rank_exec_binds_cores_and_execs_the_command():
    code = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'], os.getppid() > 1)"
    core = sorted(__import__("os").sched_getaffinity(0))[0]
    done = subprocess.run([sys.executable, "-m", "dsrun.launcher.rank_exec", f"--core_groups=9999/{core}",
                           "--local_rank=1", "--", sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[{core}] 1 True"


def test_rank_exec_reports_a_missing_program():
    done = subprocess.run([sys.executable, "-m", "dsrun.launcher.rank_exec", "--", "/no/such/program"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 127 and "cannot start '/no/such/program'" in done.stderr


def test_launch_from_mapping_dry_run_is_what_dsrun_train_calls(tmp_path, capsys):
    code = launch_from_mapping({"runner": "ssh", "hostfile": str(_hostfile(tmp_path)), "num_procs": 1,
                                "master_port": 29999, "max_restarts": 2},
                               "dsrun.worker", ["--run-dir", "runs/1"], module=True, dry_run=True, cwd=str(tmp_path))
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["hosts"] == {"n0": [0], "n1": [0]} and plan["world_size"] == 2 and plan["launcher"] == "ssh"
    assert all("--module --max_restarts=2" in cmd and "dsrun.worker --run-dir runs/1" in cmd
               for _, cmd in plan["commands"])


def _hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("n0 slots=2\nn1 slots=2\n")
    return path


def test_dsrun_train_gives_the_agents_its_grace_period_and_more(tmp_path, capsys):
    code = launch_from_mapping({"runner": "ssh", "hostfile": str(_hostfile(tmp_path)), "num_procs": 1,
                                "master_port": 29999}, "dsrun.worker", ["--run-dir", "runs/1"], module=True,
                               dry_run=True, cwd=str(tmp_path), stop_grace=90.5)
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert all("--stop_grace=96 " in cmd for _, cmd in plan["commands"])  # the ranks' 90.5 s, then 5 s more
    assert build_parser().parse_args(["--world_info=e30=", "--master_addr=a", "--master_port=1", "t"]).stop_grace == 30
