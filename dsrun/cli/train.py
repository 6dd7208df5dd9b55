"""Compose a recipe and train it. Each run gets its own directory (outputs/DATE/TIME/, Hydra's).

Examples:
  dsrun train                                   the default recipe
  dsrun train +recipe=gpt_zero3 launcher.num_procs=2
  dsrun train --dry-run +recipe=gpt_zero3       compose, validate, check memory, write the run directory,
                                                build every rank's engine on a fake process group and print
                                                its groups and partitions; launch nothing (docs/dry_run.md)
  torchrun --nproc-per-node 2 -m dsrun train +recipe=gpt_zero3
                                                under torchrun, srun or mpirun: this process becomes that rank;
                                                rank 0's run directory is every rank's, launcher keys that
                                                conflict with the outer launcher are refused (docs/torchrun.md)
  dsrun train launcher=ray launcher.num_procs=2 launcher.max_failures=3 train.save_interval=50
                                                the ranks are Ray Train workers; a failed worker's group is
                                                restarted from the last checkpoint (docs/cluster.md, "Ray")
  dsrun train ds_config=my_ds_config.json       your DeepSpeed JSON, merged into the recipe's ds section
  dsrun train train.save_interval=50 train.resume=auto
                                                resume from the newest checkpoint of an earlier run with the
                                                same recipe and overrides (docs/checkpoint.md)
  dsrun train --from outputs/2026-01-31/12-00-00
                                                resume that run from its newest checkpoint (or run it again)
  dsrun train train.save_interval=50 checkpoint=decoupled
                                                decoupled saves: training waits only while each rank copies its
                                                state to host memory; a background thread writes and publishes
                                                the checkpoint (ds.checkpoint.writer.decoupled; docs/checkpoint.md)
  dsrun train train.resume=auto train.preemption.grace_s=90
                                                on SIGTERM/SIGUSR1 (a scheduler's preemption) every rank finishes
                                                its step and saves a checkpoint there within 90 s, exit code 138;
                                                the same command again resumes (docs/cluster.md)
  dsrun train -m zero=stage1,stage2 optimizer.params.lr=1e-4,3e-4   a Hydra multirun sweep: one job each,
                                                a summary table of the jobs at the end
  dsrun train -m hydra/sweeper=optuna hydra.sweeper.n_trials=20 'optimizer.params.lr=tag(log, interval(1e-5, 1e-2))'
                                                an Optuna search minimising the final eval loss (docs/sweeps.md)
  dsrun train -m hydra/launcher=submitit_slurm hydra.launcher.partition=gpu zero=stage2,stage3
                                                every job a Slurm job (one array), every rank an srun task; the
                                                time-limit notice saves, requeues, resumes (docs/cluster.md)

Before any rank starts, the run is checked: unset values, data files, the model's shape against the data,
train.resume, monitor folders, and memory by the estimator (docs/estimate.md).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dsrun.cli.common import add_compose_arguments
from dsrun.utils.errors import EXIT_USAGE, Problem, UserError

if TYPE_CHECKING:
    from dsrun.cli.outer_rank import RunHandoff
    from dsrun.cli.preflight import Preflight
    from dsrun.launcher.outer import OuterRank
    from dsrun.launcher.slurm_jobs import TaskRendezvous
    from dsrun.rundir import LauncherLog
    from dsrun.runspec import ResolvedRun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--dry-run", action="store_true",
                        help="compose, validate, resolve batch sizes, check memory, write the run directory, "
                             "build each rank's model and engine in turn on torch's fake process group and print "
                             "the plan with every rank's groups and ZeRO/pipeline/expert partitions; launch nothing")
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="Hydra multirun: one job per combination (or per trial with hydra/sweeper=optuna), "
                             "then a table of the jobs")
    parser.add_argument("--from", dest="from_dir", metavar="RUN_DIR", default=None,
                        help="rerun a run from its directory alone: resume from its newest checkpoint, or start "
                             "again when it has none or had finished; OVERRIDES set keys on top "
                             "(train.max_steps=600 continues a finished run)")
    parser.add_argument("--skip-memory-check", action="store_true",
                        help="launch even when the memory estimator says the run does not fit this machine")
    add_compose_arguments(parser)
    from dsrun.compose import list_recipes

    try:
        names = ", ".join(list_recipes())
        parser.epilog = f"recipes: {names} (details: dsrun recipes)"
    except UserError:
        pass


class TrainingFailed(Exception):
    """The ranks of a run exited with an error; the message says where to look."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TrainingStopped(Exception):
    """The run was stopped by a signal (Ctrl-C, SIGTERM, SIGUSR1); the closing lines are printed already.
    ``exit_code``: 138 for a preempted run whose ranks saved where they stopped, else 128 + the signal (143 for
    SIGTERM and SIGUSR1 alike: 138 means the checkpoint)."""

    def __init__(self, signum: int, exit_code: int | None = None) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
        self.exit_code = 128 + signum if exit_code is None else exit_code


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dsrun.launcher.outer import SYSTEM_PORT, detect_outer_launcher
    from dsrun.launcher.slurm_jobs import TasksApart, batch_rendezvous

    outer = detect_outer_launcher()  # torchrun, srun or mpirun made this process a rank: become it
    if outer is None:
        return _run(args, None)
    from dsrun import comm
    from dsrun.cli.outer_rank import RunHandoff

    if args.multirun or args.dry_run:
        flag = "-m" if args.multirun else "--dry-run"
        raise UserError(Problem(flag, f"is not run as a rank of {outer.launcher} ({outer.variable('rank')})",
                                f"run dsrun train {flag} outside {outer.launcher}"))
    rendezvous = batch_rendezvous(outer)  # an srun task of dsrun export-job's sbatch script: meet in the run dir
    if rendezvous is not None:
        outer = replace(outer, master_port=SYSTEM_PORT)
    handoff = RunHandoff() if outer.rank == 0 else None
    try:
        code = _run(args, outer, handoff, rendezvous)
    except TasksApart as err:  # the tasks did not meet: one line, as a submitted job's row says it
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    except BaseException as err:  # rank 0 stopped before the run: the others leave with its exit code
        if handoff is not None:
            handoff.close(err)
        if rendezvous is not None and not comm.is_initialized():  # the tasks waiting for this one leave at once
            rendezvous.fail(f"{type(err).__name__}: {(str(err).splitlines() or [''])[0].strip()}")
        raise
    if handoff is not None:
        handoff.close(None)
    return code


