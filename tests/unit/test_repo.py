"""The repository keeps its promises to a new user: README commands, CI, top-level layout."""
import os
import re
import subprocess
import sys

from tests.helpers import REPO, SYSTEM_PACKAGES


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_ci_runs_the_readme_test_command():
    """One command in the README runs the tests on a fresh machine; CI runs that same command, and it installs
    every system package the tests name when they skip for a missing program."""
    test_command = next(c for c in readme_commands() if "tests/run" in c)
    assert test_command == "tests/run"
    ci_commands = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                   if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci_commands == [test_command]
    assert os.access(REPO / "tests" / "run", os.X_OK)
    packages = re.search(r"PACKAGES=\((.*)\)", (REPO / "tests" / "run").read_text()).group(1).split()
    assert set(SYSTEM_PACKAGES.values()) | {"libaio-dev"} == set(packages)


# Stand-ins for the programs tests/run calls: each logs its arguments; dpkg-query knows the packages in $INSTALLED.
STUBS = {
    "dpkg-query": 'echo "dpkg-query $*" >> "$LOG"; for p in $INSTALLED; do [ "$p" = "${@: -1}" ] && '
                  'printf "install ok installed" && exit 0; done; exit 1',
    "id": 'echo "$FAKE_UID"',
    "apt-get": 'echo "apt-get $*" >> "$LOG"',
    "python": 'echo "python $*" >> "$LOG"',
}


def run_test_command(tmp_path, uid: int, installed: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (stubs / name).chmod(0o755)
    log = tmp_path / f"log-{uid}-{len(installed)}"
    log.write_text("")
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "LOG": str(log), "FAKE_UID": str(uid), "INSTALLED": " ".join(installed),
           "PYTHON": str(stubs / "python")}
    done = subprocess.run([str(REPO / "tests" / "run"), "-m", "not slow"], env=env, capture_output=True, text=True,
                          timeout=60)
    return done, [line for line in log.read_text().splitlines() if not line.startswith("dpkg-query")]


def test_the_test_command_installs_what_is_missing_then_the_project_the_ops_and_runs_pytest(tmp_path):
    everything = ["openssh-server", "openssh-client", "iproute2", "libaio-dev", "openmpi-bin", "slurm-wlm", "munge"]
    after = ["python -m pip install -q torch==2.13.0", "python -m pip install -q -e .[dev]",
             "python -m dsrun ops build --all", "python -m compileall -q dsrun", "python -m pytest -q -ra -m not slow"]
    # root on a fresh machine: apt-get update first, then only the packages that are not there
    done, calls = run_test_command(tmp_path, 0, ["openssh-client", "libaio-dev"])
    assert done.returncode == 0, done.stderr
    assert calls == ["apt-get update -q",
                     "apt-get install -y -q --no-install-recommends openssh-server iproute2 openmpi-bin slurm-wlm "
                     "munge", *after]
    # everything present: apt-get is not run at all
    done, calls = run_test_command(tmp_path, 0, everything)
    assert done.returncode == 0 and calls == after and done.stderr == ""
    # not root: one line naming the missing packages, nothing installed, the tests still run
    done, calls = run_test_command(tmp_path, 1000, everything[:3])
    assert done.returncode == 0 and calls == after
    assert done.stderr.count("\n") == 1 and "missing system packages libaio-dev openmpi-bin" in done.stderr
    assert "apt-get install libaio-dev openmpi-bin" in done.stderr


def test_tests_needing_a_missing_program_are_skipped_naming_its_package(tmp_path):
    """On a fresh machine sshd, ip and mpirun are missing until tests/run installs them: the multi-host and MPI
    tests then skip with the package to install, rather than failing (a PATH without those programs)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    tests = ["tests/integration/launcher/test_mpi.py::test_openmpi_runner_runs_two_ranks",
             "tests/integration/launcher/test_multihost.py::test_ssh_runner_runs_four_ranks_on_two_hosts"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-rs", "-p", "no:cacheprovider", *tests],
                          cwd=REPO, env={**os.environ, "PATH": str(empty)}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "2 skipped" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "needs mpirun: apt-get install openmpi-bin" in done.stdout
    if os.geteuid() == 0:  # without root the multi-host tests skip earlier, for that reason
        assert "needs ip, ssh, ssh-keygen, sshd: apt-get install iproute2 openssh-client openssh-server" in done.stdout


def test_top_level_layout():
    for name in ["dsrun", "recipes", "csrc", "op_builder", "conf", "tests", "examples", "benchmarks",
                 "pyproject.toml", "README.md", ".ci/run"]:
        assert (REPO / name).exists(), name


def test_what_dsrun_writes_into_the_working_directory_is_ignored_by_git():
    """dsrun train / tune / MLflow write outputs/, multirun/, mlruns/ and dsrun tune's results and experiment
    folders (ds.autotuning.results_dir / exps_dir, by default relative to where it runs) into the current
    directory; none of it belongs in a commit."""
    from dsrun.config.misc import AutotuningConfig

    ignored = {line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().splitlines()}
    defaults = AutotuningConfig()
    for name in ("outputs", "multirun", "mlruns", defaults.results_dir, defaults.exps_dir):
        assert name in ignored, name


def test_the_readme_status_reports_the_gpu_runs_docs_cuda_records():
    """docs/cuda.md records what ran on a GPU; the README's status must say so, not that nothing has."""
    status = (REPO / "README.md").read_text().split("## Status", 1)[1].split("\n## ", 1)[0]
    gpu = re.search(r"\*\*NVIDIA (\w+)", (REPO / "docs" / "cuda.md").read_text()).group(1)
    assert "(docs/cuda.md)" in status and gpu in status
    assert "no cuda machine" not in status.lower()


STUCK_IN_C = """
import ctypes
import time

import pytest


@pytest.mark.timeout(1)
def test_stuck_in_c():  # a normal mutex locked twice: a futex wait that pytest-timeout's signal never ends
    mutex = ctypes.create_string_buffer(64)
    ctypes.CDLL(None).pthread_mutex_lock(mutex)
    ctypes.CDLL(None).pthread_mutex_lock(mutex)


@pytest.mark.parametrize("i", range(4))
def test_others(i):
    time.sleep(0.2)
"""


def test_a_test_stuck_in_c_ends_its_worker_with_its_stack_and_the_run_names_it(tmp_path):
    """What hung CI until its own limit: a test stuck where pytest-timeout's signal cannot reach it, on a
    pytest-xdist worker under ``--dist loadgroup``. The watchdog (tests/conftest.py) prints the stuck thread's stack
    and ends the worker; the run then ends, failing that test by name (no replacement worker to wait for)."""
    (tmp_path / "test_stuck.py").write_text(STUCK_IN_C)
    (tmp_path / "conftest.py").write_text("from tests.conftest import _HangWatchdog\n\n\n"
                                          "def pytest_configure(config):\n"
                                          "    config.pluginmanager.register(_HangWatchdog(), 'hang-watchdog')\n")
    addopts = re.search(r'^addopts = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", os.devnull,
                           "--rootdir", str(tmp_path), *addopts.split(), "test_stuck.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DSRUN_TESTS_HANG_MARGIN_S": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r'File ".*test_stuck.py", line \d+ in test_stuck_in_c', done.stderr), done.stderr[-3000:]
    assert "crashed while running 'test_stuck.py::test_stuck_in_c'" in done.stdout, done.stdout[-3000:]
    assert re.search(r"1 failed, \d passed", done.stdout), done.stdout[-3000:]
