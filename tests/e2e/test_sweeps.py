"""``dsrun train -m``: Hydra's basic sweeper (one full launch per job, results side by side, one MLflow run
per job under one parent) and ``hydra/sweeper=optuna`` (the final eval loss is the objective; a failed trial
is recorded as failed and the sweep goes on). Jobs are tiny: one rank, two steps."""
import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_cli

TINY = ["launcher.num_procs=1", "train.max_steps=2", "train.eval_interval=0", "train.eval_iters=1",
        "train.save_interval=0", "ds.train_micro_batch_size_per_gpu=2", "data.seq_len=16", "data.max_bytes=200000"]


def job_dirs(tmp_path: Path) -> list[Path]:
    (sweep_dir,) = (tmp_path / "multirun").glob("*/*")
    return sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def table_row(stdout: str, run_dir: Path, cwd: Path) -> str:
    """The summary table's row for one job (rows name the run directory relative to where dsrun ran)."""
    where = str(run_dir.relative_to(cwd))
    return next(line for line in stdout.splitlines() if f" {where} " in line)


@pytest.mark.slow  # two one-rank launches and a new MLflow store
@pytest.mark.timeout(600)
def test_two_job_multirun_gives_two_run_directories_and_two_mlflow_runs(tmp_path):
    result = run_cli("train", "-m", *TINY, "optimizer.params.lr=1e-3,3e-3", cwd=tmp_path, timeout=560,
                     env={"DSRUN_MLFLOW": "true", "MLFLOW_TRACKING_URI": ""})  # the default recipe's MLflow run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = job_dirs(tmp_path)
    assert [p.name for p in runs] == ["0", "1"]
    metrics = [json.loads((run / "metrics.json").read_text()) for run in runs]
    assert [m["steps"] for m in metrics] == [2, 2]
    lrs = [yaml.safe_load((run / "resolved.yaml").read_text())["ds"]["optimizer"]["params"]["lr"] for run in runs]
    assert lrs == [1e-3, 3e-3]

    # side by side: one row per job with its own override, final eval loss and run directory
    assert "sweep of 2 job(s): 2 finished, 0 failed" in result.stdout
    for run, m, lr in zip(runs, metrics, ("0.001", "0.003")):
        row = table_row(result.stdout, run, tmp_path)
        assert f"ds.optimizer.params.lr={lr}" in row and f"{m['final_eval_loss']:.4f}" in row and row.endswith("ok")
    assert (runs[0].parent / "summary.txt").read_text().count(" ok\n") == 2

    # MLflow: one run per job, both children of the sweep's parent run, each with its job's params and loss
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    mlflow_runs = client.search_runs([client.get_experiment_by_name("dsrun").experiment_id])
    children = sorted((r for r in mlflow_runs if "mlflow.parentRunId" in r.data.tags),
                      key=lambda r: float(r.data.params["ds.optimizer.params.lr"]))
    (parent,) = [r for r in mlflow_runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(children) == 2 and {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    for child, m in zip(children, metrics):
        assert child.info.status == "FINISHED"
        assert child.data.metrics["Eval/Samples/eval_loss"] == pytest.approx(m["final_eval_loss"])
    assert [r.data.params["ds.optimizer.params.lr"] for r in children] == ["0.001", "0.003"]


@pytest.mark.slow  # two one-rank launches
@pytest.mark.timeout(600)
def test_optuna_sweeper_records_the_final_eval_loss_and_survives_a_failed_trial(tmp_path):
    # the grid has two points (n_trials=3 is capped to them): seq_len 16 trains; seq_len 4096 is longer than
    # gpt-nano's 128 positions and fails its job's checks before launch
    result = run_cli("train", "-m", *TINY, "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid",
                     "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1", "hydra.sweeper.max_failure_rate=0.5",
                     "hydra.sweeper.study_name=seq", "hydra.sweeper.storage=sqlite:///optuna.db",
                     "optimizer.params.lr=3e-3", "data.seq_len=choice(16,4096)", cwd=tmp_path, timeout=560)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # one job failed
    runs = job_dirs(tmp_path)
    assert len(runs) == 2

    import optuna

    study = optuna.load_study(study_name="seq", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    by_seq_len = {t.params["data.seq_len"]: (t, runs[t.number]) for t in study.trials}
    assert sorted(by_seq_len) == [16, 4096]
    trained, run = by_seq_len[16]
    final = json.loads((run / "metrics.json").read_text())["final_eval_loss"]
    assert trained.state == optuna.trial.TrialState.COMPLETE and trained.value == pytest.approx(final)
    assert table_row(result.stdout, run, tmp_path).endswith("ok")
    failed, run = by_seq_len[4096]
    assert failed.state == optuna.trial.TrialState.FAIL and not (run / "metrics.json").exists()
    row = table_row(result.stdout, run, tmp_path)
    assert "FAILED: data.seq_len: 4096 exceeds model.block_size=128" in row

    results = yaml.safe_load((runs[0].parent / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"data.seq_len": 16} and results["best_value"] == pytest.approx(final)
    assert (results["n_complete"], results["n_failed"]) == (1, 1)