def _run(args: argparse.Namespace, outer: OuterRank | None, handoff: RunHandoff | None = None,
         rendezvous: TaskRendezvous | None = None) -> int:
    """``dsrun train``; with ``outer``, as that rank of an outer launcher's job (dsrun.cli.outer_rank): every rank
    checks the recipe, then the ranks meet (through ``rendezvous`` when given: dsrun.cli.submitted), rank 0 runs
    Hydra and hands its run directory over ``handoff``."""
    from dsrun.cli.common import say_stage

    # the first line comes before Hydra and torch are imported: they cost seconds of CPU on a busy machine
    say_stage(f"composing {f'the run of {args.from_dir}' if args.from_dir else 'the config'} (Hydra)")
    from dsrun.cli.multirun import (JobResult, first_job_overrides, summary_table, take_submitted_jobs,
                                    unknown_sweep_options, write_job_result)
    from dsrun.cli.resume import RunFinished, from_overrides, settle_from, source_run
    from dsrun.cli.submitted import JobPlace, follow_job_rank_zero, prepare_submission
    from dsrun.launcher.slurm_jobs import TasksApart
    from dsrun.compose import app_overrides, compose_runspec, finish_runspec, run_app
    from dsrun.config import announce
    from dsrun.runspec import resolve_run

    command = ["dsrun", *sys.argv[1:]]
    source = source_run(args.from_dir) if args.from_dir else None
    overrides = from_overrides(source, args.overrides) if source is not None else list(args.overrides)
    checked = first = None
    if source is not None and args.multirun:
        raise UserError(Problem("--from", "reruns one run; it does not take -m", "leave out -m"))
    if not args.multirun:  # fail fast, before any run directory
        first = resolved = resolve_run(compose_runspec(overrides, args.recipes_dir, source=source), outer=outer)
        if outer is not None:  # every rank refused a conflicting launcher key above; now they meet
            from dsrun.cli.outer_rank import follow_rank_zero, join_world
            from dsrun.cli.submitted import meet_in_run_dir

            if rendezvous is not None:
                meet_in_run_dir(outer, rendezvous)
            else:
                join_world(outer)
            if handoff is None:
                return follow_rank_zero()
        checked = _check(resolved, args)
        if source is not None:  # a damaged `latest` in the source is refused here already
            settle_from(resolved, source, overrides)
    else:  # a misspelt key or option fails the sweep at once; a bad value fails only its own job
        problems = unknown_sweep_options(args.overrides, args.recipes_dir)
        if problems:
            raise UserError(problems)
        first_spec = compose_runspec(first_job_overrides(args.overrides), args.recipes_dir)
        overrides = prepare_submission(overrides, first_spec)  # hydra/launcher=submitit_*: dsrun's settings
    hydra_overrides = app_overrides(overrides, args.recipes_dir, source=source)
    jobs: list[JobResult] = []  # a sweep's jobs, in the order they ran

    def task(cfg):
        """One job: compose, check, launch, and return the final eval loss (what a sweeper optimises)."""
        from hydra.core.hydra_config import HydraConfig

        from dsrun.rundir import LauncherLog

        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        # a sweep's job a submitit launcher started (dsrun.cli.submitted), or one in this process
        place = JobPlace.here(run_dir) if args.multirun else JobPlace(None)
        max_requeues = int(hydra_cfg.launcher.get("max_num_timeout") or 0) if place.executor else 0
        job = JobResult(hydra_cfg.job.num if place.executor else len(jobs), list(hydra_cfg.overrides.task), run_dir)
        log = LauncherLog(run_dir)
        try:
            with quiet_legacy_notes(not args.multirun):  # the single run's notes were shown already
                resolved = resolve_run(finish_runspec(cfg, hydra_overrides), reuse=first,  # ds once
                                       outer=place.rank or outer)
            if place.rank is not None and not place.meet():  # an srun task of a Slurm job, not rank 0
                follow_job_rank_zero(place, max_requeues)
                return None
            announce(resolved.ds, for_children=True)  # what it runs without: said once, not again by the ranks
            preflight = checked or _check(resolved, args)
            resolved, resume_line = _settle_resume(resolved, run_dir, job.overrides, args, source, overrides,
                                                   requeued=place.executor is not None)
            record = Record(command, _lineage(source, job.overrides), preflight.data)
            if args.dry_run:
                return _dry_run(resolved, run_dir, preflight, resume_line, record)
            if (place.handoff or handoff) is not None:
                metrics = _train_as_rank(resolved, run_dir, preflight, resume_line, record, log,
                                         place.handoff or handoff)
            else:
                metrics = _train(resolved, run_dir, preflight, resume_line, record, log)
            job.final_eval_loss, job.tokens_per_second = metrics.get("final_eval_loss"), metrics["tokens_per_second"]
        except RunFinished as finished:  # train.resume=auto found the run done: nothing launched
            log.say(str(finished))
            job.final_eval_loss = finished.final_eval_loss()
        except UserError as err:
            for problem in err.problems:
                log.say(f"error: {problem}", err=True, prefix=False)
            job.error = "; ".join(str(p) for p in err.problems)
            if not args.multirun:
                sys.exit(EXIT_USAGE)
        except TrainingFailed as err:
            job.error = str(err)
            if not args.multirun:
                sys.exit(err.exit_code)
        except TrainingStopped as err:
            job.error = "stopped"
            if not args.multirun:
                sys.exit(err.exit_code)
            if place.executor is None:
                raise KeyboardInterrupt from None  # Ctrl-C stops the sweep, not only its job
            job.error = place.stopped(err.exit_code, max_requeues)  # or JobStopped: the launcher requeues the job
        except TasksApart as err:  # a submitted job's srun tasks did not meet: one line, the job failed
            log.say(f"error: {err}", err=True, prefix=False)
            job.error = str(err)
        except Exception as err:
            if place.executor is not None:
                # Hydra's job runner keeps what a job raised to itself, and submitit then reports the job done:
                # the job's row and the tasks waiting for this one say it failed, and why
                job.error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0].strip()}"
            raise
        finally:
            log.close()
            place.close(job.error)
            jobs.append(job)
            if place.reports:  # the job's row, for dsrun train -m in the process that submitted it
                write_job_result(job)
            elif args.multirun and not args.dry_run:  # the table so far, kept even if the sweep is killed
                sweep_dir = Path(hydra_cfg.sweep.dir)
                sweep_dir.mkdir(parents=True, exist_ok=True)
                (sweep_dir / "summary.txt").write_text(summary_table(jobs, sweep_dir) + "\n")
        # a failed job returns None: the sweep goes on, and an Optuna sweeper records the trial as failed
        return job.final_eval_loss

    run_app(task, overrides, args.recipes_dir, multirun=args.multirun, source=source)
    if args.multirun and not jobs:  # the jobs ran where a submitit launcher put them: their rows came back
        jobs.extend(take_submitted_jobs())
        if jobs and not args.dry_run:
            (jobs[0].run_dir.parent / "summary.txt").write_text(summary_table(jobs, jobs[0].run_dir.parent) + "\n")
    if args.multirun and jobs and not args.dry_run:
        print(summary_table(jobs, jobs[0].run_dir.parent), flush=True)  # a job runs in <sweep dir>/<N>
        return 1 if any(not job.ok for job in jobs) else 0
    return 0


