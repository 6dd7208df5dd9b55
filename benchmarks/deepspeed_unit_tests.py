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
``--verbose`` lists each failed test; ``--json OUT`` keeps every result for the docs' table (written after each
file, merged with ``--reuse``).

**The acceptance's denominator** (issue 43: "every CPU-runnable DeepSpeed unit file collects, dsrun passes >= 90%
of what DeepSpeed passes"): a file is in it when DeepSpeed 0.19.8 itself passes at least one of its tests on this
CPU. Whenever DeepSpeed's side was run (or is read back with ``--reuse FILE``, a ``--json`` of an earlier run; a
file and side found there is not run again), the benchmark prints each file that is out and why: DeepSpeed does
not collect it here (its first exception line, e.g. a CUDA-only kernel or ``triton`` missing), every test skips
(the most common skip reason), every test fails (the first cause), or DeepSpeed did not finish it in time (not
measured). Over the files in the denominator run on both sides it prints which dsrun does not collect and
dsrun's passes as a share of DeepSpeed's, counted per file. ``--denominator`` runs exactly the files whose stored
DeepSpeed result is in it; ``benchmarks/deepspeed_unit_results.json`` holds DeepSpeed's side as measured for
the docs. ``--collect-only`` only asks each side whether each file collects (one ``pytest --collect-only`` per
side, nothing runs)::

    PYTHONPATH=$PWD python benchmarks/deepspeed_unit_tests.py /tmp/ds/tests --all --collect-only --side both
    PYTHONPATH=$PWD python benchmarks/deepspeed_unit_tests.py /tmp/ds/tests --side both --denominator \
        --reuse benchmarks/deepspeed_unit_results.json --json /tmp/both.json

A file that runs past ``--timeout`` is ended with every process it started; the tests its verbose progress lines
show finished are still counted (a lower bound, marked "timed out").
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
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
    # in DeepSpeed's denominator, collected since issue 43's sixth session (pinned memory, rollout, ZenFlow's
    # selective AdamW, tiled compute) and issue 40's TP-plan names
    "unit/v1/pin_memory/test_pin_memory.py", "unit/v1/pin_memory/test_pin_memory_op.py",
    "unit/v1/pin_memory/test_destroy_unpin.py", "unit/ops/adam/test_zf_torch_adam.py",
    "unit/runtime/rollout/test_rollout_interface.py", "unit/runtime/rollout/test_hybrid_engine_rollout.py",
    "unit/ulysses_alst/test_tiled_compute.py", "unit/module_inject/test_tp_plan_converter.py",
    "unit/runtime/test_tp_plan_extraction.py", "unit/model_parallelism/test_tp_plan_real_models.py",
]
DEEPSPEED_PYTHON = "/tmp/dsvenv/bin/python"


def side_env(side: str, bin_dir: Path, deepspeed_python: str) -> tuple[str, dict]:
    """The Python and environment one side's pytest runs with."""
    env = {**os.environ, "LOCAL_SIZE": "4", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONUNBUFFERED": "1"}  # unbuffered: a file that times out still shows the tests it finished
    if side == "dsrun":
        env.update(PYTHONPATH=f"{REPO / 'dsrun/alias/site'}:{REPO}", PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
        return sys.executable, env
    env.pop("PYTHONPATH", None)  # DeepSpeed's own side must not see the alias
    env["PATH"] = f"{Path(deepspeed_python).parent}{os.pathsep}{env['PATH']}"
    return deepspeed_python, env


def _pytest_output(cmd: list[str], tests: Path, env: dict, timeout: int) -> str:
    """A pytest run's stdout without colour codes, ``TIMEOUT`` appended when it ran past ``timeout``. It runs in a
    process group of its own, so that a timeout ends the ranks and pool workers a DistributedTest started too."""
    proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0] + "\nTIMEOUT"
    return re.sub(r"\x1b\[[0-9;]*m", "", out)  # DeepSpeed's conftest forces colour


def run_file(tests: Path, name: str, timeout: int, python: str, env: dict) -> dict:
    cmd = [python, "-m", "pytest", name, "-q", "-rfEs", "-p", "no:cacheprovider", "--color=no",
           "-o", "addopts=", "--durations=0"]
    out = _pytest_output(cmd, tests, env, timeout)
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|skipped|error)",
                                                                              line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary)}
    if "TIMEOUT" in out:  # no summary: count what the verbose progress lines say finished (a lower bound)
        outcomes = re.findall(r"^unit/\S+::\S+.*?\b(PASSED|FAILED|SKIPPED|ERROR)\b", out, re.M)
        counts = {k: outcomes.count(word) for k, word in (("passed", "PASSED"), ("failed", "FAILED"),
                                                          ("skipped", "SKIPPED"), ("errors", "ERROR"))}
    failures = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    collected = not ("ERROR collecting" in out or "errors during collection" in out
                     or ("no tests ran" in out or "TIMEOUT" in out) and not any(counts.values()))
    collect_error = ""  # why a file does not collect: the first exception line pytest prints for it
    if "ERROR collecting" in out:
        collect_error = next((line[1:].strip() for line in out.split("ERROR collecting", 1)[1].splitlines()
                              if re.match(r"E\s+\w+(Error|Exception)\b", line)), "")
    skips = [(int(n), reason.strip()) for n, reason in re.findall(r"^SKIPPED \[(\d+)\] \S+?:\d+: (.*)$", out, re.M)]
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("errors", 0)
            + counts.get("error", 0), "skipped": counts.get("skipped", 0), "collected": collected,
            "timed_out": "TIMEOUT" in out, "failures": failures, "collect_error": collect_error, "skips": skips}


