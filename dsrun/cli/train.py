"""Compose a recipe and train it. Each run gets its own directory (outputs/DATE/TIME/, Hydra's).

Examples:
  dsrun train                                   the default recipe
  dsrun train +recipe=gpt_zero3 launcher.num_procs=2
  dsrun train --dry-run +recipe=gpt_zero3       compose, validate, write the run directory; launch nothing
  dsrun train ds_config=my_ds_config.json       your DeepSpeed JSON, merged into the recipe's ds section
  dsrun train -m zero=stage1,stage2 optimizer.params.lr=1e-4,3e-4   a Hydra multirun sweep: one job each,
                                                a summary table of the jobs at the end
  dsrun train -m hydra/sweeper=optuna hydra.sweeper.n_trials=20 'optimizer.params.lr=tag(log, interval(1e-5, 1e-2))'
                                                an Optuna search minimising the final eval loss (docs/sweeps.md)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsrun.cli.common import add_compose_arguments
from dsrun.utils.errors import EXIT_USAGE, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--dry-run", action="store_true",
                        help="compose, validate, resolve batch sizes, write the run directory and print the "
                             "plan; launch nothing")
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="Hydra multirun: one job per combination (or per trial with hydra/sweeper=optuna), "
                             "then a table of the jobs")
    add_compose_arguments(parser)
    from dsrun.compose import list_recipes

    try:
        names = ", ".join(list_recipes())
        parser.epilog = f"recipes: {names} (details: dsrun recipes)"
    except UserError:
        pass


def run(args: argparse.Namespace) -> int:
    from dsrun.cli.multirun import JobResult, first_job_overrides, summary_table, unknown_sweep_options
    from dsrun.compose import app_overrides, compose_runspec, finish_runspec, run_app
    from dsrun.config import announce
    from dsrun.runspec import resolve_run

    if not args.multirun:
        resolve_run(compose_runspec(args.overrides, args.recipes_dir))  # fail fast, before any run directory
    else:  # a misspelt key or option fails the sweep at once; a bad value fails only its own job
        problems = unknown_sweep_options(args.overrides, args.recipes_dir)
        if problems:
            raise UserError(problems)
        compose_runspec(first_job_overrides(args.overrides), args.recipes_dir)
    hydra_overrides = app_overrides(args.overrides, args.recipes_dir)
    jobs: list[JobResult] = []  # a sweep's jobs, in the order they ran

    def task(cfg):
        """One job: compose, launch, and return the final eval loss (what a sweeper optimises)."""
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        job = JobResult(len(jobs), list(hydra_cfg.overrides.task), run_dir)
        try:
            resolved = resolve_run(finish_runspec(cfg, hydra_overrides))
            announce(resolved.ds, for_children=True)  # what it runs without: said once, not again by the ranks
            if args.dry_run:
                return _dry_run(resolved, run_dir)
            metrics = _train(resolved, run_dir)
            job.final_eval_loss, job.tokens_per_second = metrics.get("final_eval_loss"), metrics["tokens_per_second"]
        except UserError as err:
            for problem in err.problems:
                print(f"error: {problem}", file=sys.stderr)
            job.error = "; ".join(str(p) for p in err.problems)
            if not args.multirun:
                sys.exit(EXIT_USAGE)
        except TrainingFailed as err:
            job.error = str(err)
            if not args.multirun:
                sys.exit(err.exit_code)
        finally:
            jobs.append(job)
            if args.multirun and not args.dry_run:  # the table so far, kept even if the sweep is killed
                sweep_dir = Path(hydra_cfg.sweep.dir)
                sweep_dir.mkdir(parents=True, exist_ok=True)
                (sweep_dir / "summary.txt").write_text(summary_table(jobs, sweep_dir) + "\n")
        # a failed job returns None: the sweep goes on, and an Optuna sweeper records the trial as failed
        return job.final_eval_loss

    run_app(task, args.overrides, args.recipes_dir, multirun=args.multirun)
    if args.multirun and jobs and not args.dry_run:
        print(summary_table(jobs, jobs[0].run_dir.parent), flush=True)  # a job runs in <sweep dir>/<N>
        return 1 if any(not job.ok for job in jobs) else 0
    return 0


class TrainingFailed(Exception):
    """The ranks of a run exited with an error; the message says where to look."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _dry_run(resolved, run_dir: Path) -> None:
    from dsrun.rundir import write_run_files

    paths = write_run_files(run_dir, resolved)
    ds = resolved.ds
    model = resolved.runspec.model
    sizes = ", ".join(f"{k}={v}" for k, v in model.items() if k != "_target_")
    precision = "bf16" if ds.bf16.enabled else "fp16" if ds.fp16.enabled else "fp32"
    lines = [
        f"run directory   {run_dir}",
        f"model           {model._target_}({sizes})",
        f"data            {resolved.runspec.data._target_}",
        f"world size      {resolved.world_size} ({resolved.world_size_source})",
        "batch           " + ds.batch_explanation.replace("\n", "\n                "),
        f"zero stage      {ds.zero_optimization.stage}",
        f"precision       {precision}",
        f"optimizer       {ds.optimizer.type or '(client optimizer)'}",
        f"scheduler       {ds.scheduler.type or '(none)'}",
        f"steps           {resolved.train.max_steps}",
        f"wrote           {paths['resolved']}",
        f"                {paths['ds_config']}",
        "dry run: nothing launched",
    ]
    print("\n".join(lines))