def _check(resolved: ResolvedRun, args: argparse.Namespace) -> Preflight:
    """The checks before launch (dsrun.cli.preflight), announced: building the data and the model on the meta
    device and the memory estimate take seconds."""
    from dsrun.cli.common import say_stage
    from dsrun.cli.preflight import check_before_launch

    say_stage("checking before launch: the model's shape, the data, train.resume, monitor folders"
              + (", memory" if not args.skip_memory_check else ""))
    return check_before_launch(resolved, memory_check=not args.skip_memory_check)


@contextlib.contextmanager
def quiet_legacy_notes(quiet: bool) -> Iterator[None]:
    """While composing a run a second time, silence the legacy-key notes the first composition printed."""
    if not quiet:
        yield
        return
    import logging
    import warnings

    logger = logging.getLogger("dsrun.config")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _settle_resume(resolved: ResolvedRun, run_dir: Path, job_overrides: list[str], args: argparse.Namespace,
                   source: Path | None, overrides: list[str], requeued: bool = False) -> tuple[ResolvedRun, str | None]:
    """Resolve ``train.resume=auto`` and ``--from`` into a checkpoint folder (or null); check what it names.
    ``requeued``: a submitted job, which a scheduler may run again in the same run directory: a checkpoint there
    is its own, from before it was stopped, and the run resumes from it."""
    from dsrun.cli.preflight import resume_problems
    from dsrun.cli.resume import settle_auto, settle_from, settle_requeued

    again = settle_requeued(resolved, run_dir) if requeued else None
    if again is not None:
        resolved, line = again
    elif source is not None:
        resolved, line = settle_from(resolved, source, overrides)
    elif str(resolved.train.resume).lower() == "auto":
        resolved, line = settle_auto(resolved, run_dir, job_overrides, args.multirun)
    else:
        return resolved, None
    problems = resume_problems(resolved.train.resume)
    if problems:
        raise UserError(problems)
    return resolved, line


