"""Preemption as dsrun train words and checks it: the closing lines and exit code from the ranks' record
(preempted.json), the signal a rank got itself, and train.preemption.grace_s refused before launch when it is
not positive or shorter than writing the run's checkpoint takes here."""
import json
import signal
from pathlib import Path

import pytest

from dsrun.cli.outcome import stop_exit_code, stop_signal, stopped_lines
from dsrun.cli.preflight import grace_problems
from dsrun.compose import compose_runspec
from dsrun.estimate.runspec import build_recipe_model
from dsrun.runspec import resolve_run
from dsrun.utils.errors import ConfigError, UserError


def resolved(*overrides):
    return resolve_run(compose_runspec(["data.max_bytes=300000", *overrides]))


def stopped_run(root: Path, checkpoint: int | None, record: dict | None, metrics: dict | None) -> Path:
    run_dir = root / "outputs" / "2026-12-06" / "10-00-00"
    run_dir.mkdir(parents=True)
    if checkpoint is not None:
        (run_dir / "checkpoints" / f"global_step{checkpoint}").mkdir(parents=True)
        (run_dir / "checkpoints" / "latest").write_text(f"global_step{checkpoint}")
    if record is not None:
        (run_dir / "preempted.json").write_text(json.dumps(record))
    if metrics is not None:
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
    return run_dir


def test_a_preempted_run_that_saved_where_it_stopped_says_so_and_exits_138(tmp_path):
    record = {"signal": "SIGUSR1", "step": 7, "saved": True, "checkpoint": "global_step7", "grace_s": 120.0,
              "reached_boundary": True}
    run_dir = stopped_run(tmp_path, 7, record, {"steps": 7, "max_steps": 200, "preempted": record})
    assert stopped_lines(resolved(), run_dir, signal.SIGUSR1) == [
        f"stopped by SIGUSR1 after step 7 of 200; checkpoint saved at step 7 in {run_dir / 'checkpoints/global_step7'}",
        f"resume: dsrun train --from {run_dir} (or the same command with train.resume=auto)",
        "exit code 138: preempted, checkpoint saved where the ranks stopped (requeue the job)"]
    assert stop_exit_code(run_dir, signal.SIGUSR1) == stop_exit_code(run_dir, signal.SIGTERM) == 138
    assert stop_exit_code(run_dir, signal.SIGINT) == 130  # Ctrl-C keeps its own code
    # a rank got it, not the launcher: the record names it
    assert stop_signal(run_dir, 138) == signal.SIGUSR1


def test_a_save_the_grace_period_cut_short_is_said_once_and_exits_143(tmp_path):
    record = {"signal": "SIGTERM", "step": 7, "saved": False, "checkpoint": None, "grace_s": 30.0,
              "reached_boundary": True}
    run_dir = stopped_run(tmp_path, 4, record, None)  # the ranks left before writing metrics.json
    lines = stopped_lines(resolved("train.save_interval=2"), run_dir, signal.SIGTERM)
    assert lines[0] == (f"stopped by SIGTERM after step 7 of 300; the checkpoint there was not saved within "
                        f"train.preemption.grace_s=30 s; an earlier checkpoint saved at step 4 in "
                        f"{run_dir / 'checkpoints/global_step4'}")
    assert lines[2] == "exit code 143: stopped without a checkpoint where the ranks stopped"
    assert stop_exit_code(run_dir, signal.SIGTERM) == 143

    midstep = stopped_run(tmp_path / "b", None, {**record, "step": 0, "reached_boundary": False}, None)
    assert stopped_lines(resolved(), midstep, signal.SIGTERM)[:2] == [
        "stopped by SIGTERM before the first step finished; step 1 did not end within train.preemption.grace_s=30 "
        "s; no checkpoint saved",
        f"run it again: dsrun train --from {midstep} (or the same command with train.resume=auto)"]


def test_the_signal_a_rank_got_itself_comes_from_its_metrics(tmp_path):
    run_dir = stopped_run(tmp_path, None, None, {"steps": 3, "stopped_by_signal": int(signal.SIGINT)})
    assert stop_signal(run_dir, 143) == signal.SIGINT  # the worker's own stop: Ctrl-C on rank 0
    assert stop_signal(run_dir, 1) is None  # a failure
    other = stopped_run(tmp_path / "b", None, None, {"steps": 3, "stopped_by_signal": "another rank"})
    assert stop_signal(other, 143) == signal.SIGTERM


def test_a_grace_period_that_cannot_hold_a_save_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolved("train.preemption.grace_s=0")
    assert [(p.path, p.message) for p in info.value.problems] == [
        ("train.preemption.grace_s", "got 0; allowed: greater than 0")]
    run = resolved()
    model = build_recipe_model(run.runspec)
    assert grace_problems(run, model, tmp_path) == []  # 120 s hold a few MB without measuring the disk
    short = resolved("train.preemption.grace_s=1e-7")
    (problem,) = grace_problems(short, model, tmp_path / "not" / "made")  # measured in tmp_path, the nearest folder
    assert problem.path == "train.preemption.grace_s"
    assert problem.message.startswith("is 1e-07 s, but saving this run's checkpoint (")
    assert f"MiB/s, measured in {tmp_path})" in problem.message
    assert "terminationGracePeriodSeconds" in problem.hint
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_the_default_grace_period_too_short_for_a_big_model_is_a_note_not_a_refusal(monkeypatch, tmp_path):
    from dsrun.cli import preflight

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(preflight, "write_rate", lambda where, size: (100 * 2**20, tmp_path))  # 100 MiB/s
    notes = preflight.check_before_launch(resolved("model=gpt-13b"), memory_check=False).notes
    assert [n for n in notes if "preemption" in n] == [
        f"note: a preemption could not save in time: train.preemption.grace_s: is 120 s, but saving this run's "
        f"checkpoint (196,127.1 MiB of weights and optimizer states) takes about 1.96e+03 s here (writing 100 "
        f"MiB/s, measured in {tmp_path}) (raise it to at least 2942 and give the scheduler's notice as long "
        f"(Kubernetes: terminationGracePeriodSeconds; Slurm: --signal=USR1@SECONDS), or save to a faster disk)"]
    with pytest.raises(UserError) as info:  # one you set is refused
        preflight.check_before_launch(resolved("model=gpt-13b", "train.preemption.grace_s=600"), memory_check=False)
    assert [p.path for p in info.value.problems] == ["train.preemption.grace_s"]
