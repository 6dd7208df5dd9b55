"""``dsrun launch`` on this machine: ranks, environment, failures, restarts, signals, logs, core binding."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests.helpers import free_port
from tests.integration.launcher.jobs import (EXAMPLE, dsrun_launch, job_env, kill_job, new_tag, read_ranks,
                                             wait_for_files, wait_until_gone)


def _launch(tmp_path: Path, tag: str, flags: list[str], script_args: list[str] = (), env: dict | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    argv = dsrun_launch("--master_port", str(free_port()), *flags, EXAMPLE, "--out", str(tmp_path / "out"),
                        *script_args)
    return subprocess.run(argv, env=env or job_env(tag, tmp_path), capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def _start_hanging_job(tmp_path: Path, tag: str) -> subprocess.Popen:
    """A 2-rank job that all-reduces until stopped, with --save_pid; returns once both ranks are running."""
    out = tmp_path / "out"
    launcher = subprocess.Popen(dsrun_launch("--num_procs", "2", "--master_port", str(free_port()), "--save_pid",
                                             EXAMPLE, "--out", str(out), "--hang"),
                                env=job_env(tag, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path)
    wait_for_files([out / "rank0.pid", out / "rank1.pid"], timeout=90, process=launcher)
    return launcher


def test_two_ranks_all_reduce_and_get_their_environment(tmp_path):
    tag = new_tag()
    env = job_env(tag, tmp_path)
    env.pop("OMP_NUM_THREADS")  # the launcher chooses cores / local ranks when the user did not
    try:
        done = _launch(tmp_path, tag, ["--num_procs", "2"], env=env)
        assert done.returncode == 0, done.stderr
        reports = read_ranks(tmp_path / "out", 2)
        cores = len(os.sched_getaffinity(0))
        for rank, report in enumerate(reports):
            assert report["RANK"] == report["LOCAL_RANK"] == str(rank)
            assert report["local_rank_arg"] == rank
            assert report["WORLD_SIZE"] == report["LOCAL_WORLD_SIZE"] == "2"
            assert (report["CROSS_RANK"], report["CROSS_SIZE"]) == ("0", "1")
            assert report["MASTER_ADDR"] == "127.0.0.1"
            assert report["OMP_NUM_THREADS"] == str(max(1, cores // 2))
            assert report["sum"] == 3.0
        assert "[rank1]:rank 1/2: all-reduce sum 3.0" in done.stdout
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)


def test_a_crashing_rank_fails_the_job_with_its_rank_exit_code_and_log(tmp_path):
    tag = new_tag()
    try:
        done = _launch(tmp_path, tag, ["--num_procs", "2", "--no_local_rank"], ["--crash-once", "1"])
        assert done.returncode == 3
        assert "dsrun: job failed: rank 1 (local rank 1) on host localhost exited with exit code 3" in done.stderr
        assert "    rank 1: crashing on purpose" in done.stderr  # last lines of the rank's log
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)


def test_max_restarts_recovers_from_one_crash_and_keeps_per_rank_logs(tmp_path):
    tag = new_tag()
    logs = tmp_path / "logs"
    try:
        done = _launch(tmp_path, tag, ["--num_procs", "2", "--max_restarts", "1", "--enable_each_rank_log",
                                       str(logs), "--save_pid"], ["--crash-once", "0"])
        assert done.returncode == 0, done.stderr
        assert [r["attempt"] for r in read_ranks(tmp_path / "out", 2)] == ["1", "1"]
        assert "crashing on purpose" in (logs / "rank0.stderr.log").read_text()  # first attempt
        assert "all-reduce sum 3.0" in (logs / "rank0.attempt1.stdout.log").read_text()  # second attempt
        assert "all-reduce sum 3.0" in (logs / "rank1.attempt1.stdout.log").read_text()
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    tag = new_tag()
    out = tmp_path / "out"
    launcher = None
    try:
        launcher = _start_hanging_job(tmp_path, tag)
        pid_file = Path(f"/tmp/dsrun-{launcher.pid}-node0.json")
        saved = json.loads(pid_file.read_text())  # --save_pid: the agent's and the ranks' PIDs
        assert sorted(saved["ranks"].values()) == sorted(int((out / f"rank{r}.pid").read_text()) for r in (0, 1))
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGTERM
        assert "dsrun: stopped by SIGTERM" in stderr
        assert wait_until_gone(tag, 5) == []
        assert not pid_file.exists()
    finally:
        kill_job(tag)


def test_bind_cores_to_rank_pins_each_rank_to_its_share(tmp_path):
    tag = new_tag()
    cores = sorted(os.sched_getaffinity(0))[:2]
    try:
        done = _launch(tmp_path, tag, ["--num_procs", "2", "--bind_cores_to_rank", "--bind_core_list",
                                       ",".join(map(str, cores))])
        if len(cores) < 2:  # a one-core machine: the plan is refused before anything starts
            assert done.returncode == 2 and "has 1 cores for 2 ranks per node" in done.stderr
            return
        assert done.returncode == 0, done.stderr
        reports = read_ranks(tmp_path / "out", 2)
        assert [r["affinity"] for r in reports] == [[cores[0]], [cores[1]]]
        assert [r["OMP_NUM_THREADS"] for r in reports] == ["1", "1"]
    finally:
        kill_job(tag)


def test_module_mode_runs_python_dash_m(tmp_path):
    tag = new_tag()
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text(
        "import os, sys\nprint('hello from', os.environ['RANK'], 'args', sys.argv[1:])\n")
    try:
        done = subprocess.run(dsrun_launch("--num_procs", "2", "--master_port", str(free_port()), "--module",
                                           "userpkg.hello", "--flag", "a b"),
                              env=job_env(tag, tmp_path, PYTHONPATH=f"{tmp_path}:{job_env(tag)['PYTHONPATH']}"),
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "hello from 1 args ['--flag', 'a b', '--local_rank=1']" in done.stdout
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)


def test_ranks_die_with_a_killed_agent_and_the_launcher_says_so(tmp_path):
    """No orphans even when the node agent itself is SIGKILLed: its ranks die with it (PDEATHSIG)."""
    tag = new_tag()
    out = tmp_path / "out"
    launcher = None
    try:
        launcher = _start_hanging_job(tmp_path, tag)
        agent = json.loads(Path(f"/tmp/dsrun-{launcher.pid}-node0.json").read_text())["agent"]
        os.kill(agent, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGKILL
        assert "the agent for localhost exited with code -9 (SIGKILL) before any rank reported" in stderr
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)
        if launcher is not None:
            Path(f"/tmp/dsrun-{launcher.pid}-node0.json").unlink(missing_ok=True)


def test_elastic_training_on_one_node_restarts_after_a_crash(tmp_path):
    """With --elastic_training the agent meets itself in the c10d rendezvous; a crashed rank restarts the group
    in a new round (DeepSpeed's 100 restarts by default) and the job succeeds."""
    tag = new_tag()
    try:
        done = _launch(tmp_path, tag, ["--num_procs", "2", "--elastic_training", "--rdzv_last_call_timeout", "1"],
                       ["--crash-once", "1"], timeout=180)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "out" / "crashed1").exists()
        assert [r["sum"] for r in read_ranks(tmp_path / "out", 2)] == [3.0, 3.0]
        assert done.stderr.count("elastic round: localhost is node 0 of 1; world size 2") == 2
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)
