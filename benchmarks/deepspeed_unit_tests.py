"""DeepSpeed's own CPU-runnable unit tests, unmodified, through the ``deepspeed`` alias (issues 30 and 43).

Fetch DeepSpeed's ``tests/`` folder into a scratch directory (never into this repo), e.g. from a clone:
``git -C DeepSpeed archive HEAD tests | tar -x -C /tmp/ds``, then::

    PYTHONPATH=$PWD python benchmarks/deepspeed_unit_tests.py /tmp/ds/tests [--verbose]

Each file runs in its own pytest process from DeepSpeed's ``tests/`` folder with ``LOCAL_SIZE=4`` (how DeepSpeed's
CPU accelerator counts devices, so its ``DistributedTest`` runs 2-rank tests) and DeepSpeed's commands
(``deepspeed``, ``ds_report``, ``ds_elastic``) first on ``PATH``. ``--side dsrun`` (the default) puts
``dsrun/alias/site`` and this repo first on ``PYTHONPATH`` and the commands ``dsrun alias install-bin`` writes on
``PATH``; ``--side deepspeed`` runs the same file under a Python that has DeepSpeed itself installed
(``--deepspeed-python``, default ``/tmp/dsvenv/bin/python``, and that environment's ``bin/`` on ``PATH``);
``--side both`` runs each file on both sides, one after the other. Which files: the tracked list ``FILES`` (the
default), ``--only FILE...``, ``--all`` (every ``test_*.py`` under ``unit/``; a file that does not collect is
reported so) or ``--sample`` (``SAMPLE``: the tracked files and the mostly non-CUDA files measured for issue 43,
docs/deepspeed-alias.md). Prints passed/failed/skipped per file and side, whether it collected, the total pass
rate per side, the files DeepSpeed passes more of, and the causes (each failed test's last error line, counted).
``--verbose`` lists each failed test; ``--json OUT`` keeps every result for the docs' table.
"""
from __future__ import annotations

import argparse
import collections
import json
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
# issue 43's sample beyond FILES: files whose tests are mostly CPU-runnable and in-process (cheap on both sides)
SAMPLE = [
    "unit/utils/test_groups.py", "unit/utils/test_get_optim_files.py", "unit/utils/test_pin_memory_tracker.py",
    "unit/runtime/utils/test_partition.py", "unit/runtime/pipe/test_topology.py", "unit/comm/test_comms_logger.py",
    "unit/runtime/test_precision_config_dynamic_scale.py", "unit/runtime/test_precision_config_loss_scale.py",
    "unit/v1/test_engine_log_level.py", "unit/utils/test_byte_cast.py",
] + FILES + [
    "unit/runtime/test_ds_config_model.py", "unit/sequence/test_apply_rotary_pos_emb.py",
    "unit/utils/test_partition_balanced.py", "unit/utils/test_init_on_device.py", "unit/runtime/test_runtime_utils.py",
    "unit/runtime/test_data.py", "unit/runtime/sparse_tensor/test_csr.py", "unit/runtime/pipe/test_pipe_schedule.py",
    "unit/runtime/half_precision/test_dynamic_loss_scale.py", "unit/inference/test_inference_config.py",
    "unit/v1/half_precision/test_gradient_clipping_default.py", "unit/ops/adagrad/test_cpu_adagrad.py",
    "unit/runtime/zero/test_zero_tiled.py",
    # ZeRO-3 partitioner internals (issue 43's fourth session)
    "unit/v1/zero/test_zero_init_pg_contradiction.py", "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_late_module_attach.py", "unit/runtime/zero/test_zero_linear_direct_init.py",
    "unit/runtime/zero/test_zero_context.py", "unit/runtime/zero/test_zeropp.py",
    "unit/runtime/zero/test_zero_leaf_module.py", "unit/runtime/zero/test_zero_autocast_mixed_dtype.py",
]
DEEPSPEED_PYTHON = "/tmp/dsvenv/bin/python"


