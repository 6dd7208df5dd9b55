"""How ``dsrun train`` words the end of a run, and what it records about it.

* finished: the step count, throughput and eval loss, then where each output went (metrics, monitor files that
  were really written, checkpoints, the MLflow run);
* stopped (Ctrl-C, SIGTERM, SIGUSR1): at which step, whether and where a checkpoint was saved, the command that
  resumes; a preempted run (SIGTERM, SIGUSR1) whose ranks saved where they stopped exits with 138
  (``EXIT_PREEMPTED``: requeue), one stopped without that checkpoint with 143, Ctrl-C with 130;
* failed: the exit code, the first error a rank logged and where the logs are.

The MLflow run the ranks opened is marked ``KILLED`` when the run was stopped and ``FAILED`` when its ranks
failed (a rank that is killed cannot say so itself).
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dsrun.cli.multirun import short_path
from dsrun.launcher.protocol import EXIT_PREEMPTED, EXIT_STOPPED, PREEMPTION_SIGNALS
from dsrun.rundir import METRICS_JSON, PREEMPTED_JSON
from dsrun.utils.errors import UserError

if TYPE_CHECKING:
    from dsrun.runspec import ResolvedRun


def done_lines(resolved: ResolvedRun, run_dir: Path, metrics: dict[str, Any]) -> list[str]:
    """The closing lines of a run that finished."""
    losses = [e["loss"] for e in metrics["eval_losses"]]
    first = (f"done: {metrics['steps']} steps in {metrics['wall_time_s']:.1f}s, "
             f"{metrics['tokens_per_second']:,.0f} tokens/s; eval loss {losses[0]:.3f} -> {losses[-1]:.3f} "
             f"({metrics['loss_unit']})" if losses else "done")
    return [first, *where_outputs_went(resolved, run_dir)]


def stopped_lines(resolved: ResolvedRun, run_dir: Path, signum: int) -> list[str]:
    """The closing lines of a run stopped by ``signum``: where it stopped, the checkpoint, how to resume."""
    from dsrun.cli.resume import CHECKPOINTS, checkpoint_step

    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    metrics, record = _metrics(run_dir), preemption_record(run_dir)
    total = resolved.train.max_steps
    if metrics is not None:
        step = int(metrics.get("resumed_from_step") or 0) + int(metrics.get("steps") or 0)
        lines = [f"stopped by {how} after step {step} of {metrics.get('max_steps', total)}"]
    elif record is not None and record.get("step"):  # the grace period ended before the metrics were written
        lines = [f"stopped by {how} after step {record['step']} of {total}"]
    else:
        lines = [f"stopped by {how} before the first step finished"]
    missed = record is not None and not record.get("saved")
    if missed:
        grace = f"train.preemption.grace_s={record.get('grace_s', 0):g} s"
        lines[0] += (f"; the checkpoint there was not saved within {grace}" if record.get("reached_boundary", True)
                     else f"; step {int(record.get('step') or 0) + 1} did not end within {grace}")
    try:
        checkpoint = checkpoint_step(run_dir / CHECKPOINTS)
    except UserError:  # a damaged `latest`: --from says what is wrong with it
        checkpoint = None
    command = f"dsrun train --from {short_path(run_dir)}"
    if checkpoint is not None:
        tag, saved = checkpoint
        at = f"at step {saved} " if saved is not None else ""
        earlier = "an earlier " if missed else ""
        lines[0] += f"; {earlier}checkpoint saved {at}in {short_path(run_dir / CHECKPOINTS / tag)}"
        lines.append(f"resume: {command}")
    else:
        why = "none was due yet" if resolved.train.save_interval else "train.save_interval=0"
        lines[0] += "; no checkpoint saved" + ("" if missed else f" ({why})")
        lines.append(f"run it again: {command}")
    if signum in PREEMPTION_SIGNALS and record is not None:  # the ranks took it for a preemption
        code = stop_exit_code(run_dir, signum)
        lines[-1] += " (or the same command with train.resume=auto)"
        lines.append(f"exit code {code}: " + ("preempted, checkpoint saved where the ranks stopped (requeue the job)"
                                              if code == EXIT_PREEMPTED else "stopped without a checkpoint where the "
                                              "ranks stopped"))
    return lines


def preemption_record(run_dir: Path) -> dict[str, Any] | None:
    """``preempted.json``: what rank 0 recorded when SIGTERM or SIGUSR1 stopped the ranks (the signal, the step
    they stopped after, whether the checkpoint there was saved, the grace period); None when it was not."""
    try:
        record = json.loads((run_dir / PREEMPTED_JSON).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("signal") in signal.Signals.__members__ else None


def stop_signal(run_dir: Path, exit_code: int) -> int | None:
    """The signal that stopped a run whose launcher got none (a rank got it itself; under torchrun each rank is
    the process signalled): the preemption rank 0 recorded, else for the worker's own stop exit codes (138, 143)
    the signal rank 0 recorded in its metrics (SIGTERM when another rank got it); None when no signal stopped it."""
    record = preemption_record(run_dir)
    if record is not None:
        return signal.Signals[record["signal"]]
    if exit_code not in (EXIT_PREEMPTED, EXIT_STOPPED):
        return None
    by = (_metrics(run_dir) or {}).get("stopped_by_signal")
    return by if isinstance(by, int) else signal.SIGTERM


def stop_exit_code(run_dir: Path, signum: int) -> int:
    """``dsrun train``'s exit code for a run stopped by ``signum``: 138 when a preemption signal stopped it and the
    ranks saved the checkpoint where they stopped, 143 when they did not, 128 + the signal otherwise (Ctrl-C: 130)."""
    if signum not in PREEMPTION_SIGNALS:
        return 128 + signum
    record = preemption_record(run_dir)
    return EXIT_PREEMPTED if record is not None and record.get("saved") else EXIT_STOPPED


def _metrics(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / METRICS_JSON).read_text())
    except (OSError, ValueError):
        return None


# How a rank's error reads when it only followed another rank's failure (its peer left a collective): the
# summary names the rank that failed first, never one of these
PEER_FAILED = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote worker crash|remote process exit"
                         r"|NCCL communicator was aborted|DistNetworkError|DistBackendError")


def first_error(log_dir: Path, rank: int | None = None) -> str:
    """`` (rankN: <the exception>)``: the error of ``rank`` (the one the launcher found failed first), else of
    the first rank whose log holds a Python traceback that is not only a peer's failure seen from here (a gloo
    "Connection closed by peer"), else of the first with any traceback; '' when no log holds one."""
    def order(path: Path) -> tuple[bool, int, str]:  # the named rank first, then rank 0, 1, ..., 10
        number = int(re.match(r"rank(\d+)", path.name).group(1))
        return number != rank, number, path.name

    errors = []
    for log in sorted(log_dir.glob("rank[0-9]*.stderr.log"), key=order):
        text = log.read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            last = [line.strip() for line in text.splitlines() if line.strip()][-1]
            last = re.sub(r"^\[rank\d+\]:\s*", "", last)
            last = re.sub(r"^(\w+\.)+(?=\w+(Error|Exception|Interrupt)\b)", "", last)  # dsrun.x.UserError → UserError
            errors.append(f" ({log.name.split('.')[0]}: {last[:300]})")
    return next((e for e in errors if not PEER_FAILED.search(e)), errors[0] if errors else "")


def where_outputs_went(resolved: ResolvedRun, run_dir: Path) -> list[str]:
    """One line per output a user looks for after a run: metrics, monitor files, checkpoints, MLflow (paths
    relative to the current directory when they lie below it). A monitor whose folder holds no files is
    named as such, not advertised."""
    from dsrun.monitor.mlflow_monitor import sqlite_path

    ds = resolved.ds
    lines = [f"metrics: {short_path(run_dir / METRICS_JSON)}"]
    for name in ("csv_monitor", "tensorboard"):
        section = getattr(ds, name)
        if section.enabled:
            folder = Path(section.output_path or run_dir) / section.job_name
            wrote = folder.is_dir() and any(p.is_file() for p in folder.rglob("*"))
            lines.append(f"{name}: {short_path(folder)}" if wrote else
                         f"{name}: nothing was written to {short_path(folder)} (see the rank 0 log)")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        lines.append(f"checkpoints: {short_path(checkpoints)}")
    if ds.mlflow.enabled:
        uri, name = mlflow_run(resolved, run_dir)
        store = sqlite_path(uri)
        if store is not None:  # a local store: its file, and the command that browses it
            db = short_path(store)
            where = f"{db}; browse: mlflow ui --backend-store-uri sqlite:///{db}"
        else:
            where = uri
        lines.append(f"mlflow: run '{name}' (experiment '{ds.mlflow.experiment_name}') in {where}")
    return lines


def mlflow_run(resolved: ResolvedRun, run_dir: Path) -> tuple[str, str]:
    """(tracking URI, run name) of the MLflow run the ranks open, resolved as they resolve it."""
    from dsrun.monitor.mlflow_monitor import resolve_tracking_uri

    ds = resolved.ds
    uri = resolve_tracking_uri(ds.mlflow.tracking_uri, Path.cwd() / "mlruns")
    return uri, ds.mlflow.run_name or f"{run_dir.parent.name}/{run_dir.name}"


def mark_mlflow(resolved: ResolvedRun, run_dir: Path, started_ms: int, status: str,
                say: Callable[[str], None]) -> None:
    """Give the run's MLflow run the job's real ending (``FAILED`` or ``KILLED``)."""
    if not resolved.ds.mlflow.enabled:
        return
    from dsrun.monitor.mlflow_monitor import mark_run_ended

    uri, name = mlflow_run(resolved, run_dir)
    try:
        mark_run_ended(uri, resolved.ds.mlflow.experiment_name, name, started_ms, status)
    except Exception as err:  # noqa: BLE001 - the store is unreachable: the run itself is what matters
        first = next((line for line in str(err).splitlines() if line.strip()), "")  # SQLAlchemy appends its SQL
        say(f"warning: could not mark MLflow run '{name}' {status}: {type(err).__name__}: {first}")
