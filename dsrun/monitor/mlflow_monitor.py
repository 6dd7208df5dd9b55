"""MLflow: params, metrics per step and artifacts of a run, in any tracking store.

With no ``tracking_uri`` (and no ``MLFLOW_TRACKING_URI``) the store is a local SQLite database: no server
is needed, and ``mlflow ui --backend-store-uri sqlite:///PATH/mlflow.db`` browses it. Runs that belong
together (the jobs of a Hydra multirun, the trials of a tuning study) name a ``parent_key``; they become
child runs of one parent run tagged with that key, created by whichever child comes first.

``import mlflow`` takes seconds, so this module imports it only when the sink is built.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .base import Event, Monitor, require_package

PARENT_KEY_TAG = "dsrun.parent_key"
_MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
_PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch call
_METRICS_PER_BATCH = 1000


def mlflow_key(name: str) -> str:
    """``name`` with the characters MLflow rejects in metric and param keys replaced by ``_`` (MLflow
    allows letters, digits, ``_ - . / `` and spaces)."""
    return re.sub(r"[^\w\-. /]", "_", str(name))


def local_tracking_uri(directory: str | os.PathLike) -> str:
    """The SQLite store dsrun uses when no tracking URI is configured: ``DIRECTORY/mlflow.db``."""
    return f"sqlite:///{Path(directory).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(configured: str | None, default_dir: str | os.PathLike) -> str:
    """``mlflow.tracking_uri`` from the config, else ``MLFLOW_TRACKING_URI``, else the local store."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or local_tracking_uri(default_dir)


@contextlib.contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """Hold an exclusive lock beside a local SQLite store (``mlflow.db.lock``) while a run is set up.

    Jobs that start together (a parallel multirun, tuning trials) would otherwise all create a new store's
    tables at once, or create the same experiment or parent run twice; with the lock the first one does it
    and the others find it done. Other stores (a tracking server, ...) need no lock.
    """
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    db = Path(tracking_uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before
        yield
        return
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class MLflowMonitor(Monitor):
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment_name: str = "dsrun", run_name: str | None = None,
                 log_artifacts: bool = True, parent_key: str | None = None, tags: Mapping[str, str] | None = None):
        require_package("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        with store_lock(tracking_uri):
            self.client = MlflowClient(tracking_uri=tracking_uri)  # creates a new store's tables
            self.experiment_id = self._experiment(experiment_name)
            all_tags = dict(tags or {})
            if parent_key:
                all_tags["mlflow.parentRunId"] = self._parent_run(parent_key)
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        self.run_id: str = run.info.run_id
        self.log_artifacts_enabled = log_artifacts
        self._pending: list[Any] = []
        self._finished = False

    def _experiment(self, name: str) -> str:
        existing = self.client.get_experiment_by_name(name)
        if existing is not None:
            return existing.experiment_id
        location = None
        if self.tracking_uri.startswith("sqlite:///"):
            # SQLite stores put artifacts under ./mlruns of the *current* directory by default; keep them
            # next to the database instead.
            db = Path(self.tracking_uri[len("sqlite:///"):])
            location = (db.parent / "mlartifacts").as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def _parent_run(self, key: str) -> str:
        quoted = key.replace("'", "\\'")
        found = self.client.search_runs([self.experiment_id], f"tags.`{PARENT_KEY_TAG}` = '{quoted}'",
                                        max_results=1)
        if found:
            return found[0].info.run_id
        parent = self.client.create_run(self.experiment_id, run_name=Path(key).name or key,
                                        tags={PARENT_KEY_TAG: key})
        self.client.set_terminated(parent.info.run_id)
        return parent.info.run_id

    def write_events(self, events: Sequence[Event]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending.extend(Metric(mlflow_key(label), float(value), now, int(step)) for label, value, step in events)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(mlflow_key(key), str(value)[:_MAX_PARAM_VALUE]) for key, value in params.items()]
        for start in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + _PARAMS_PER_BATCH])

    def log_artifacts(self, paths: Iterable[str]) -> None:
        if not self.log_artifacts_enabled:
            return
        for path in paths:
            if Path(path).is_file():
                self.client.log_artifact(self.run_id, str(path))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[start:start + _METRICS_PER_BATCH])

    def close(self, status: str = "FINISHED") -> None:
        if self._finished:
            return
        self.flush()
        self.client.set_terminated(self.run_id, status=status)
        self._finished = True
