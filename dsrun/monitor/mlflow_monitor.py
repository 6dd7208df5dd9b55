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


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a local SQLite store (``sqlite:///PATH``); None for any other store."""
    prefix = "sqlite:///"
    return Path(tracking_uri[len(prefix):]) if tracking_uri.startswith(prefix) else None


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
    db = sqlite_path(tracking_uri)
    if db is None:
        yield
        return
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


def new_local_store(db: Path) -> None:
    """Create an empty MLflow SQLite store at ``db``, fast: by copying an empty store of this MLflow version,
    made once per machine in dsrun's cache.

    Creating a store runs MLflow's schema migrations (about a hundred, each committed to disk): 2-3 s of
    CPU but 15-20 s of waiting for the disk on a busy machine, which a short run would spend at its end
    waiting for its monitor. The cached store is made in a RAM-backed temporary folder when the machine has
    one (nothing to wait for), then every new store is a file copy. Should anything go wrong, MLflow
    creates the store itself, as before.
    """
    import logging
    import shutil
    import sqlite3
    import tempfile
    from importlib.metadata import version

    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsrun"
        template = cache / f"mlflow-{version('mlflow')}-empty.db"
        if not template.is_file():
            from mlflow.tracking import MlflowClient

            cache.mkdir(parents=True, exist_ok=True)
            ram = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            quiet = logging.getLogger("mlflow.store.db.utils")  # "Creating initial MLflow database tables..."
            level = quiet.level
            quiet.setLevel(logging.WARNING)
            with tempfile.TemporaryDirectory(dir=ram) as scratch:
                fresh = Path(scratch) / "mlflow.db"
                try:
                    MlflowClient(tracking_uri=f"sqlite:///{fresh}").search_experiments(max_results=1)
                finally:
                    quiet.setLevel(level)
                partial = template.with_name(f"{template.name}.{os.getpid()}")
                shutil.copyfile(fresh, partial)
                os.replace(partial, template)  # whole or not at all, for jobs that start together
        db.parent.mkdir(parents=True, exist_ok=True)
        partial = db.with_name(f"{db.name}.{os.getpid()}")
        shutil.copyfile(template, partial)
        with contextlib.closing(sqlite3.connect(partial)) as connection, connection:
            # the Default experiment's artifacts: beside the store, as dsrun's own experiments (not the cache)
            connection.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                               ((db.parent / "mlartifacts" / "0").as_uri(),))
        os.replace(partial, db)
    except Exception:  # noqa: BLE001 - an optimisation only: MLflow makes the store the slow way
        for leftover in db.parent.glob(f"{db.name}.{os.getpid()}"):
            leftover.unlink(missing_ok=True)


def mark_run_ended(tracking_uri: str, experiment_name: str, run_name: str, since_ms: int, status: str) -> bool:
    """Set the status (``FAILED``, ``KILLED``, ...) of the newest run called ``run_name`` in ``experiment_name``
    that started at or after ``since_ms`` (epoch milliseconds). A rank cannot do it when it was killed, and a
    rank that exits through an exception ends its run as ``FINISHED`` on its way out, so ``dsrun train`` sets
    the status from the job's outcome. Returns False when there is no such run (the job stopped before its
    monitor made one)."""
    require_package("mlflow", "mlflow")
    from mlflow.tracking import MlflowClient

    db = sqlite_path(tracking_uri)
    if db is not None and (not db.exists() or db.stat().st_size == 0):  # an empty file (its creation failed,
        return False  # e.g. on a full disk) holds no run: opening it would only try to create the tables
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return False
    runs = [run for run in client.search_runs([experiment.experiment_id], f"attributes.start_time >= {int(since_ms)}",
                                              order_by=["attributes.start_time DESC"])
            if run.info.run_name == run_name]
    if not runs:
        return False
    client.set_terminated(runs[0].info.run_id, status=status)
    return True


class MLflowMonitor(Monitor):
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment_name: str = "dsrun", run_name: str | None = None,
                 log_artifacts: bool = True, parent_key: str | None = None, tags: Mapping[str, str] | None = None):
        require_package("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        with store_lock(tracking_uri):
            db = sqlite_path(tracking_uri)
            if db is not None and not db.exists():
                new_local_store(db)
            self.client = MlflowClient(tracking_uri=tracking_uri)
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
        db = sqlite_path(self.tracking_uri)
        if db is not None:
            # SQLite stores put artifacts under ./mlruns of the *current* directory by default; keep them
            # next to the database instead.
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
