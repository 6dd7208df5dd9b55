"""Tune a recipe's DeepSpeed settings with Optuna: every trial is a short, real `dsrun train` launch.

The search space is the recipe's `tune.space` (from the `autotuning` config group: `autotuning=fast` tunes the
ZeRO stage x micro batch size, `autotuning=full` more ZeRO knobs); DeepSpeed's `ds.autotuning` section sets the
metric, profile steps, tuner and budget. The memory estimator prunes trials that cannot fit before they launch.
State is an Optuna SQLite study in the results dir: run the same command again to continue an interrupted study.

Examples:
  dsrun tune +recipe=gpt_tune                                   tune, write autotuning_results/
  dsrun tune +recipe=gpt_tune autotuning.tuner_type=random autotuning.tuner_num_trials=6
  dsrun tune +recipe=gpt_zero2 autotuning=fast --memory-limit 4GiB
  dsrun tune +recipe=gpt_tune --run                             then train with the best config
  dsrun tune +recipe=gpt_tune --slurm --srun-args="--partition=gpu --time=20"
                                                                every trial a Slurm job: srun starts one task
                                                                per rank (docs/cluster.md, "Slurm")
Outputs (docs/autotuning.md): RESULTS_DIR/<exp>/{cmd.txt,ds_config.json,exp.json,metrics.json,stdout.log,
stderr.log}, summary.txt, ds_config_optimal.json, cmd_optimal.txt, study.db.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsrun.cli.common import add_compose_arguments

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from optuna.trial import FrozenTrial

    from dsrun.autotuning import SearchSpace, Tuner, TuneSettings
    from dsrun.autotuning.results import TrialRow
    from dsrun.config.monitoring import MLflowConfig
    from dsrun.launcher.slurm_jobs import SrunTrials
    from dsrun.runspec import ResolvedRun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--run", action="store_true",
                        help="after tuning, train with the best config (cmd_optimal.txt), like DeepSpeed's "
                             "--autotuning run")
    parser.add_argument("--memory-limit", metavar="SIZE", default=None,
                        help="memory a trial may need per rank by the estimator (2GiB, 500MB, bytes); trials "
                             "above it are pruned before launch (default: tune.memory_limit, else this machine)")
    parser.add_argument("--trial-timeout", metavar="S", type=float, default=None,
                        help="seconds before a trial's launch is stopped and recorded as failed "
                             "(default: tune.trial_timeout, 600)")
    parser.add_argument("--slurm", action="store_true",
                        help="run every trial as a Slurm job of its own: srun starts launcher.num_procs tasks on "
                             "each of launcher.num_nodes nodes, each task one rank of the trial's dsrun train")
    parser.add_argument("--srun-args", metavar="ARGS", default="",
                        help="more srun options for each trial's job, with --slurm: "
                             '--srun-args="--partition=gpu --time=20"')
    add_compose_arguments(parser)
    parser.parse_args = parser.parse_intermixed_args  # type: ignore[method-assign]  # flags anywhere


def run(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from dsrun.autotuning import Tuner, build_space, settings_from
    from dsrun.compose import compose_runspec
    from dsrun.runspec import resolve_run

    cfg = compose_runspec(args.overrides, args.recipes_dir)
    resolved = resolve_run(cfg)
    raw = OmegaConf.select(cfg, "ds.autotuning")
    raw = OmegaConf.to_container(raw, resolve=True) if raw is not None else {}
    tune = OmegaConf.to_container(cfg.tune, resolve=True) if cfg.get("tune") is not None else None
    settings = settings_from(resolved.ds.autotuning, raw or {}, tune, Path.cwd(),
                             memory_limit=args.memory_limit, trial_timeout=args.trial_timeout)
    if not settings.space:
        from dsrun.utils.errors import Problem, UserError

        raise UserError(Problem("tune.space", "this recipe has no search space",
                                "add autotuning=fast (ZeRO stage x micro batch) or autotuning=full"))
    space = build_space(settings, resolved.ds_dict(), resolved.world_size)

    def compose(overrides: list[str]) -> tuple[DictConfig, ResolvedRun]:
        composed = compose_runspec(overrides, args.recipes_dir)
        return composed, resolve_run(composed)

    srun = _srun_trials(args, resolved)  # before any output: Slurm not reachable is a mistake of one line
    reporter = Reporter(settings, space, mlflow=resolved.ds.mlflow if resolved.ds.mlflow.enabled else None)
    tuner = Tuner(settings, space, args.overrides, args.recipes_dir, compose, on_event=reporter.event, srun=srun)
    return tune_and_report(tuner, reporter, args.run)


def _srun_trials(args: argparse.Namespace, resolved: ResolvedRun) -> SrunTrials | None:
    """``--slurm``: how each trial runs as a Slurm job (:class:`dsrun.launcher.slurm_jobs.SrunTrials`), once Slurm
    is known to answer; None without it."""
    import shlex

    from dsrun.launcher.slurm_jobs import SrunTrials, unreachable
    from dsrun.utils.errors import Problem, UserError

    if not args.slurm:
        if args.srun_args:
            raise UserError(Problem("--srun-args", "is for trials run as Slurm jobs", "add --slurm"))
        return None
    problem = unreachable(where="--slurm", local="or leave out --slurm to run the trials on this machine",
                          clients=("srun", "scontrol"))
    if problem is not None:
        raise UserError(problem)
    launcher = resolved.runspec.launcher
    return SrunTrials(int(launcher.get("num_nodes") or 1), int(launcher.num_procs), tuple(shlex.split(args.srun_args)))


def tune_and_report(tuner: Tuner, reporter: "Reporter", run_best: bool) -> int:
    """Run the study with progress, write the results, and with ``run_best`` run ``cmd_optimal.txt``
    (``dsrun tune`` and ``dsrun launch --autotuning``)."""
    import subprocess

    from dsrun.autotuning import write_results

    reporter.tuner = tuner
    reporter.print_header()
    try:
        with reporter:
            tuner.run()
    except KeyboardInterrupt:
        if tuner.study is not None:
            reporter.interrupted()
            write_results(tuner)
            print(f"[tune] interrupted; run the same command again to continue (study in {tuner.db_path})",
                  file=sys.stderr, flush=True)
        raise
    paths = write_results(tuner)
    reporter.finish(paths)
    if "cmd_optimal" not in paths:
        print(f"[tune] no trial completed, so there is no optimal config; see {paths['summary']}",
              file=sys.stderr, flush=True)
        return 1
    if run_best:
        import shlex

        command = shlex.split(paths["cmd_optimal"].read_text())
        print(f"[tune] training with the best config: {shlex.join(command)}", flush=True)
        return subprocess.run(command, stdin=subprocess.DEVNULL).returncode
    return 0


class Reporter:
    """Progress while tuning (a rich progress bar on a terminal, one line per trial always), the rich table at
    the end, and with MLflow on a parent run with one child run per trial."""

    def __init__(self, settings: TuneSettings, space: SearchSpace, mlflow: MLflowConfig | None = None):
        from rich.console import Console

        self.settings = settings
        self.space = space
        self.console = Console(highlight=False)
        if not self.console.is_terminal:  # logs and CI: wide enough for the table's notes
            self.console = Console(highlight=False, width=160)
        self.tuner: Tuner | None = None
        self.progress: Any = None
        self.task: Any = None
        self.running: int | None = None  # the number of the trial that is running, if any
        self.mlflow = _MLflowTrials(mlflow, settings) if mlflow is not None else None

    def print_header(self) -> None:
        s = self.settings
        self._say(f"[tune] search space: {self.space.describe()}")
        if self.space.ignored:
            self._say(f"[tune] fast mode: {', '.join(self.space.ignored)} keep the recipe's value")
        limit = f"{s.memory_limit / 2**20:,.1f} MiB per rank" if s.memory_limit else "this machine's memory"
        self._say(f"[tune] metric {s.metric} ({s.unit}) over steps {s.start_profile_step}..{s.end_profile_step}; "
                  f"tuner {s.tuner_type}; up to {s.tuner_num_trials} trials; memory limit: {limit}; "
                  f"results in {s.results_dir}")

    def __enter__(self) -> "Reporter":
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=self.console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task("tuning", total=min(self.settings.tuner_num_trials, self.space.size))
        return self

    def __exit__(self, *exc: object) -> None:  # the exception, if any, goes on
        if self.progress is not None:
            self.progress.stop()

    def _say(self, text: str) -> None:
        (self.progress.console if self.progress else self.console).print(text, soft_wrap=True, markup=False)

    def event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "requeued":
            self._say(f"[tune] resuming: trial(s) {data['trials']} were interrupted; their configurations run again")
        elif kind == "model_info_start":
            self._say(f"[tune] model info run in {data['dir']}")
        elif kind == "model_info" and data.get("num_params") is None:
            self._say(f"[tune] model: {data.get('source')}")
        elif kind == "model_info":
            self._say(f"[tune] model: {data.get('num_params'):,} parameters; activation memory (micro batch 1) "
                      f"{int(data.get('activation_mem_per_gpu') or 0) / 2**20:,.2f} MiB")
        elif kind == "trial_start":
            self.running = data["number"]
            self._say(f"[tune] trial {data['index']}/{data['total']} (#{data['number']}) {data['name']} ...")
            if self.progress is not None:
                self.progress.update(self.task, description=f"trial {data['index']}/{data['total']} {data['name']}")
        elif kind == "trial_end":
            self.running = None
            trial, best = data["trial"], data["best"]
            attrs = trial.user_attrs
            if trial.value is not None and trial.state.name == "COMPLETE":
                outcome = f"{trial.value:,.4g} {self.settings.unit}"
            elif trial.state.name == "PRUNED":
                outcome = f"pruned: {attrs.get('reason')}"
            else:
                outcome = f"FAILED: {attrs.get('error_line')}"
            best_text = (f"best {best.value:,.4g} ({best.user_attrs.get('exp_name')}, trial {best.number})"
                         if best is not None else "no best yet")
            self._say(f"[tune]   -> {outcome} | {best_text}")
            if self.progress is not None:
                self.progress.advance(self.task)
            if self.mlflow is not None:
                self.mlflow.log_trial(trial, self.settings.results_dir / str(attrs.get("exp_name")))

    def interrupted(self) -> None:
        """Ctrl-C: the trial that was running gets its MLflow child run too, as ``KILLED``."""
        if self.mlflow is None or self.running is None:
            return
        trial = next((t for t in self.tuner.study.get_trials(deepcopy=False) if t.number == self.running), None)
        if trial is not None:
            self.mlflow.log_trial(trial, self.settings.results_dir / str(trial.user_attrs.get("exp_name")),
                                  status="KILLED")

    def finish(self, paths: dict[str, Path]) -> None:
        from rich.table import Table

        from dsrun.autotuning import best_row, trial_rows

        rows = trial_rows(self.tuner.study)
        table = Table(title=f"dsrun tune: {self.settings.metric} ({self.settings.unit})")
        for name, justify in (("trial", "right"), ("experiment", "left"), ("status", "left"),
                              (self.settings.metric, "right"), ("latency ms", "right"), ("comm MB/step", "right"),
                              ("note", "left")):
            table.add_column(name, justify=justify, overflow="fold")
        best = best_row(rows, self.settings)
        for r in rows:
            style = "bold green" if best is not None and r.number == best.number else None
            table.add_row(str(r.number), r.name, r.status, f"{r.value:,.4g}" if r.value is not None else "",
                          f"{r.metrics['latency']:,.2f}" if r.metrics.get("latency") else "",
                          f"{r.comm_bytes / 1e6:,.3f}" if r.comm_bytes is not None else "", r.note[:120],
                          style=style)
        self.console.print(table)
        self.console.print(f"[tune] stopped: {self.tuner.stop.text}", markup=False)
        if best is not None:
            self.console.print(f"[tune] {best.name} is the optimal setup after tuning ({best.value:,.4g} "
                               f"{self.settings.unit}). The exp result is at {self.settings.results_dir / best.name}.",
                               markup=False, soft_wrap=True)
        for key, path in paths.items():
            self.console.print(f"[tune] {key}: {path}", markup=False, soft_wrap=True)
        if self.mlflow is not None:
            self.mlflow.finish(best)


class _MLflowTrials:
    """A parent run for the study (keyed by its results dir, so a resumed study keeps its parent) and a child
    run per finished trial: params, status, the metric, and the experiment's files as artifacts."""

    def __init__(self, section: MLflowConfig, settings: TuneSettings):
        from dsrun.monitor.mlflow_monitor import resolve_tracking_uri

        self.uri = resolve_tracking_uri(section.tracking_uri, Path.cwd() / "mlruns")
        self.experiment = section.experiment_name or "dsrun"
        self.key = f"dsrun-tune:{settings.results_dir}"
        self.settings = settings
        self.parent_id: str | None = None

    def log_trial(self, trial: FrozenTrial, exp_dir: Path, status: str | None = None) -> None:
        from dsrun.monitor.mlflow_monitor import MLflowMonitor

        attrs = trial.user_attrs
        monitor = MLflowMonitor(self.uri, self.experiment, run_name=f"trial {trial.number} {attrs.get('exp_name')}",
                                parent_key=self.key, tags={"dsrun.tune.trial": str(trial.number),
                                                           "dsrun.tune.status": trial.state.name.lower()})
        self.parent_id = monitor.client.get_run(monitor.run_id).data.tags.get("mlflow.parentRunId")
        monitor.log_params({**(attrs.get("config") or trial.params), "exp_name": attrs.get("exp_name"), "kind": attrs.get("kind"),
                            "note": attrs.get("reason") or attrs.get("error_line") or ""})
        events = [(f"autotuning/{k}", v, 0) for k, v in (attrs.get("metrics") or {}).items() if v is not None]
        comm = attrs.get("estimated_comm_per_step") or {}
        events += [(f"autotuning/estimated_comm_{k}", float(v), 0) for k, v in comm.items() if isinstance(v, (int, float))]
        monitor.write_events(events)
        monitor.log_artifacts([exp_dir / n for n in ("cmd.txt", "ds_config.json", "exp.json", "metrics.json",
                                                     "stderr.log")] if exp_dir.is_dir() else [])
        monitor.close(status or ("FINISHED" if trial.state.name == "COMPLETE" else
                                 "KILLED" if trial.state.name == "PRUNED" else "FAILED"))

    def finish(self, best: TrialRow | None) -> None:
        if best is None:
            return
        import time

        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        from dsrun.monitor.mlflow_monitor import PARENT_KEY_TAG

        client = MlflowClient(tracking_uri=self.uri)
        if self.parent_id is None:  # a resumed study that launched nothing this time: find its parent
            experiment = client.get_experiment_by_name(self.experiment)
            found = client.search_runs([experiment.experiment_id], f"tags.`{PARENT_KEY_TAG}` = '{self.key}'",
                                       max_results=1) if experiment else []
            if not found:
                return
            self.parent_id = found[0].info.run_id
        client.log_batch(self.parent_id, metrics=[Metric(f"best_{self.settings.metric}", float(best.value),
                                                         int(time.time() * 1000), 0)])
        client.set_tag(self.parent_id, "dsrun.tune.best_exp_name", best.name)
        client.set_tag(self.parent_id, "dsrun.tune.best_trial", str(best.number))
