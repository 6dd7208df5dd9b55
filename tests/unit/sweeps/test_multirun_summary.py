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
