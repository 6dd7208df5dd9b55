"""A real multi-host job: two network-namespace hosts with their own sshd, 2 slots each, 4 ranks.

Every test here starts 6+ Python processes that import torch, so each takes 10-30 s on 2 cores: all are
marked slow (they still run in CI)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.helpers import free_port
from tests.integration.launcher.jobs import (EXAMPLE, dsrun_launch, job_env, kill_job, new_tag, read_ranks,
                                             wait_for_files, wait_until_gone)

pytestmark = [pytest.mark.multihost]


def _check_four_ranks(out, hosts) -> None:
    reports = read_ranks(out, 4)
    for rank, report in enumerate(reports):
        assert report["RANK"] == str(rank)
        assert report["LOCAL_RANK"] == str(rank % 2) and report["local_rank_arg"] == rank % 2
        assert report["WORLD_SIZE"] == "4" and report["LOCAL_WORLD_SIZE"] == "2"
        assert report["CROSS_RANK"] == str(rank // 2) and report["CROSS_SIZE"] == "2"
        assert report["MASTER_ADDR"] == hosts.a.address
        assert report["sum"] == 10.0  # 1 + 2 + 3 + 4 through a real cross-host all-reduce
    # ranks 0-1 ran on host A, 2-3 on host B (each namespace is its own network stack)
    assert [r["netns"] for r in reports] == [hosts.a.netns_inode] * 2 + [hosts.b.netns_inode] * 2


def _ssh_job(hosts, out, flags: tuple[str, ...] = (), script_args: tuple[str, ...] = ()) -> list[str]:
    return hosts.in_namespace(hosts.a, dsrun_launch(
        "-H", str(hosts.hostfile()), "--launcher", "ssh", "--launcher_args", f"-F {hosts.ssh_config}",
        "--master_port", str(free_port()), *flags, EXAMPLE, "--out", str(out), *script_args))


@pytest.mark.slow
def test_ssh_runner_runs_four_ranks_on_two_hosts(two_hosts, tmp_path):
    tag = new_tag()
    try:
        done = subprocess.run(_ssh_job(two_hosts, tmp_path / "out"), env=job_env(tag, tmp_path), capture_output=True,
                              text=True, timeout=120, cwd=two_hosts.job_dir(tmp_path))
        assert done.returncode == 0, done.stderr
        _check_four_ranks(tmp_path / "out", two_hosts)
        assert f"[{two_hosts.b.address}] [rank3]:rank 3/4: all-reduce sum 10.0" in done.stdout
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)


@pytest.mark.slow
def test_no_ssh_mode_runs_one_launcher_per_host(two_hosts, tmp_path):
    tag = new_tag()
    port = str(free_port())
    out = tmp_path / "out"
    hostfile = str(two_hosts.hostfile())
    try:
        launchers = [
            subprocess.Popen(two_hosts.in_namespace(host, dsrun_launch(
                "-H", hostfile, "--no_ssh", "--node_rank", str(node_rank), "--master_addr", two_hosts.a.address,
                "--master_port", port, EXAMPLE, "--out", str(out))),
                env=job_env(tag, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                cwd=two_hosts.job_dir(tmp_path))
            for node_rank, host in enumerate((two_hosts.a, two_hosts.b))]
        for launcher in launchers:
            _, stderr = launcher.communicate(timeout=120)
            assert launcher.returncode == 0, stderr
        _check_four_ranks(out, two_hosts)
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)


@pytest.mark.slow
def test_sigkill_of_a_rank_on_host_b_stops_every_rank_and_names_it(two_hosts, tmp_path):
    tag = new_tag()
    out = tmp_path / "out"
    try:
        launcher = subprocess.Popen(_ssh_job(two_hosts, out, ("--enable_each_rank_log", str(tmp_path / "logs")),
                                             ("--hang",)),
                                    env=job_env(tag, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True,
                                    cwd=two_hosts.job_dir(tmp_path))
        pid_files = [out / f"rank{rank}.pid" for rank in range(4)]
        wait_for_files(pid_files, timeout=90, process=launcher)
        pids = [int(p.read_text()) for p in pid_files]
        killed_at = time.monotonic()
        os.kill(pids[3], signal.SIGKILL)  # rank 3 runs on host B

        deadline = killed_at + 10
        while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [rank for rank, pid in enumerate(pids) if _alive(pid)]
        assert survivors == [], f"ranks {survivors} still running 10 s after rank 3 was killed"
        print(f"all ranks gone {time.monotonic() - killed_at:.2f} s after SIGKILL of rank 3")

        _, stderr = launcher.communicate(timeout=30)
        assert launcher.returncode != 0
        summary = stderr[stderr.index("dsrun: job failed"):]
        assert "rank 3 (local rank 1) on host 10.213.77.2" in summary
        assert "exit code -9 (SIGKILL)" in summary
        assert "rank 3/4: all-reduce sum 10.0" in summary  # the last lines of rank 3's log
        assert launcher.returncode == 128 + signal.SIGKILL
        assert wait_until_gone(tag, 5) == [], "processes of the job are left over"
    finally:
        kill_job(tag)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.slow
def test_max_restarts_survives_a_crash_on_host_b(two_hosts, tmp_path):
    tag = new_tag()
    try:
        done = subprocess.run(_ssh_job(two_hosts, tmp_path / "out", ("--max_restarts", "1"), ("--crash-once", "3")),
                              env=job_env(tag, tmp_path), capture_output=True, text=True, timeout=180,
                              cwd=two_hosts.job_dir(tmp_path))
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "out" / "crashed3").exists()  # the crash did happen
        reports = read_ranks(tmp_path / "out", 4)
        assert [r["attempt"] for r in reports] == ["1"] * 4  # every rank finished in the restarted group
        assert all(r["sum"] == 10.0 for r in reports)
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "launcher-killed"])
def test_stopping_the_launcher_stops_every_rank_on_every_host(two_hosts, tmp_path, sig):
    """Ctrl-C stops the job cleanly; even a SIGKILLed launcher leaves no process of the job behind (its ssh
    clients die with it, and each remote agent stops its ranks when its ssh connection closes)."""
    tag = new_tag()
    out = tmp_path / "out"
    try:
        launcher = subprocess.Popen(_ssh_job(two_hosts, out, script_args=("--hang",)), env=job_env(tag, tmp_path),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=two_hosts.job_dir(tmp_path))
        wait_for_files([out / f"rank{rank}.pid" for rank in range(4)], timeout=90, process=launcher)
        stopped_at = time.monotonic()
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
        if sig == signal.SIGINT:
            assert launcher.returncode == 130
            assert "dsrun: stopped by SIGINT; all ranks on 2 host(s) were stopped" in stderr
        left = wait_until_gone(tag, 40)  # generous: a loaded machine delays SIGTERM handling
        assert left == [], f"processes of the job left after {sig.name} of the launcher: {left}"
        print(f"every process of the job gone {time.monotonic() - stopped_at:.2f} s after {sig.name}")
    finally:
        kill_job(tag)


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["kill-rank", "sigterm-launcher"])
def test_no_ssh_mode_stopping_host_b_stops_idle_ranks_on_host_a(two_hosts, tmp_path, stop):
    """Ranks that sleep never notice a dead peer themselves: only the agents' fan-out through the job store
    can stop them, with no ssh connection to close. Host B loses a rank, or its launcher gets SIGTERM."""
    tag = new_tag()
    port = str(free_port())
    out = tmp_path / "out"
    hostfile = str(two_hosts.hostfile())
    try:
        launchers = [
            subprocess.Popen(two_hosts.in_namespace(host, dsrun_launch(
                "-H", hostfile, "--no_ssh", "--node_rank", str(node_rank), "--master_addr", two_hosts.a.address,
                "--master_port", port, EXAMPLE, "--out", str(out), "--idle")),
                env=job_env(tag, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                cwd=two_hosts.job_dir(tmp_path))
            for node_rank, host in enumerate((two_hosts.a, two_hosts.b))]
        pid_files = [out / f"rank{rank}.pid" for rank in range(4)]
        wait_for_files(pid_files, timeout=90, process=launchers[0])
        pids = [int(p.read_text()) for p in pid_files]
        killed_at = time.monotonic()
        if stop == "kill-rank":
            os.kill(pids[2], signal.SIGKILL)  # rank 2: host B, local rank 0
        else:
            launchers[1].send_signal(signal.SIGTERM)
        while any(_alive(pid) for pid in pids) and time.monotonic() < killed_at + 10:
            time.sleep(0.05)
        assert [rank for rank, pid in enumerate(pids) if _alive(pid)] == []
        print(f"idle ranks gone {time.monotonic() - killed_at:.2f} s after {stop} on host B")
        stderr_a = launchers[0].communicate(timeout=30)[1]
        stderr_b = launchers[1].communicate(timeout=30)[1]
        if stop == "kill-rank":  # both launchers fail and name the same cause
            for launcher, stderr in zip(launchers, (stderr_a, stderr_b)):
                assert launcher.returncode == 128 + signal.SIGKILL, stderr
                assert "job failed: rank 2 (local rank 0) on host 10.213.77.2 exited with exit code -9" in stderr
        else:
            assert launchers[1].returncode == 128 + signal.SIGTERM
            assert launchers[0].returncode != 0
            assert "dsrun: job failed: the agent on 10.213.77.2 was stopped by SIGTERM" in stderr_a
        assert wait_until_gone(tag, 5) == []
    finally:
        kill_job(tag)