def collection_errors(tests: Path, names: list[str], timeout: int, python: str, env: dict) -> dict[str, str]:
    """One ``pytest --collect-only`` over ``names`` (cheap: nothing runs): each file that does not collect, with
    pytest's one-line reason."""
    cmd = [python, "-m", "pytest", *names, "--collect-only", "-q", "-p", "no:cacheprovider", "--color=no",
           "-o", "addopts=", "--continue-on-collection-errors"]
    out = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout).stdout
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)
    return {m.group(1): m.group(2) for m in re.finditer(r"^ERROR (unit/\S+\.py)(?: - (.*))?$", out, re.M)}


def run_batch(tests: Path, names: list[str], timeout: int, python: str, env: dict) -> dict[str, dict]:
    """``names`` in one pytest process (one import of the library: cheap for files whose tests mostly skip or fail
    fast), split per file from pytest's verbose progress lines, its collection errors and its summary lines."""
    cmd = [python, "-m", "pytest", *names, "-q", "-rfEs", "-p", "no:cacheprovider", "--color=no", "-o", "addopts=",
           "--continue-on-collection-errors"]
    out = _pytest_output(cmd, tests, env, timeout)
    results = {}
    for name in names:
        mine = [m for m in re.findall(r"^(unit/\S+?\.py)::\S+.*?\b(PASSED|FAILED|SKIPPED|ERROR)\b", out, re.M)
                if m[0] == name]
        count = collections.Counter(word for _, word in mine)
        error = re.search(rf"^ERROR {re.escape(name)}(?: - (.*))?$", out, re.M)
        skips = [(int(n), reason.strip()) for n, reason in
                 re.findall(rf"^SKIPPED \[(\d+)\] {re.escape(name)}:\d+: (.*)$", out, re.M)]
        results[name] = {  # no outcome seen at all: not reached before the time ran out (not measured)
            "passed": count["PASSED"], "failed": count["FAILED"] + count["ERROR"],
            "skipped": max(count["SKIPPED"], sum(n for n, _ in skips)),
            "collected": error is None, "timed_out": not mine and not skips and error is None,
            "failures": [line for line in out.splitlines() if line.startswith((f"FAILED {name}::", f"ERROR {name}::"))],
            "collect_error": (error.group(1) or "") if error else "", "skips": skips, "batch": True}
    return results


