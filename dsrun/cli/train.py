"""Compose a recipe and train it. Each run gets its own directory (outputs/DATE/TIME/, Hydra's).

Examples:
  dsrun train                                   the default recipe
  dsrun train +recipe=gpt_zero3 launcher.num_procs=2
  dsrun train --dry-run +recipe=gpt_zero3       compose, validate, write the run directory; launch nothing
  dsrun train ds_config=my_ds_config.json       your DeepSpeed JSON, merged into the recipe's ds section
  dsrun train -m zero=stage1,stage2 optimizer.params.lr=1e-4,3e-4   a Hydra multirun sweep
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dsrun.cli.common import add_compose_arguments
from dsrun.utils.errors import EXIT_USAGE, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--dry-run", action="store_true",
                        help="compose, validate, resolve batch sizes, write the run directory and print the "
                             "plan; launch nothing")
    parser.add_argument("-m", "--multirun", action="store_true", help="Hydra multirun: one job per combination")
    add_compose_arguments(parser)
    from dsrun.compose import list_recipes

    try:
        names = ", ".join(list_recipes())
        parser.epilog = f"recipes: {names} (details: dsrun recipes)"
    except UserError:
        pass


def run(args: argparse.Namespace) -> int:
    import sys

    from dsrun.compose import app_overrides, compose_runspec, finish_runspec, run_app
    from dsrun.runspec import resolve_run

    if not args.multirun:
        resolve_run(compose_runspec(args.overrides, args.recipes_dir))  # fail fast, before any run directory
    hydra_overrides = app_overrides(args.overrides, args.recipes_dir)

    def task(cfg):
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            resolved = resolve_run(finish_runspec(cfg, hydra_overrides))
            return _dry_run(resolved, run_dir) if args.dry_run else _train(resolved, run_dir)
        except UserError as err:
            for problem in err.problems:
                print(f"error: {problem}", file=sys.stderr)
            sys.exit(EXIT_USAGE)

    run_app(task, args.overrides, args.recipes_dir, multirun=args.multirun)
    return 0


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


def _train(resolved, run_dir: Path):
    """Launch the worker on every rank of the plan; return the final eval loss (what sweepers optimise)."""
    import json
    import sys

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
        sys.exit(code)
    metrics = json.loads(metrics_path.read_text())
    losses = [e["loss"] for e in metrics["eval_losses"]]
    print(f"[dsrun] done: {metrics['steps']} steps in {metrics['wall_time_s']:.1f}s, "
          f"{metrics['tokens_per_second']:,.0f} tokens/s; eval loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"({metrics['loss_unit']})" if losses else "[dsrun] done", flush=True)
    for line in where_outputs_went(resolved, run_dir):
        print(f"[dsrun] {line}", flush=True)
    return metrics.get("final_eval_loss")


def where_outputs_went(resolved, run_dir: Path) -> list[str]:
    """One line per output a user looks for after a run: metrics, monitor files, checkpoints, MLflow."""
    import os

    from dsrun.rundir import METRICS_JSON

    ds = resolved.ds
    lines = [f"metrics: {run_dir / METRICS_JSON}"]
    for name in ("csv_monitor", "tensorboard"):
        section = getattr(ds, name)
        if section.enabled:
            lines.append(f"{name}: {Path(section.output_path or run_dir) / section.job_name}")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        lines.append(f"checkpoints: {checkpoints}")
    if ds.mlflow.enabled:
        uri = ds.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or str(Path.cwd() / "mlruns")
        lines.append(f"mlflow: experiment '{ds.mlflow.experiment_name}' in {uri}")
    return lines
