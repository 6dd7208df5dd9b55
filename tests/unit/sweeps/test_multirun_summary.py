"""The table that ends a ``dsrun train -m`` sweep: the swept overrides, results side by side, failures named."""
from pathlib import Path

from dsrun.cli.multirun import JobResult, summary_table, varying_overrides


def jobs(tmp_path: Path) -> list[JobResult]:
    common = ["+recipe=default", "launcher.num_procs=1"]
    return [
        JobResult(0, [*common, "ds.optimizer.params.lr=0.001", "zero=stage1"], tmp_path / "0", 2.5, 41000.0),
        JobResult(1, [*common, "ds.optimizer.params.lr=0.003", "zero=stage1"], tmp_path / "1", 2.25, 40000.0),
        JobResult(2, [*common, "ds.optimizer.params.lr=0.003", "zero=stage2"], tmp_path / "2",
                  error="exit code 1 (rank1: RuntimeError: boom)"),
    ]


def test_only_the_swept_overrides_are_shown(tmp_path):
    assert varying_overrides(jobs(tmp_path)) == [["ds.optimizer.params.lr=0.001", "zero=stage1"],
                                                 ["ds.optimizer.params.lr=0.003", "zero=stage1"],
                                                 ["ds.optimizer.params.lr=0.003", "zero=stage2"]]
    (lone,) = varying_overrides(jobs(tmp_path)[:1])
    assert lone == ["launcher.num_procs=1", "ds.optimizer.params.lr=0.001", "zero=stage1"]


def test_the_table_lists_every_job_the_failure_and_the_best(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = summary_table(jobs(tmp_path), tmp_path).splitlines()
    assert lines[0] == "[dsrun] sweep of 3 job(s): 2 finished, 1 failed; sweep directory ."
    assert lines[1].split() == ["#", "overrides", "final", "eval", "loss", "tokens/s", "run", "dir", "status"]
    assert set(lines[2]) == {"-"}
    assert lines[3].split() == ["0", "ds.optimizer.params.lr=0.001", "zero=stage1", "2.5000", "41,000", "0", "ok"]
    assert lines[4].split()[3:] == ["2.2500", "40,000", "1", "ok"]
    assert lines[5].split()[3:6] == ["-", "-", "2"]
    assert lines[5].endswith("FAILED: exit code 1 (rank1: RuntimeError: boom)")
    assert lines[6] == "best final eval loss 2.2500: job 1 (ds.optimizer.params.lr=0.003 zero=stage1)"


def test_a_sweep_is_checked_once_with_each_sweeps_first_value():
    from dsrun.cli.multirun import first_job_overrides

    assert first_job_overrides([
        "optimizer.params.lr=1e-4,3e-4", "zero=choice(stage1,stage2)", "train.seed=range(3,9)",
        "ds.gradient_clipping=tag(log, interval(0.5, 2.0))", "+recipe=gpt_zero3", "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3", "~ds.scheduler",
    ]) == ["optimizer.params.lr=0.0001", "zero=stage1", "train.seed=3", "ds.gradient_clipping=0.5",
           "+recipe=gpt_zero3", "~ds.scheduler"]


def test_a_misspelt_key_fails_the_sweep_before_any_job(tmp_path):
    from tests.helpers import run_cli

    done = run_cli("train", "-m", "train.max_stepz=1,2", cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and not (tmp_path / "multirun").exists()
    assert "error: train.max_stepz: no such key" in done.stderr


def test_an_unknown_option_anywhere_in_a_group_sweep_is_named_with_a_suggestion():
    from dsrun.cli.multirun import unknown_sweep_options

    problems = unknown_sweep_options(["zero=stage1,stage9", "+recipe=default,gpt_zer3", "train.seed=1,2",
                                      "precision=bf16"])
    assert [(p.path, p.hint) for p in problems] == [("zero=stage9", "did you mean 'stage3'?"),
                                                    ("+recipe=gpt_zer3", "did you mean 'gpt_zero3'?")]
    assert "stage0, stage1, stage2, stage3" in problems[0].message.split("available: ")[1]
