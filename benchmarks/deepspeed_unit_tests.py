"""DeepSpeed's own CPU-runnable unit tests, unmodified, through the ``deepspeed`` alias (issue 30's acceptance).

Fetch DeepSpeed's ``tests/`` folder into a scratch directory (never into this repo), e.g. from a clone:
``git -C DeepSpeed archive HEAD tests | tar -x -C /tmp/ds``, then::

    PYTHONPATH=$PWD python benchmarks/deepspeed_unit_tests.py /tmp/ds/tests [--verbose]

Each file runs in its own pytest process from DeepSpeed's ``tests/`` folder with ``dsrun/alias/site`` and this
repo first on ``PYTHONPATH`` and ``LOCAL_SIZE=4`` (how DeepSpeed's CPU accelerator counts devices, so its
``DistributedTest`` runs 2-rank tests), and DeepSpeed's commands (``deepspeed``, ``ds_report``, ``ds_elastic``,
written by ``dsrun alias install-bin`` into a temporary folder) first on ``PATH``. Prints passed/failed/skipped per file, whether it collected, and the
total pass rate. ``--verbose`` lists each failed test with the last line of its error.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from dsrun.alias.commands import temporary_bin

REPO = Path(__file__).resolve().parents[1]
FILES = [
    "unit/runtime/test_lr_schedulers.py", "unit/runtime/test_ds_config_dict.py",
    "unit/checkpoint/test_tag_validation.py", "unit/checkpoint/test_latest_checkpoint.py",
    "unit/launcher/test_run.py", "unit/launcher/test_multinode_runner.py", "unit/launcher/test_ds_arguments.py",
    "unit/runtime/zero/test_zero_config.py", "unit/monitor/test_monitor.py", "unit/elasticity/test_elastic.py",
    "unit/launcher/test_user_args.py", "unit/ops/muon/test_muon_partial_training.py",
]


def run_file(tests: Path, name: str, timeout: int, bin_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'dsrun/alias/site'}:{REPO}", "LOCAL_SIZE": "4",
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "pytest", name, "-q", "-rfE", "-p", "no:cacheprovider", "--color=no",
           "-o", "addopts=", "--durations=0"]
    try:
        out = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        out += "\nTIMEOUT"
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # DeepSpeed's conftest forces colour
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)\b", out.splitlines()[-1]
                                                if out.strip() else "")}
    failures = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    collected = "error" not in counts and "errors" not in counts or bool(counts.get("passed"))
    if "ERROR collecting" in out or "errors during collection" in out or "TIMEOUT" in out:
        collected = False
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("errors", 0)
            + counts.get("error", 0), "skipped": counts.get("skipped", 0), "collected": collected,
            "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", type=Path, help="DeepSpeed's tests/ folder")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per file")
    parser.add_argument("--only", nargs="*", help="run only these files (as listed in FILES)")
    args = parser.parse_args()
    total_pass = total_run = 0
    bin_dir = temporary_bin()  # DeepSpeed's commands, as `dsrun alias install-bin DIR` writes them
    print(f"{'file':45} collects  passed  failed  skipped")
    for name in args.only or FILES:
        r = run_file(args.tests, name, args.timeout, bin_dir)
        total_pass += r["passed"]
        total_run += r["passed"] + r["failed"]
        print(f"{name[5:]:45} {'yes' if r['collected'] else 'NO':8} {r['passed']:6} {r['failed']:7} {r['skipped']:8}",
              flush=True)
        if args.verbose:
            for line in r["failures"]:
                print("    " + line[:220])
    rate = 100.0 * total_pass / total_run if total_run else 0.0
    print(f"total: {total_pass} of {total_run} passed ({rate:.0f}%), load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
