"""A new local MLflow store: made by copying a cached empty store, and set up safely by jobs that start
together (the jobs of a parallel multirun)."""
import multiprocessing as mp

import pytest

pytest.importorskip("mlflow")


def _start_child_runs(stores: list, name: str, barrier, results) -> None:
    """In each store in turn, start a child run at the same moment as the other process."""
    from mlflow.tracking import MlflowClient  # noqa: F401 - imported before the race, not during it

    from dsrun.monitor.mlflow_monitor import MLflowMonitor

    for db in stores:
        barrier.wait(timeout=120)
        try:
            monitor = MLflowMonitor(f"sqlite:///{db}", "dsrun", name, parent_key="sweep-dir")
            monitor.close()
            results.put((db, monitor.run_id))
        except Exception as err:  # reported to the test, which fails on it
            results.put((db, f"error: {type(err).__name__}: {err}"))


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
    # Without the store lock, two jobs racing on a new store fail about one time in three here (both
    # create the experiment "dsrun"); four races make that failure show.
    from mlflow.tracking import MlflowClient

    stores = [str(tmp_path / str(i) / "mlflow.db") for i in range(4)]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    jobs = [ctx.Process(target=_start_child_runs, args=(stores, f"job-{i}", barrier, results)) for i in range(2)]
    for job in jobs:
        job.start()
    outcome = [results.get(timeout=200) for _ in range(2 * len(stores))]
    for job in jobs:
        job.join(timeout=30)
    assert not [run for _, run in outcome if run.startswith("error")], outcome
    for db in stores:
        client = MlflowClient(tracking_uri=f"sqlite:///{db}")
        (experiment,) = [e for e in client.search_experiments() if e.name == "dsrun"]
        runs = client.search_runs([experiment.experiment_id])
        (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        children = [r.info.run_id for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(children) == sorted(run for store, run in outcome if store == db)
