"""Helpers for tests that run real launcher jobs: start ``dsrun launch``, read what the ranks reported,
find (and, in cleanup, kill) every process of a job by a tag in its environment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.helpers import REPO

EXAMPLE = str(REPO / "examples" / "launch_allreduce.py")
TAG_VARIABLE = "PYTHON_DSRUN_TEST_TAG"  # a PYTHON* name, so the launcher exports it to every node


def new_tag() -> str:
    return uuid.uuid4().hex


def job_env(tag: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env[TAG_VARIABLE] = tag
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def dsrun_launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsrun", "launch", *args]


def job_processes(tag: str) -> list[int]:
    """PIDs of live processes whose environment carries ``tag`` (launchers, ssh clients, agents, ranks)."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != b"Z":
            found.append(int(entry))
    return found


def wait_until_gone(tag: str, timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for the job's processes to end; return those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = job_processes(tag)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def kill_job(tag: str) -> None:
    """Cleanup after a failed test: SIGKILL every process carrying this test's tag."""
    for pid in job_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_ranks(out: Path, world_size: int) -> list[dict]:
    reports = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report; files: {sorted(p.name for p in out.iterdir())}"
        reports.append(json.loads(path.read_text()))
    return reports


def wait_for_files(paths: list[Path], timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        if process is not None and process.poll() is not None:
            raise AssertionError(f"launcher exited with {process.returncode} before the ranks were ready:\n"
                                 f"{process.communicate()[1]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks not ready within {timeout}s: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.1)
