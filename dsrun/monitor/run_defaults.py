"""Where a ``dsrun train`` run's monitors write when the config does not say.

* ``csv_monitor`` / ``tensorboard`` with an empty ``output_path``: the run directory, so
  ``RUN_DIR/<job_name>/`` holds the CSV files and event files of that run.
* ``mlflow`` without ``tracking_uri`` and without ``MLFLOW_TRACKING_URI``: a local SQLite store in
  ``mlruns/`` of the directory ``dsrun train`` was started from (beside Hydra's ``outputs/`` and
  ``multirun/``), so every run of a project lands in one store. ``run_name`` defaults to the run
  directory's name (``DATE/TIME``, or ``TIME/N`` for a multirun job).
* Jobs of one Hydra multirun become child runs of one parent run named after the sweep directory;
  ``DSRUN_MLFLOW_PARENT`` (set by the autotuner for its trials) names the parent explicitly.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping

PARENT_ENV = "DSRUN_MLFLOW_PARENT"


def _hydra_runtime(run_dir: Path) -> dict[str, Any]:
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    hydra = OmegaConf.load(path).get("hydra", {})
    # only plain values: Hydra saves some paths unresolved (``${now:...}``), which would not resolve here
    pick = lambda key: OmegaConf.select(hydra, key, throw_on_resolution_failure=False)  # noqa: E731
    return {"cwd": pick("runtime.cwd"), "mode": str(pick("mode"))}


def launch_dir(run_dir: Path) -> Path:
    """The directory ``dsrun train`` ran in (Hydra records it), else the current directory."""
    cwd = _hydra_runtime(run_dir).get("cwd")
    return Path(cwd) if cwd else Path.cwd()


def mlflow_parent_key(run_dir: Path) -> str | None:
    """The key that groups runs under one MLflow parent: ``DSRUN_MLFLOW_PARENT`` or the multirun's sweep
    directory; None for a single run."""
    if os.environ.get(PARENT_ENV):
        return os.environ[PARENT_ENV]
    if _hydra_runtime(run_dir).get("mode", "").endswith("MULTIRUN"):
        return str(run_dir.resolve().parent)  # a job runs in <sweep dir>/<job number>
    return None


def apply_run_defaults(ds_config: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """A copy of ``ds_config`` with the monitors' unset paths filled in for this run directory."""
    from .mlflow_monitor import local_tracking_uri

    config = copy.deepcopy(dict(ds_config))
    for section in ("csv_monitor", "tensorboard"):
        if isinstance(config.get(section), dict) and not config[section].get("output_path"):
            config[section]["output_path"] = str(run_dir)
    mlflow = config.get("mlflow")
    if isinstance(mlflow, dict) and mlflow.get("enabled"):
        if not mlflow.get("tracking_uri") and not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow["tracking_uri"] = local_tracking_uri(launch_dir(run_dir) / "mlruns")
        if not mlflow.get("run_name"):
            mlflow["run_name"] = f"{run_dir.parent.name}/{run_dir.name}"
    return config


def flatten(tree: object, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` → ``{"a.b": 1, "c": [1, 2]}`` (lists stay values;
    a leaf may be any object)."""
    flat: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    flat[prefix[:-1]] = tree
    return flat