def classify(deepspeed: dict) -> str:
    """Whether DeepSpeed itself runs a file on this CPU (its result, one side): "" when it passes at least one test
    (the file is in the acceptance's denominator), else the reason it is out, in one line."""
    if deepspeed["passed"]:
        return ""
    if deepspeed["timed_out"]:
        return "not measured: DeepSpeed did not finish the file (or show any outcome of it) in the time given"
    if not deepspeed["collected"]:
        return f"DeepSpeed does not collect it on a CPU: {deepspeed.get('collect_error') or 'collection error'}"
    if deepspeed["failed"]:
        top = collections.Counter(cause_of(f) for f in deepspeed["failures"]).most_common(1)
        skipped = f", {deepspeed['skipped']} skipped" if deepspeed["skipped"] else ""
        return f"DeepSpeed passes none of its {deepspeed['failed']}{skipped} (first cause: {top[0][0] if top else '?'})"
    if deepspeed["skipped"]:
        reasons = collections.Counter()
        for n, reason in deepspeed.get("skips", []):
            reasons[reason[:120]] += n
        top = reasons.most_common(1)
        return f"DeepSpeed skips all {deepspeed['skipped']} on a CPU ({top[0][0] if top else 'no reason given'})"
    return "DeepSpeed collects no test of it"


def cause_of(failure: str) -> str:
    """A failed test's cause: its error line without the test's id and parameters."""
    cause = failure.split(" - ", 1)[1] if " - " in failure else failure.split(" ", 1)[0] + " (no message)"
    return re.sub(r"0x[0-9a-f]+|/tmp/\S+", "...", cause)[:160]


def files_to_run(args: argparse.Namespace, stored: dict[str, dict[str, dict]]) -> list[str]:
    if args.all:
        return sorted(str(p.relative_to(args.tests)) for p in (args.tests / "unit").rglob("test_*.py"))
    if args.denominator:
        return sorted(name for name, r in stored.items() if "deepspeed" in r and not classify(r["deepspeed"]))
    return args.only or (SAMPLE if args.sample else FILES)


def report_denominator(results: dict[str, dict[str, dict]]) -> None:
    """The acceptance's denominator: the files DeepSpeed itself passes a test of on this CPU, each other file with
    the reason it is out; then, over the denominator, what dsrun collects and passes."""
    measured = {name: r for name, r in results.items() if "deepspeed" in r}
    out = {name: classify(r["deepspeed"]) for name, r in measured.items()}
    inside = sorted(name for name, reason in out.items() if not reason)
    print(f"DeepSpeed on this CPU: {len(inside)} of {len(measured)} files pass at least one test (the denominator); "
          f"the {len(measured) - len(inside)} others, and why:")
    for name in sorted(n for n, reason in out.items() if reason):
        print(f"  {name[5:]:58} {out[name][:200]}")
    both = [name for name in inside if "dsrun" in results[name]]
    if not both:
        return
    uncollected = [name for name in both if not results[name]["dsrun"]["collected"]]
    ds_passed = sum(results[name]["deepspeed"]["passed"] for name in both)
    dsrun_passed = sum(min(results[name]["deepspeed"]["passed"], results[name]["dsrun"]["passed"]) for name in both)
    print(f"denominator files run on both sides: {len(both)} of {len(inside)}; dsrun collects "
          f"{len(both) - len(uncollected)} (not: {' '.join(n[5:] for n in uncollected) or 'none'}); dsrun passes "
          f"{dsrun_passed} of DeepSpeed's {ds_passed} passes, counted per file "
          f"({100.0 * dsrun_passed / ds_passed if ds_passed else 0.0:.1f}%)")


def write_results(path: Path, stored: dict[str, dict[str, dict]], results: dict[str, dict[str, dict]]) -> None:
    merged = {**stored, **{name: {**stored.get(name, {}), **r} for name, r in results.items()}}
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=1))