def side_env(side: str, bin_dir: Path, deepspeed_python: str) -> tuple[str, dict]:
    """The Python and environment one side's pytest runs with."""
    env = {**os.environ, "LOCAL_SIZE": "4", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    if side == "dsrun":
        env.update(PYTHONPATH=f"{REPO / 'dsrun/alias/site'}:{REPO}", PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
        return sys.executable, env
    env.pop("PYTHONPATH", None)  # DeepSpeed's own side must not see the alias
    env["PATH"] = f"{Path(deepspeed_python).parent}{os.pathsep}{env['PATH']}"
    return deepspeed_python, env


def run_file(tests: Path, name: str, timeout: int, python: str, env: dict) -> dict:
    cmd = [python, "-m", "pytest", name, "-q", "-rfE", "-p", "no:cacheprovider", "--color=no",
           "-o", "addopts=", "--durations=0"]
    try:
        out = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        out += "\nTIMEOUT"
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # DeepSpeed's conftest forces colour
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|skipped|error)",
                                                                              line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary)}
    failures = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    collected = not ("ERROR collecting" in out or "errors during collection" in out or "TIMEOUT" in out
                     or "no tests ran" in out and not counts)
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("errors", 0)
            + counts.get("error", 0), "skipped": counts.get("skipped", 0), "collected": collected,
            "timed_out": "TIMEOUT" in out, "failures": failures}


def cause_of(failure: str) -> str:
    """A failed test's cause: its error line without the test's id and parameters."""
    cause = failure.split(" - ", 1)[1] if " - " in failure else failure.split(" ", 1)[0] + " (no message)"
    return re.sub(r"0x[0-9a-f]+|/tmp/\S+", "...", cause)[:160]


def files_to_run(args: argparse.Namespace) -> list[str]:
    if args.all:
        return sorted(str(p.relative_to(args.tests)) for p in (args.tests / "unit").rglob("test_*.py"))
    return args.only or (SAMPLE if args.sample else FILES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", type=Path, help="DeepSpeed's tests/ folder")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per file and side")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--only", nargs="*", help="run only these files (paths under tests/, unit/...)")
    which.add_argument("--all", action="store_true", help="every test_*.py under unit/")
    which.add_argument("--sample", action="store_true", help="issue 43's measured sample (SAMPLE)")
    parser.add_argument("--side", choices=("dsrun", "deepspeed", "both"), default="dsrun")
    parser.add_argument("--deepspeed-python", default=DEEPSPEED_PYTHON, help="a Python with DeepSpeed installed")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args()
    sides = ("deepspeed", "dsrun") if args.side == "both" else (args.side,)
    bin_dir = temporary_bin()  # DeepSpeed's commands, as `dsrun alias install-bin DIR` writes them
    envs = {side: side_env(side, bin_dir, args.deepspeed_python) for side in sides}
    results: dict[str, dict[str, dict]] = {}
    print(f"{'file':50} {'side':9} collects  passed  failed  skipped")
    for name in files_to_run(args):
        for side in sides:
            r = run_file(args.tests, name, args.timeout, *envs[side])
            results.setdefault(name, {})[side] = r
            print(f"{name[5:]:50} {side:9} {'yes' if r['collected'] else 'NO':8} {r['passed']:6} {r['failed']:7} "
                  f"{r['skipped']:8}{'  (timed out)' if r['timed_out'] else ''}", flush=True)
            if args.verbose:
                for line in r["failures"]:
                    print("    " + line[:220])
    for side in sides:
        passed = sum(r[side]["passed"] for r in results.values())
        ran = sum(r[side]["passed"] + r[side]["failed"] for r in results.values())
        uncollected = [n for n, r in results.items() if not r[side]["collected"]]
        print(f"{side}: {passed} of {ran} passed ({100.0 * passed / ran if ran else 0.0:.0f}%), "
              f"{len(uncollected)} files not collected: {' '.join(n[5:] for n in uncollected)}")
    if len(sides) == 2:
        ds_passed = sum(r["deepspeed"]["passed"] for r in results.values())
        both = sum(min(r["deepspeed"]["passed"], r["dsrun"]["passed"]) for r in results.values())
        print(f"dsrun passes {both} of the {ds_passed} DeepSpeed passes, counted per file "
              f"({100.0 * both / ds_passed if ds_passed else 0.0:.0f}%)")
        behind = [n for n, r in results.items() if r["dsrun"]["passed"] < r["deepspeed"]["passed"]]
        print("files where DeepSpeed passes more:", " ".join(n[5:] for n in behind) or "none")
    causes = collections.Counter(cause_of(f) for r in results.values() for f in r.get("dsrun", {}).get("failures", []))
    if causes:
        print("dsrun's causes (failed tests per error line):")
        for cause, n in causes.most_common():
            print(f"  {n:4}  {cause}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
