"""MLflow: a local store with no server, params/metrics/artifacts read back through the MLflow client,
child runs under one parent."""
from __future__ import annotations

import pytest

from dsrun.monitor import MonitorMaster
from dsrun.monitor.mlflow_monitor import PARENT_KEY_TAG, local_tracking_uri, mlflow_key, resolve_tracking_uri


def test_keys_mlflow_would_reject_are_made_safe():
    assert mlflow_key("Train/Samples/train_loss") == "Train/Samples/train_loss"
    assert mlflow_key("Time per step") == "Time per step"
    assert mlflow_key("ds.optimizer.params.betas[0]:x") == "ds.optimizer.params.betas_0__x"


def test_tracking_uri_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert resolve_tracking_uri(None, tmp_path) == "http://tracking:5000"
    assert resolve_tracking_uri("sqlite:///x.db", tmp_path) == "sqlite:///x.db"


@pytest.mark.slow  # creating an MLflow SQLite store runs its migrations: ~10-20 s on a busy machine
def test_mlflow_run_with_params_metrics_artifacts_and_a_parent(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    artifact = tmp_path / "resolved.yaml"
    artifact.write_text("model: gpt\n")
    cfg = {"mlflow": {"enabled": True, "experiment_name": "unit", "run_name": "r"}}
    ids = []
    for job in range(2):
        master = MonitorMaster(cfg, rank=0, default_output_dir=str(tmp_path), mlflow_parent_key="sweep-1")
        master.log_params({"model.n_layer": 2, "ds.zero_optimization.stage": job})
        master.write_events([("Train/Samples/train_loss", 3.0 - job, 8), ("Train/Samples/train_loss", 2.0, 16)])
        master.log_artifacts([str(artifact)])
        master.close()
        assert not master.errors
        ids.append(master.sinks[0].run_id)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=local_tracking_uri(tmp_path))
    run = client.get_run(ids[1])
    assert run.data.params == {"model.n_layer": "2", "ds.zero_optimization.stage": "1"}
    history = client.get_metric_history(ids[1], "Train/Samples/train_loss")
    assert [(m.step, m.value) for m in history] == [(8, 2.0), (16, 2.0)]
    assert [a.path for a in client.list_artifacts(ids[1])] == ["resolved.yaml"]
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    parents = {client.get_run(i).data.tags["mlflow.parentRunId"] for i in ids}
    assert len(parents) == 1
    assert client.get_run(parents.pop()).data.tags[PARENT_KEY_TAG] == "sweep-1"
    assert (tmp_path / "mlartifacts").is_dir()  # artifacts beside the store, not in the current directory


@pytest.mark.slow  # an MLflow SQLite store (see above)
def test_mark_run_ended_sets_the_status_of_the_named_run_started_since(tmp_path):
    """dsrun train gives the MLflow run of a failed or stopped job its real ending: the newest run of that
    name started at or after the launch, nothing older, nothing of another name."""
    import time

    from mlflow.tracking import MlflowClient

    from dsrun.monitor.mlflow_monitor import MLflowMonitor, mark_run_ended

    uri = local_tracking_uri(tmp_path)
    old = MLflowMonitor(uri, "unit", run_name="2026-01-01/10-00-00")
    old.close()
    since = int(time.time() * 1000)
    time.sleep(0.01)
    runs = [MLflowMonitor(uri, "unit", run_name=name) for name in ("2026-01-01/10-00-00", "other")]
    runs[0].close()  # a rank that exits through an exception ends its run FINISHED on its way out
    assert mark_run_ended(uri, "unit", "2026-01-01/10-00-00", since, "FAILED")
    client = MlflowClient(tracking_uri=uri)
    status = {run_id: client.get_run(run_id).info.status for run_id in (old.run_id, runs[0].run_id, runs[1].run_id)}
    assert status == {old.run_id: "FINISHED", runs[0].run_id: "FAILED", runs[1].run_id: "RUNNING"}
    assert not mark_run_ended(uri, "unit", "never-made", since, "KILLED")
    assert not mark_run_ended(local_tracking_uri(tmp_path / "none"), "unit", "x", since, "KILLED")  # no store yet


def test_a_store_left_empty_by_a_full_disk_is_not_written_to_and_a_failure_is_one_line(tmp_path, monkeypatch):
    """A store file whose creation failed (a full disk) holds no run: marking the job's ending there neither
    creates tables nor prints MLflow's SQL; a store that fails while being marked is one warning line."""
    import dsrun.monitor.mlflow_monitor as mlflow_monitor
    from dsrun.cli.outcome import mark_mlflow
    from dsrun.compose import compose_runspec
    from dsrun.runspec import resolve_run

    db = tmp_path / "mlruns" / "mlflow.db"
    db.parent.mkdir()
    db.write_bytes(b"")
    assert not mlflow_monitor.mark_run_ended(f"sqlite:///{db}", "dsrun", "x", 0, "FAILED")
    assert db.stat().st_size == 0

    def full(*args, **kwargs):
        raise RuntimeError("(sqlite3.OperationalError) database or disk is full\n[SQL: \nCREATE TABLE experiments "
                           "(\n\texperiment_id INTEGER NOT NULL\n)\n]\n(Background on this error at: ...)")

    monkeypatch.setattr(mlflow_monitor, "mark_run_ended", full)
    run = resolve_run(compose_runspec(["data.max_bytes=300000", "monitor=mlflow",
                                       f"ds.mlflow.tracking_uri=sqlite:///{db}"]))
    said = []
    mark_mlflow(run, tmp_path / "2026-01-01" / "10-00-00", 0, "FAILED", said.append)
    assert said == ["warning: could not mark MLflow run '2026-01-01/10-00-00' FAILED: RuntimeError: "
                    "(sqlite3.OperationalError) database or disk is full"]
