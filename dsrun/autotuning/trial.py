"""One experiment: a real, short ``dsrun train`` launch in a subprocess, and the files DeepSpeed's autotuner
keeps for it.

``RESULTS_DIR/<exp_name>/`` holds ``cmd.txt`` (the command), ``ds_config.json`` (the trial's resolved
DeepSpeed config, as it would train), ``exp.json`` (the experiment), ``stdout.log`` / ``stderr.log`` (the
launch's output), ``metrics.json`` (the profile metrics, on success) and ``run/`` (the ``dsrun train`` run
directory: resolved.yaml, the worker's metrics.json, logs per rank). ``EXPS_DIR/<exp_name>.json`` repeats
the experiment, as DeepSpeed does.

The launch runs in its own session with a time limit; it dies with the tuner (``PR_SET_PDEATHSIG``), and a
timeout or Ctrl-C stops its whole process group. A failure's text is the failing rank's real traceback,
read from the run's per-rank logs, never a truncated line.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

MONITOR_SECTIONS = ("csv_monitor", "tensorboard", "wandb", "comet", "mlflow")
STOP_GRACE_S = 15.0
_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:\s?)+")


def measurement_overrides(steps: int, master_port: int) -> list[str]:
    """What every trial adds to its overrides: ``steps`` optimizer steps (the profile window's end), no
    checkpoints, one eval batch, the engine's timers on and never reset inside the window, no monitors
    (their overhead is not the config's), and a free master port."""
    return [f"train.max_steps={steps}", "train.max_tokens=null", "train.eval_interval=0", "train.eval_iters=1",
            "train.save_interval=0", "train.resume=null", "++ds.wall_clock_breakdown=true",
            f"++ds.steps_per_print={steps + 1}", *[f"++ds.{name}.enabled=false" for name in MONITOR_SECTIONS],
            f"launcher.master_port={master_port}"]


def override_key_of(text: str) -> str:
    """The key an override sets, without ``+``/``~`` prefixes and without ``ds.``."""
    key = text.lstrip("+~").split("=", 1)[0]
    return key[3:] if key.startswith("ds.") else key


def without_keys(overrides: Sequence[str], keys: Sequence[str]) -> list[str]:
    """``overrides`` minus those setting one of ``keys`` (the trial sets them itself)."""
    drop = {override_key_of(k) for k in keys}
    return [o for o in overrides if override_key_of(o) not in drop]


def train_command(overrides: Sequence[str], recipes_dirs: Sequence[str], run_dir: Path) -> list[str]:
    """A trial's ``dsrun train``; the tuner has judged its memory with its own limit (``--memory-limit``), so
    train's check against this machine is skipped."""
    return [sys.executable, "-m", "dsrun", "train", "--skip-memory-check", *overrides,
            *[arg for d in recipes_dirs for arg in ("--recipes-dir", str(d))], f"hydra.run.dir={run_dir}"]


@dataclass
class Experiment:
    name: str
    directory: Path
    command: list[str]
    ds_config: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # what the command's environment adds (a trial under srun)

    @property
    def run_dir(self) -> Path:
        return self.directory / "run"

    def write_files(self, exps_dir: Path) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "cmd.txt").write_text(shlex.join(self.command) + "\n")
        (self.directory / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")
        exp = {"name": self.name, "ds_config": self.ds_config, **self.info}
        (self.directory / "exp.json").write_text(json.dumps(exp, indent=2, default=str) + "\n")
        exps_dir.mkdir(parents=True, exist_ok=True)
        (exps_dir / f"{self.name}.json").write_text(json.dumps(exp, indent=2, default=str) + "\n")


@dataclass
class LaunchResult:
    returncode: int | None
    elapsed_s: float
    worker_metrics: dict[str, Any] | None = None
    error: str | None = None  # the full error text when the launch failed

    @property
    def ok(self) -> bool:
        return self.error is None


def _die_with_parent() -> None:  # preexec_fn: SIGTERM when the tuner dies, however it dies
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_leftover_launch(pid: int | None) -> None:
    """Stop the process group of a launch a killed tuner left behind (it normally dies with the tuner, but
    may still be shutting down). Only a group whose leader is still a ``dsrun train`` is touched."""
    try:
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
    except (OSError, TypeError, ValueError):
        return
    if b"dsrun" in cmdline and b"train" in cmdline:
        try:
            os.killpg(int(pid), signal.SIGKILL)
        except OSError:
            return
        deadline = time.monotonic() + 10
        while Path(f"/proc/{int(pid)}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def launch(exp: Experiment, timeout: float, env: Mapping[str, str] | None = None,
           on_start: Callable[[int], None] | None = None) -> LaunchResult:
    """Run ``exp.command``; stdout/stderr go to the experiment's logs. Never raises for a failed run.
    ``on_start(pid)`` is called once the launch runs (its process group has the same id)."""
    from dsrun.rundir import METRICS_JSON

    started = time.monotonic()
    with open(exp.directory / "stdout.log", "w") as out, open(exp.directory / "stderr.log", "w") as err:
        process = subprocess.Popen(exp.command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **exp.env, **(env or {})}, start_new_session=True,
                                   preexec_fn=_die_with_parent)
        try:
            if on_start is not None:
                on_start(process.pid)
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(process)
            elapsed = time.monotonic() - started
            return LaunchResult(None, elapsed, error=f"timed out after {timeout:g}s (tune.trial_timeout); "
                                f"stopped.\n{failure_text(exp.run_dir, exp.directory / 'stderr.log')}")
        except BaseException:  # Ctrl-C: the launch is in its own session, so stop it ourselves
            _stop_group(process)
            raise
    elapsed = time.monotonic() - started
    metrics_path = exp.run_dir / METRICS_JSON
    if code != 0:
        return LaunchResult(code, elapsed, error=f"exit code {code}\n"
                            + failure_text(exp.run_dir, exp.directory / "stderr.log"))
    if not metrics_path.is_file():
        return LaunchResult(code, elapsed, error=f"the run wrote no {metrics_path}")
    return LaunchResult(code, elapsed, worker_metrics=json.loads(metrics_path.read_text()))


def _strip_prefixes(lines: Sequence[str]) -> list[str]:
    return [_RANK_PREFIX.sub("", line) for line in lines]


def failure_text(run_dir: Path, stderr_path: Path) -> str:
    """The real error of a failed launch: each failing rank's last traceback (from ``logs/rank*.stderr.log``)
    in full, after the launcher's verdict line; else the launch's own stderr."""
    stderr = stderr_path.read_text(errors="replace").splitlines() if stderr_path.is_file() else []
    verdict = [line for line in stderr if line.startswith("dsrun: job failed") or line.startswith("error: ")]
    blocks: list[str] = []
    seen: set[str] = set()
    for log in sorted((run_dir / "logs").glob("rank*.stderr.log"), key=lambda p: p.name):
        lines = _strip_prefixes(log.read_text(errors="replace").splitlines())
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
        if starts:
            block = "\n".join(lines[starts[-1]:]).rstrip()
            if block not in seen:  # every rank failing the same way is said once
                seen.add(block)
                blocks.append(f"{log.name.split('.')[0]}:\n{block}")
    if blocks:
        return "\n".join([*verdict, *blocks])
    tail = _strip_prefixes(stderr[-80:])
    return "\n".join(tail).strip() or "(no output)"


def error_summary(text: str | None) -> str:
    """The one line that says what went wrong: a traceback's last line, else the first line."""
    if not text:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b.*", line) or line.startswith("timed out"):
            return line
    return lines[-1] if lines else ""