def report_collection(args: argparse.Namespace, sides: tuple[str, ...], envs: dict) -> None:
    names = files_to_run(args, json.loads(args.reuse.read_text()) if args.reuse else {})
    errors = {side: collection_errors(args.tests, names, args.timeout, *envs[side]) for side in sides}
    for side in sides:
        print(f"{side}: {len(names) - len(errors[side])} of {len(names)} files collect")
    for name in names:
        if any(name in errors[side] for side in sides):
            status = [f"{side}: {(errors[side][name] or 'error') if name in errors[side] else 'collects'}"
                      for side in sides]
            print(f"  {name[5:]:58} " + "; ".join(status)[:220])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", type=Path, help="DeepSpeed's tests/ folder")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per file and side")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--only", nargs="*", help="run only these files (paths under tests/, unit/...)")
    which.add_argument("--all", action="store_true", help="every test_*.py under unit/")
    which.add_argument("--sample", action="store_true", help="issue 43's measured sample (SAMPLE)")
    which.add_argument("--denominator", action="store_true",
                       help="the files whose DeepSpeed result in --reuse passes at least one test")
    parser.add_argument("--side", choices=("dsrun", "deepspeed", "both"), default="dsrun")
    parser.add_argument("--deepspeed-python", default=DEEPSPEED_PYTHON, help="a Python with DeepSpeed installed")
    parser.add_argument("--reuse", type=Path, help="results of an earlier --json: a file and side found there is "
                        "not run again (e.g. DeepSpeed's side, benchmarks/deepspeed_unit_results.json)")
    parser.add_argument("--json", type=Path, help="write every result here (with those of --reuse)")
    parser.add_argument("--batch", type=int, nargs="?", const=8, default=0, metavar="N",
                        help="run the files N to a pytest process (default 8; results split per file)")
    parser.add_argument("--collect-only", action="store_true",
                        help="only whether each file collects (one pytest --collect-only per side, nothing runs)")
    args = parser.parse_args()
    sides = ("deepspeed", "dsrun") if args.side == "both" else (args.side,)
    bin_dir = temporary_bin()  # DeepSpeed's commands, as `dsrun alias install-bin DIR` writes them
    envs = {side: side_env(side, bin_dir, args.deepspeed_python) for side in sides}
    if args.collect_only:
        report_collection(args, sides, envs)
        return
    stored: dict[str, dict[str, dict]] = json.loads(args.reuse.read_text()) if args.reuse else {}
    results: dict[str, dict[str, dict]] = {}
    print(f"{'file':50} {'side':9} collects  passed  failed  skipped")
    names = files_to_run(args, stored)
    if args.batch:  # one process per side for the files not stored yet; then reported below as if run one by one
        for side in sides:
            todo = [name for name in names if side not in stored.get(name, {})]
            for start in range(0, len(todo), args.batch):
                for name, r in run_batch(args.tests, todo[start:start + args.batch], args.timeout,
                                         *envs[side]).items():
                    stored.setdefault(name, {})[side] = r
                    print(f"  {name[5:]:48} {side}: {r['passed']} passed (one process of {args.batch})", flush=True)
    for name in names:
        for side in sides:
            r = stored.get(name, {}).get(side) or run_file(args.tests, name, args.timeout, *envs[side])
            results.setdefault(name, {})[side] = r
            print(f"{name[5:]:50} {side:9} {'yes' if r['collected'] else 'NO':8} {r['passed']:6} {r['failed']:7} "
                  f"{r['skipped']:8}{'  (timed out)' if r['timed_out'] else ''}"
                  f"{'  (one process)' if r.get('batch') else '  (stored)' if side in stored.get(name, {}) else ''}",
                  flush=True)
            if args.verbose:
                for line in r["failures"]:
                    print("    " + line[:220])
        if args.json:  # after each file, so that an interrupted run keeps what it measured
            write_results(args.json, stored, results)
    for side in sides:
        passed = sum(r[side]["passed"] for r in results.values())
        ran = sum(r[side]["passed"] + r[side]["failed"] for r in results.values())
        uncollected = [n for n, r in results.items() if not r[side]["collected"]]
        print(f"{side}: {passed} of {ran} passed ({100.0 * passed / ran if ran else 0.0:.0f}%), "
              f"{len(uncollected)} files not collected: {' '.join(n[5:] for n in uncollected)}")
    if len(sides) == 2:
        behind = [n for n, r in results.items() if r["dsrun"]["passed"] < r["deepspeed"]["passed"]]
        print("files where DeepSpeed passes more:", " ".join(n[5:] for n in behind) or "none")
    with_stored = {name: {**stored.get(name, {}), **r} for name, r in results.items()}  # the other side, if stored
    if any("deepspeed" in r for r in with_stored.values()):
        report_denominator(with_stored)
    causes = collections.Counter(cause_of(f) for r in results.values() for f in r.get("dsrun", {}).get("failures", []))
    if causes:
        print("dsrun's causes (failed tests per error line):")
        for cause, n in causes.most_common():
            print(f"  {n:4}  {cause}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
