"""The run directory: one per run (Hydra's), enough to reproduce the run from it alone.

Layout::

    RUN_DIR/
      resolved.yaml      the RunSpec, every interpolation resolved, ds = the resolved DeepSpeed config
      ds_config.json     the resolved DeepSpeed config; loads in DeepSpeed unchanged
      .hydra/            Hydra's record of the composition (config.yaml, overrides.yaml, hydra.yaml)
      dsrun.log          the launcher's log; logs/ holds one file per rank
      metrics.json       written by the worker at the end of training
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

RESOLVED_YAML = "resolved.yaml"
DS_CONFIG_JSON = "ds_config.json"
METRICS_JSON = "metrics.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so that a crash leaves either the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def resolved_runspec(run: Any) -> dict[str, Any]:
    """The RunSpec as written to resolved.yaml: plain data, ``ds`` replaced by the resolved DeepSpeed config."""
    spec = OmegaConf.to_container(run.runspec, resolve=True)
    spec["ds"] = run.ds_dict()
    return spec


def write_run_files(run_dir: Path, run: Any) -> dict[str, Path]:
    """Write resolved.yaml and ds_config.json for a :class:`~dsrun.runspec.ResolvedRun`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"resolved": run_dir / RESOLVED_YAML, "ds_config": run_dir / DS_CONFIG_JSON}
    spec = resolved_runspec(run)
    atomic_write_text(paths["resolved"], OmegaConf.to_yaml(OmegaConf.create(spec), sort_keys=False))
    atomic_write_text(paths["ds_config"], json.dumps(spec["ds"], indent=2) + "\n")
    return paths