@dataclass(frozen=True)
class Record:
    """What ``provenance.json`` keeps besides the versions: the command, the overrides the run amounts to,
    the data's digest."""

    command: list[str]
    overrides: list[str]
    data: dict[str, Any] | None

    def write(self, run_dir: Path) -> None:
        from dsrun.rundir import write_provenance

        write_provenance(run_dir, self.command, self.overrides, self.data)


def _lineage(source: Path | None, job_overrides: list[str]) -> list[str]:
    """The overrides a job amounts to: its own, after its ``--from`` source's."""
    from dsrun.cli.resume import effective_overrides, recorded_overrides

    return effective_overrides([*((recorded_overrides(source) or []) if source else []), *job_overrides])


def _dry_run(resolved: ResolvedRun, run_dir: Path, preflight: Preflight, resume_line: str | None, record: Record) -> None:
    from dsrun.cli.preflight import one_rank_too_big
    from dsrun.rundir import write_run_files

    paths = write_run_files(run_dir, resolved)
    record.write(run_dir)
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
        f"memory          {preflight.memory or 'not checked'}",
        *([f"resume          {resume_line}"] if resume_line else []),
        *[f"note            {note.removeprefix('note: ')}" for note in preflight.notes],
        f"wrote           {paths['resolved']}",
        f"                {paths['ds_config']}",
    ]
    print("\n".join(lines), flush=True)
    too_big = one_rank_too_big(resolved, preflight.model) if preflight.model is not None else None
    if too_big:  # the estimator runs again only here: a launch does not need it
        print(f"ranks           not built here: {too_big} (the estimator's figure)")
    else:
        print("\n".join(_simulated_ranks(resolved, run_dir)))
    print("dry run: nothing launched")


