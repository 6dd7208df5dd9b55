"""The run directory: one per run (Hydra's), enough to reproduce the run from it alone.

Layout::

    RUN_DIR/
      resolved.yaml      the RunSpec, every interpolation resolved, ds = the resolved DeepSpeed config
      ds_config.json     the resolved DeepSpeed config; loads in DeepSpeed unchanged
      .hydra/            Hydra's record of the composition (config.yaml, overrides.yaml, hydra.yaml)
      provenance.json    the code and data that ran: dsrun, torch and Python versions, git commits, the
                         data's SHA-256, the command line
      dsrun.log          what ``dsrun train`` printed (rank lines included); logs/ holds one file per rank
      metrics.json       written by the worker at the end of training
      preempted.json     only when SIGTERM/SIGUSR1 stopped the run: the signal, the step it stopped at, whether
                         the checkpoint there was saved (rank 0 writes it; ``dsrun train`` words the ending from it)
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import IO, Any, Protocol, Sequence

from omegaconf import DictConfig, OmegaConf

RESOLVED_YAML = "resolved.yaml"
DS_CONFIG_JSON = "ds_config.json"
METRICS_JSON = "metrics.json"
PROVENANCE_JSON = "provenance.json"
PREEMPTED_JSON = "preempted.json"
LAUNCHER_LOG = "dsrun.log"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so that a crash leaves either the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class ResolvedRunLike(Protocol):
    """What the run files need of a :class:`~dsrun.runspec.ResolvedRun` (a higher layer)."""

    runspec: DictConfig

    def ds_dict(self) -> dict[str, Any]: ...


def resolved_runspec(run: ResolvedRunLike) -> dict[str, Any]:
    """The RunSpec as written to resolved.yaml: plain data, ``ds`` replaced by the resolved DeepSpeed config."""
    spec = OmegaConf.to_container(run.runspec, resolve=True)
    spec["ds"] = run.ds_dict()
    return spec


def write_run_files(run_dir: Path, run: ResolvedRunLike) -> dict[str, Path]:
    """Write resolved.yaml and ds_config.json for a :class:`~dsrun.runspec.ResolvedRun`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"resolved": run_dir / RESOLVED_YAML, "ds_config": run_dir / DS_CONFIG_JSON}
    spec = resolved_runspec(run)
    atomic_write_text(paths["resolved"], OmegaConf.to_yaml(OmegaConf.create(spec), sort_keys=False))
    atomic_write_text(paths["ds_config"], json.dumps(spec["ds"], indent=2) + "\n")
    return paths


def git_state(folder: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git work tree holding ``folder``; None outside one (or without git)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def code_version() -> dict[str, Any]:
    """The versions of what runs a job: dsrun, torch, Python, the platform, and dsrun's git commit when it
    runs from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    import dsrun

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    return {"dsrun": dsrun.__version__, "torch": torch_version, "python": platform.python_version(),
            "platform": platform.platform(), "dsrun_git": git_state(Path(dsrun.__file__).resolve().parent)}


def write_provenance(run_dir: Path, command: Sequence[str], overrides: Sequence[str],
                     data: dict[str, Any] | None) -> Path:
    """``provenance.json``: :func:`code_version`, the git state of the directory the run started in, the
    command line, the overrides the run amounts to (a ``dsrun train --from`` run's added to its source's) and
    the data's digest (see :func:`dsrun.cli.preflight.data_digest`)."""
    record = {**code_version(), "cwd": os.getcwd(), "cwd_git": git_state(Path.cwd()), "command": list(command),
              "overrides": list(overrides), "data": data}
    path = run_dir / PROVENANCE_JSON
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    return path


class LauncherLog:
    """``dsrun.log``: a copy of what ``dsrun train`` prints for a run, its own lines and the ranks' output it
    relays. :meth:`say` prints a line (``[dsrun] `` in front) and logs it; :attr:`stdout` / :attr:`stderr`
    are streams that print and log what is written to them."""

    def __init__(self, run_dir: Path) -> None:
        import sys

        self.path = run_dir / LAUNCHER_LOG
        self._handle: Any = None
        self.stdout = _Tee(sys.stdout, self)
        self.stderr = _Tee(sys.stderr, self)

    def record(self, text: str) -> None:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")
        self._handle.write(text)
        self._handle.flush()

    def say(self, line: str, err: bool = False, prefix: bool = True) -> None:
        (self.stderr if err else self.stdout).write((f"[dsrun] {line}" if prefix else line) + "\n")

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class _Tee:
    """A text stream that writes to the console and to a :class:`LauncherLog`."""

    def __init__(self, console: IO[str], log: LauncherLog) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        self.console.write(text)
        self.console.flush()
        self.log.record(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()