def _train(resolved, run_dir: Path) -> dict:
    """Launch the worker on every rank of the plan; return the run's metrics (``metrics.json``)."""
    import json

    from dsrun.launcher import launch_from_mapping
    from dsrun.rundir import METRICS_JSON, write_run_files
    from dsrun.runspec import WORKER_MODULE

    write_run_files(run_dir, resolved)
    print(f"[dsrun] run directory {run_dir}", flush=True)
    launcher = dict(resolved.runspec.launcher)
    launcher["log_dir"] = launcher.get("log_dir") or str(run_dir / "logs")
    code = launch_from_mapping(launcher, WORKER_MODULE, ["--run-dir", str(run_dir)], module=True)
    metrics_path = run_dir / METRICS_JSON
    if code != 0:
        print(f"[dsrun] training failed (exit code {code}); logs per rank in {launcher['log_dir']}",
              file=sys.stderr, flush=True)
        raise TrainingFailed(f"exit code {code}{_first_error(Path(launcher['log_dir']))}", code)
    metrics = json.loads(metrics_path.read_text())
    losses = [e["loss"] for e in metrics["eval_losses"]]
    print(f"[dsrun] done: {metrics['steps']} steps in {metrics['wall_time_s']:.1f}s, "
          f"{metrics['tokens_per_second']:,.0f} tokens/s; eval loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"({metrics['loss_unit']})" if losses else "[dsrun] done", flush=True)
    for line in where_outputs_went(resolved, run_dir):
        print(f"[dsrun] {line}", flush=True)
    return metrics


def _first_error(log_dir: Path) -> str:
    """`` (rankN: <the exception>)`` from the first rank log that holds a Python traceback, or ''."""
    import re

    for log in sorted(log_dir.glob("rank*.stderr.log")):
        text = log.read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            last = [line.strip() for line in text.splitlines() if line.strip()][-1]
            last = re.sub(r"^\[rank\d+\]:\s*", "", last)
            last = re.sub(r"^(\w+\.)+(?=\w+(Error|Exception|Interrupt)\b)", "", last)  # dsrun.x.UserError → UserError
            return f" ({log.name.split('.')[0]}: {last[:300]})"
    return ""


def where_outputs_went(resolved, run_dir: Path) -> list[str]:
    """One line per output a user looks for after a run: metrics, monitor files, checkpoints, MLflow (paths
    relative to the current directory when they lie below it)."""
    from dsrun.cli.multirun import short_path
    from dsrun.monitor.mlflow_monitor import resolve_tracking_uri, sqlite_path
    from dsrun.rundir import METRICS_JSON

    ds = resolved.ds
    lines = [f"metrics: {short_path(run_dir / METRICS_JSON)}"]
    for name in ("csv_monitor", "tensorboard"):
        section = getattr(ds, name)
        if section.enabled:
            lines.append(f"{name}: {short_path(Path(section.output_path or run_dir) / section.job_name)}")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        lines.append(f"checkpoints: {short_path(checkpoints)}")
    if ds.mlflow.enabled:
        uri = resolve_tracking_uri(ds.mlflow.tracking_uri, Path.cwd() / "mlruns")  # as the worker resolved it
        name = ds.mlflow.run_name or f"{run_dir.parent.name}/{run_dir.name}"
        store = sqlite_path(uri)
        if store is not None:  # a local store: its file, and the command that browses it
            db = short_path(store)
            where = f"{db}; browse: mlflow ui --backend-store-uri sqlite:///{db}"
        else:
            where = uri
        lines.append(f"mlflow: run '{name}' (experiment '{ds.mlflow.experiment_name}') in {where}")
    return lines