def _simulated_ranks(resolved: ResolvedRun, run_dir: Path) -> list[str]:
    """Every rank's engine built in this process on torch's fake process group, described (and recorded as a
    real run's ranks record themselves: ``topology_rank<R>.json``)."""
    from dsrun.workloads import topology

    print(f"ranks           {resolved.world_size}, each built in turn on a fake process group (torch's fake "
          "backend), as a launch builds them:", flush=True)
    ranks = topology.simulate(resolved.runspec, [len(slots) for slots in resolved.plan.hosts.values()])
    for info in ranks:
        topology.write(run_dir, info)
    return topology.lines(ranks)


def _open_run(resolved: ResolvedRun, run_dir: Path, preflight: Preflight, resume_line: str | None, record: Record,
              log: LauncherLog) -> None:
    """Write the run files and say where the run goes, before its ranks start."""
    from dsrun.rundir import write_run_files

    write_run_files(run_dir, resolved)
    record.write(run_dir)
    log.say(f"run directory {run_dir}")
    for line in [*([resume_line] if resume_line else []), *preflight.notes]:
        log.say(line)


def _default_core_binding(resolved: ResolvedRun, launcher: dict, log: LauncherLog) -> None:
    """``launcher.bind_cores_to_rank: null``: bind each rank to its share of the host's cores when the run offloads
    and a host runs more than one rank (dsrun/launcher/core_binding.py; the agent prints the binding)."""
    from dsrun.launcher.core_binding import binds_by_default
    from dsrun.offload.cores import process_cores

    if launcher.get("bind_cores_to_rank") is not None or not resolved.plan.hosts:
        return
    ranks_per_host = max(len(slots) for slots in resolved.plan.hosts.values())
    if binds_by_default(resolved.ds, ranks_per_host):
        cores = len(process_cores())
        if cores < ranks_per_host:  # a default never fails a run: the split it would make has an empty share
            log.say(f"not binding cores: {ranks_per_host} ranks per host share the {cores} core(s) this process "
                    "may run on, fewer than one each (launcher.bind_cores_to_rank=false says not to try)")
            return
        launcher["bind_cores_to_rank"] = True
        log.say(f"binding each rank to its share of the host's cores (an offload run with {ranks_per_host} ranks "
                "per host; launcher.bind_cores_to_rank=false turns it off)")


def _train(resolved: ResolvedRun, run_dir: Path, preflight: Preflight, resume_line: str | None, record: Record,
           log: LauncherLog) -> dict:
    """Launch the worker on every rank of the plan; return the run's metrics (``metrics.json``)."""
    import json

    from dsrun.cli.outcome import done_lines, first_error, mark_mlflow, short_path, stop_signal
    from dsrun.launcher import launch_from_mapping
    from dsrun.launcher.execute import JobOutcome
    from dsrun.rundir import METRICS_JSON
    from dsrun.runspec import WORKER_MODULE

    _open_run(resolved, run_dir, preflight, resume_line, record, log)
    if resolved.plan.ray is not None:
        return _train_on_ray(resolved, run_dir, log)
    launcher = dict(resolved.runspec.launcher)
    launcher["log_dir"] = launcher.get("log_dir") or str(run_dir / "logs")
    _default_core_binding(resolved, launcher, log)
    outcome = JobOutcome()
    started_ms = int(time.time() * 1000) - 1000
    hosts = ", ".join(resolved.plan.hosts)
    log.say(f"starting {resolved.world_size} rank(s) on {hosts}; each imports torch and builds its engine "
            "before its first line")
    launch_from_mapping(launcher, WORKER_MODULE, ["--run-dir", str(run_dir)], module=True,
                        out=log.stdout, err=log.stderr, outcome=outcome,
                        stop_grace=resolved.train.preemption.grace_s)  # the agents kill the ranks only after it
    # the launcher got the signal, or a rank did (the ranks stopped together and say which in the run directory)
    signum = outcome.signal or (stop_signal(run_dir, outcome.exit_code) if outcome.exit_code else None)
    if signum is not None:
        mark_mlflow(resolved, run_dir, started_ms, "KILLED", log.say)
        _say_stopped(resolved, run_dir, signum, log)
    if outcome.exit_code != 0:
        mark_mlflow(resolved, run_dir, started_ms, "FAILED", log.say)
        if outcome.user_errors:
            raise UserError(outcome.user_errors)
        log_dir = Path(launcher["log_dir"])
        error = first_error(log_dir, outcome.failed_rank)
        log.say(f"training failed (exit code {outcome.exit_code}){error}; logs per rank in {short_path(log_dir)}",
                err=True)
        raise TrainingFailed(f"exit code {outcome.exit_code}{error}", outcome.exit_code)
    metrics = json.loads((run_dir / METRICS_JSON).read_text())
    for line in done_lines(resolved, run_dir, metrics):
        log.say(line)
    return metrics


