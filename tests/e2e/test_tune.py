"""``dsrun tune`` as users run it, on the tiny ``gpt_tune`` recipe (16 configurations): a study killed with
SIGKILL and run again, every output, the optimal config training, pruning before launch, a crashing trial's
real error, MLflow runs, and one-line mistakes.

Trials are real ``dsrun train`` launches (one rank, a few steps each), so the memory limit prunes half the
space and ``tuner_num_trials`` bounds the rest to keep the file CI-sized.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, run_cli

TRIALS = 6
LIMIT = "4.5MiB"  # micro batch 1-2 fit; 4 and 8 do not (1 rank, gpt_tune's model)


def _base(port: int) -> list[str]:
    return ["+recipe=gpt_tune", "launcher.num_procs=1", f"launcher.master_port={port}", "train.max_steps=3",
            f"autotuning.tuner_num_trials={TRIALS}", "+ds.autotuning.model_info.num_params=120576",
            "--memory-limit", LIMIT, "--trial-timeout", "240"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _trials(results: Path) -> list:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    if not (results / "study.db").is_file():
        return []
    from sqlalchemy.exc import OperationalError

    try:
        return optuna.load_study(study_name="dsrun-tune", storage=f"sqlite:///{results / 'study.db'}").trials
    except KeyError:  # the study is not created yet
        return []
    except OperationalError:  # the tuner holds the write lock right now: look again at the next poll
        return []


def _launched(trials) -> list:
    return [t for t in trials if t.user_attrs.get("kind") == "launched" and t.state.name == "COMPLETE"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Start ``dsrun tune``, SIGKILL it while a trial runs after one finished, run it again to the end."""
    work = tmp_path_factory.mktemp("tune")
    base = _base(free_port())
    command = [sys.executable, "-m", "dsrun", "tune", *base]
    process = subprocess.Popen(command, cwd=work, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    results = work / "autotuning_results"
    deadline = time.monotonic() + 240
    before_kill = []
    try:
        while time.monotonic() < deadline and process.poll() is None:
            trials = _trials(results)
            running = [t for t in trials if t.state.name == "RUNNING" and t.user_attrs.get("launch_pid")]
            if _launched(trials) and running:
                before_kill = trials
                break
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the tuner may have ended (its output says why)
            os.killpg(process.pid, signal.SIGKILL)
        first_output = process.communicate(timeout=30)[0]
    assert before_kill, f"no trial finished before the deadline:\n{first_output}"
    finished = {t.number: t for t in before_kill if t.state.name in ("COMPLETE", "PRUNED", "FAIL")}
    interrupted = [t for t in before_kill if t.state.name == "RUNNING"]
    logs = {t.number: (results / t.user_attrs["exp_name"] / "stdout.log").stat().st_mtime_ns
            for t in _launched(before_kill)}
    # run again, with --run: the study continues to its end, then the best config trains
    second = subprocess.run([*command, "--run"], cwd=work, env=_env(), capture_output=True, text=True,
                            timeout=400, stdin=subprocess.DEVNULL)
    assert second.returncode == 0, second.stdout + second.stderr
    return {"work": work, "results": results, "base": base, "finished": finished, "interrupted": interrupted,
            "logs": logs, "output": second.stdout}


@pytest.mark.slow
def test_sigkill_then_rerun_continues_the_study_without_repeating_finished_trials(tuned):
    trials = _trials(tuned["results"])
    by_number = {t.number: t for t in trials}
    # trials finished before the kill are still there, unchanged, and were not launched again
    for number, before in tuned["finished"].items():
        assert by_number[number].state == before.state and by_number[number].params == before.params
        assert by_number[number].value == before.value
    for number, mtime in tuned["logs"].items():
        name = by_number[number].user_attrs["exp_name"]
        assert (tuned["results"] / name / "stdout.log").stat().st_mtime_ns == mtime
    # no configuration has two outcomes, and the budget counts each configuration once
    decided = [t for t in trials if t.user_attrs.get("kind") in ("launched", "pruned")]
    keys = [json.dumps(t.params, sort_keys=True) for t in decided]
    assert len(keys) == len(set(keys)) == TRIALS
    # the trial the kill interrupted is recorded as such, and its configuration ran again, once
    (lost,) = tuned["interrupted"]
    assert by_number[lost.number].state.name == "FAIL"
    assert by_number[lost.number].user_attrs["kind"] == "interrupted"
    retries = [t for t in trials if t.user_attrs.get("retry_of") == lost.number]
    assert len(retries) == 1 and retries[0].params == lost.params and retries[0].state.name == "COMPLETE"
    assert "were interrupted; their configurations run again" in tuned["output"]
    # one experiment directory per decided-and-launched configuration, none for pruned ones
    launched_names = {t.user_attrs["exp_name"] for t in trials if t.user_attrs.get("kind") == "launched"}
    pruned_names = {t.user_attrs["exp_name"] for t in trials if t.user_attrs.get("kind") == "pruned"}
    exp_dirs = {p.name for p in tuned["results"].iterdir() if (p / "exp.json").is_file()}
    assert exp_dirs == launched_names and not (pruned_names & exp_dirs)


@pytest.mark.slow
def test_every_output_is_written_and_the_optimal_config_validates(tuned):
    from dsrun.config import load_ds_config

    results = tuned["results"]
    trials = _trials(results)
    completed = [t for t in _launched(trials)]
    assert completed
    for t in completed:
        exp = results / t.user_attrs["exp_name"]
        for name in ("cmd.txt", "ds_config.json", "exp.json", "metrics.json", "stdout.log", "stderr.log"):
            assert (exp / name).is_file(), exp / name
        metrics = json.loads((exp / "metrics.json").read_text())
        assert metrics["throughput"] == pytest.approx(t.value)
        assert metrics["latency_source"].startswith("engine timers")
        assert metrics["throughput"] == pytest.approx(metrics["train_batch_size"] * 1000 / metrics["latency"])
        assert (results.parent / "autotuning_exps" / f"{t.user_attrs['exp_name']}.json").is_file()
    summary = (results / "summary.txt").read_text()
    assert summary.startswith("| tuning_space | num_experiments | best_metric_val | best_exp_name")
    best = max(completed, key=lambda t: t.value)
    assert "| global " in summary and best.user_attrs["exp_name"] in summary
    assert f"Best experiment: {best.user_attrs['exp_name']} (trial {best.number})" in summary
    assert "Tuning space: 16 configurations" in summary and "Pruned before launch:" in summary
    assert "memory limit 4.5 MiB" in summary
    assert "Tuning completed in " in summary and "Total number of experiments:" in summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    config = best.user_attrs["config"]  # the values (the sampler's params index the ordered dimensions)
    assert optimal["train_micro_batch_size_per_gpu"] == config["train_micro_batch_size_per_gpu"]
    assert optimal["zero_optimization"]["stage"] == config["zero_optimization.stage"]
    load_ds_config(optimal, world_size=1)  # validates
    assert f"ds_config={results / 'ds_config_optimal.json'}" in (results / "cmd_optimal.txt").read_text()
    assert "dsrun tune: throughput (samples/s)" in tuned["output"]  # the rich table


@pytest.mark.slow
def test_tune_run_trains_with_the_best_config(tuned):
    output = tuned["output"]
    assert "[tune] training with the best config" in output
    command = output.split("[tune] training with the best config: ")[1].splitlines()[0]
    assert f"ds_config={tuned['results'] / 'ds_config_optimal.json'}" in command
    assert "[dsrun] done: 3 steps" in output


@pytest.mark.slow
def test_impossible_trial_is_pruned_and_a_crash_keeps_its_real_error(tmp_path):
    """Space: micro batch 1 or 64, sequence 128 (the model's block is 64). Micro batch 64 cannot fit the
    memory limit (pruned, never launched); micro batch 1 fails its launch's checks before any rank starts
    (failed, with dsrun train's one-line error in summary.txt; a rank's traceback is kept the same way, see
    tests/unit/autotuning/test_trial_failure.py). The model-info run comes first. With MLflow on: a parent
    run with a child run per trial."""
    overrides = ["+recipe=gpt_tune", "launcher.num_procs=1", f"launcher.master_port={free_port()}",
                 "autotuning.fast=false", "tune.space.zero_optimization.stage=[0]",
                 "tune.space.train_micro_batch_size_per_gpu=[1,64]", "+tune.space.data.seq_len=[128]",
                 "monitor=mlflow", "--memory-limit", LIMIT, "--trial-timeout", "240"]
    result = run_cli("tune", *overrides, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=280)
    assert result.returncode == 1, result.stdout + result.stderr  # no trial completed: no optimal config
    assert "no trial completed, so there is no optimal config" in result.stderr
    results = tmp_path / "autotuning_results"
    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] == 120576 and info["activation_mem_per_gpu"] > 0
    trials = {t.user_attrs["exp_name"]: t for t in _trials(results)}
    assert set(trials) == {"z0_gas1_tmbspg1", "z0_gas1_tmbspg64"}  # sequence 128 is fixed: not in the name
    pruned = trials["z0_gas1_tmbspg64"]
    assert pruned.state.name == "PRUNED" and "> memory limit 4.5 MiB" in pruned.user_attrs["reason"]
    assert not (results / "z0_gas1_tmbspg64").exists() and not (tmp_path / "autotuning_exps" / "z0_gas1_tmbspg64.json").exists()
    crashed = trials["z0_gas1_tmbspg1"]
    assert crashed.state.name == "FAIL"
    message = "error: data.seq_len: 128 exceeds model.block_size=64"
    assert crashed.user_attrs["error_line"].startswith(message)
    summary = (results / "summary.txt").read_text()
    failure = summary.split("Failed experiments (full error):")[1]
    assert f"--- trial {crashed.number} z0_gas1_tmbspg1 ---" in failure and message in failure
    assert f"trial {pruned.number} z0_gas1_tmbspg64: estimated" in summary.split("Pruned before launch:")[1]
    assert "Best experiment: none" in summary and not (results / "ds_config_optimal.json").exists()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dsrun")
    runs = client.search_runs([experiment.experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    parents = {r.data.tags["mlflow.parentRunId"] for r in children}
    assert len(children) == 2 and len(parents) == 1 and len(runs) == 3
    assert {r.data.params["exp_name"]: r.info.status for r in children} == {
        "z0_gas1_tmbspg1": "FAILED", "z0_gas1_tmbspg64": "KILLED"}
    assert all(r.data.tags["dsrun.parent_key"].startswith("dsrun-tune:") for r in runs if r.info.run_id in parents)


@pytest.mark.parametrize("overrides, message", [
    (["+recipe=gpt_zero1"], "tune.space: this recipe has no search space"),
    (["+recipe=gpt_tune", "autotuning.metric=speed"], "ds.autotuning.metric"),
    (["+recipe=gpt_tune", "tune.space.zero_optimization.stage=[1]", "tune.space.train_micro_batch_size_per_gpu=[4]"],
     "tune.space: empty search space"),
    (["+recipe=gpt_tune", "autotuning.tuner_type=bayes"], "ds.autotuning.tuner_type"),
    (["+recipe=gpt_tune", "+tune.spaces=1"], "tune.spaces: unknown key (did you mean 'space'?)"),
    (["+recipe=gpt_tune", "--memory-limit", "lots"], "--memory-limit: got 'lots'"),
    (["+recipe=gpt_tune", "--srun-args=--time=5"], "--srun-args: is for trials run as Slurm jobs (add --slurm)"),
])
def test_mistakes_are_one_line_and_exit_2(overrides, message, tmp_path):
    result = run_cli("tune", *overrides, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "autotuning_results").exists()
