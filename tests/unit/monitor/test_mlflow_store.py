"""A new local MLflow store: made by copying a cached empty store, and set up safely by jobs that start
together (the jobs of a parallel multirun)."""
import multiprocessing as mp
from pathlib import Path

import pytest

pytest.importorskip("mlflow")


def _start_child_run(db: str, name: str) -> str:
    from dsrun.monitor.mlflow_monitor import MLflowMonitor

    monitor = MLflowMonitor(f"sqlite:///{db}", "dsrun", name, parent_key="sweep-dir")
    monitor.close()
    return monitor.run_id


def test_a_new_store_is_a_working_mlflow_store_with_artifacts_beside_it(tmp_path):
    from mlflow.tracking import MlflowClient

    from dsrun.monitor.mlflow_monitor import new_local_store

    db = tmp_path / "mlruns" / "mlflow.db"
    new_local_store(db)
    assert db.is_file() and not list(db.parent.glob("mlflow.db.*"))  # no partial copy left behind
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    default = client.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == (db.parent / "mlartifacts" / "0").as_uri()
    run = client.create_run(client.create_experiment("e"))
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 1.5)]


@pytest.mark.timeout(240)
def test_jobs_starting_together_share_one_new_store_one_experiment_and_one_parent(tmp_path):
    from mlflow.tracking import MlflowClient

    db = tmp_path / "mlruns" / "mlflow.db"
    with mp.get_context("spawn").Pool(2) as pool:
        run_ids = pool.starmap(_start_child_run, [(str(db), "job-0"), (str(db), "job-1")], chunksize=1)
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "dsrun"]
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_id for r in children) == sorted(run_ids)
    assert Path(str(db) + ".lock").is_file()