def _restarts(limit: int) -> str:
    """A Ray ``FailureConfig`` limit in words (-1: no limit)."""
    return "any number of" if limit == -1 else f"up to {limit}"


def _train_on_ray(resolved: ResolvedRun, run_dir: Path, log: LauncherLog) -> dict:
    """``launcher=ray``: the run's ranks are Ray Train workers (dsrun.ray); return the run's metrics."""
    import json
    import os

    from dsrun.cli.outcome import done_lines
    from dsrun.ray import fit
    from dsrun.rundir import METRICS_JSON

    ray = resolved.plan.ray
    if ray.address or os.environ.get("RAY_ADDRESS"):
        where = f"the Ray cluster at {ray.address or os.environ['RAY_ADDRESS']}"
    else:
        where = f"a local Ray on {ray.local_cpus()} CPU(s), stopped at the end"
    log.say(f"starting {resolved.world_size} Ray Train worker(s) on {where}; {_restarts(ray.max_failures)} "
            f"restart(s) after a worker fails, each from the last checkpoint, and "
            f"{_restarts(ray.max_preemption_failures)} after a node is drained, each from the checkpoint saved for it")
    try:
        fit(run_dir, ray, keep_last=resolved.train.keep_last)
    except Exception as err:  # Ray's TrainingFailedError (and its causes): the workers' own lines came before
        if isinstance(err, UserError):
            raise
        log.say(f"training failed on Ray: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                err=True)
        raise TrainingFailed(f"Ray Train: {type(err).__name__}", 1) from None
    metrics = json.loads((run_dir / METRICS_JSON).read_text())
    for line in done_lines(resolved, run_dir, metrics):
        log.say(line)
    return metrics


def _say_stopped(resolved: ResolvedRun, run_dir: Path, signum: int, log: LauncherLog) -> None:
    """Say where a run stopped by ``signum`` stands (the checkpoint, how to resume) and raise
    :class:`TrainingStopped` with its exit code (138: preempted, checkpoint saved)."""
    from dsrun.cli.outcome import stop_exit_code, stopped_lines

    for line in stopped_lines(resolved, run_dir, signum):
        log.say(line, err=True)
    raise TrainingStopped(signum, stop_exit_code(run_dir, signum))


def _train_as_rank(resolved: ResolvedRun, run_dir: Path, preflight: Preflight, resume_line: str | None,
                   record: Record, log: LauncherLog, handoff: RunHandoff) -> dict:
    """Rank 0 of an outer launcher's job: write the run files, hand the run directory to the other ranks and
    train as rank 0 in this process (dsrun.cli.outer_rank); return the run's metrics."""
    import json

    from dsrun.cli.outcome import done_lines, stop_signal
    from dsrun.cli.outer_rank import run_rank
    from dsrun.rundir import METRICS_JSON

    _open_run(resolved, run_dir, preflight, resume_line, record, log)
    log.say(f"training as rank 0 of {resolved.world_size_source}; the other ranks take this run directory")
    handoff.send_run(run_dir)
    code = run_rank(run_dir, 0, log.stdout, log.stderr)
    signum = stop_signal(run_dir, code) if code else None  # the worker stopped at a step boundary on a signal
    if signum is not None:
        _say_stopped(resolved, run_dir, signum, log)
    if code != 0:  # the worker said why (a user's mistake: its error lines)
        raise TrainingFailed(f"exit code {code}", code)
    metrics = json.loads((run_dir / METRICS_JSON).read_text())
    for line in done_lines(resolved, run_dir, metrics):
        log.say(line)
    return metrics
