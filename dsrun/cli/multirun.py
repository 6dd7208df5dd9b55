"""The results of a ``dsrun train -m`` sweep side by side: one row per job, printed when the sweep ends and
saved as ``summary.txt`` in the sweep directory.

Every job of a sweep is a full launch. A job that fails (a bad value for one combination, a rank that
crashes) is recorded as failed with its reason, and the sweep goes on with the next job; the table shows
the finished jobs' results next to the failures, and ``dsrun train -m`` exits non-zero if any job failed.

Jobs that a submitit launcher runs in processes of their own (``hydra/launcher=submitit_slurm|submitit_local``,
docs/cluster.md) write their row as ``job.json`` in their run directory (:func:`write_job_result`); the launcher
hands those to ``dsrun train -m`` once the jobs are done (:func:`record_submitted_jobs`, :func:`take_submitted_jobs`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

JOB_JSON = "job.json"  # a submitted job's row of the summary table, in its run directory


@dataclass
class JobResult:
    """One job of a sweep: its overrides (``key=value`` as Hydra applied them) and how it ended."""

    number: int
    overrides: list[str]
    run_dir: Path
    final_eval_loss: float | None = None
    tokens_per_second: float | None = None
    error: str | None = None  # None: the job finished

    @property
    def ok(self) -> bool:
        return self.error is None


def write_job_result(job: JobResult) -> None:
    """A submitted job's row, for the process that submitted it (``job.json`` in the job's run directory)."""
    row = {**asdict(job), "run_dir": str(job.run_dir)}
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / JOB_JSON).write_text(json.dumps(row, indent=1) + "\n")


def read_job_result(number: int, overrides: list[str], run_dir: Path) -> JobResult:
    """The row a submitted job wrote; a job that wrote none (it died before its end) is failed, saying where its
    log is."""
    try:
        row = json.loads((run_dir / JOB_JSON).read_text())
        return JobResult(number, list(row["overrides"]), run_dir, row.get("final_eval_loss"),
                         row.get("tokens_per_second"), row.get("error"))
    except (OSError, ValueError, KeyError, TypeError):
        return JobResult(number, overrides, run_dir, error=f"no result in {short_path(run_dir)} (the submitted "
                         "job's own log: .submitit/ in the sweep directory)")


_SUBMITTED: list[JobResult] = []  # the rows of jobs a submitit launcher ran, until dsrun train -m takes them


def record_submitted_jobs(returns: Sequence[Any]) -> None:
    """Called by dsrun's submitit launchers with Hydra's ``JobReturn`` of each job, once all are done."""
    for ret in returns:
        hydra = ret.hydra_cfg.hydra
        _SUBMITTED.append(read_job_result(int(hydra.job.num), [str(o) for o in ret.overrides],
                                          Path(str(hydra.runtime.output_dir))))


def take_submitted_jobs() -> list[JobResult]:
    """The rows :func:`record_submitted_jobs` recorded, in job order (and forgets them)."""
    jobs = sorted(_SUBMITTED, key=lambda job: job.number)
    _SUBMITTED.clear()
    return jobs


def varying_overrides(jobs: Sequence[JobResult]) -> list[list[str]]:
    """Each job's overrides that differ between jobs (the swept ones), in the order given; a lone job keeps
    all of its overrides but the recipe."""
    if len(jobs) < 2:
        return [[o for o in job.overrides if not o.startswith("+recipe=")] for job in jobs]
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job.overrides:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    counts = {key: sum(any(o.partition("=")[0] == key for o in job.overrides) for job in jobs) for key in values}
    swept = {key for key, seen in values.items() if len(seen) > 1 or counts[key] < len(jobs)}
    return [[o for o in job.overrides if o.partition("=")[0] in swept] for job in jobs]


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


def summary_table(jobs: Sequence[JobResult], sweep_dir: Path | None = None) -> str:
    """A plain-text table (it reads the same in a terminal, a log file and CI output)."""
    shown = varying_overrides(jobs)
    header = ["#", "overrides", "final eval loss", "tokens/s", "run dir", "status"]
    rows = [[str(job.number), " ".join(overrides) or "(none)", _number(job.final_eval_loss, ".4f"),
             _number(job.tokens_per_second, ",.0f"), short_path(job.run_dir),
             "ok" if job.ok else f"FAILED: {job.error}"] for job, overrides in zip(jobs, shown)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
             for row in [header, *rows]]
    failed = sum(not job.ok for job in jobs)
    title = f"[dsrun] sweep of {len(jobs)} job(s): {len(jobs) - failed} finished, {failed} failed" + (
        f"; sweep directory {short_path(sweep_dir)}" if sweep_dir else "")
    ranked = [job for job in jobs if job.ok and job.final_eval_loss is not None]
    footer = []
    if ranked:
        best = min(ranked, key=lambda job: job.final_eval_loss)
        footer.append(f"best final eval loss {best.final_eval_loss:.4f}: job {best.number} "
                      f"({' '.join(shown[jobs.index(best)]) or short_path(best.run_dir)})")
    return "\n".join([title, lines[0], "-" * len(lines[0]), *lines[1:], *footer])


def short_path(path: Path) -> str:
    """``path`` relative to the current directory when it lies below it (``multirun/DATE/TIME/N``)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def first_job_overrides(overrides: Sequence[str]) -> list[str]:
    """The command line's overrides with each sweep replaced by its first value and Hydra's own settings
    (``hydra/...``, ``hydra.*``) left out: enough to compose the sweep's config once, so that a misspelt key
    or option is reported in one line before any job starts. Values are not checked here: a value only
    one job has is that job's failure, not the sweep's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    from hydra_plugins.dsrun_optuna_sweeper.optuna_sweeper import override_text

    parser = OverridesParser.create()
    first: list[str] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # noqa: BLE001 - composing reports the parse error with its key
            first.append(text)
            continue
        if override.key_or_group.startswith(("hydra.", "hydra/")) or override.key_or_group == "hydra":
            continue
        if override.is_sweep_override():
            sweep = override.value()
            value = (sweep.list[0] if sweep.list else None) if isinstance(sweep, ChoiceSweep) else sweep.start
            first.append(override_text(override.get_key_element(), value))
        else:
            first.append(text)
    return first


def unknown_sweep_options(overrides: Sequence[str], recipes_dirs: Sequence[str | Path] = ()) -> list:
    """A :class:`~dsrun.utils.errors.Problem` for each option of a swept config group (``zero=stage1,stage9``,
    ``+recipe=a,b``) that does not exist, so the sweep stops before its first job instead of in Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    from dsrun.compose import config_groups, list_recipes
    from dsrun.utils.errors import Problem
    from dsrun.utils.paths import conf_dir
    from dsrun.utils.suggest import did_you_mean

    groups = set(config_groups())
    problems = []
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # noqa: BLE001 - composing reports it
            continue
        group, sweep = override.key_or_group, override.value() if override.is_sweep_override() else None
        if group not in groups or not isinstance(sweep, ChoiceSweep):
            continue
        known = list(list_recipes(recipes_dirs)) if group == "recipe" else sorted(
            p.stem for p in (conf_dir() / group).glob("*.yaml"))
        for option in sweep.list:
            if str(option) not in known:
                problems.append(Problem(f"{override.get_key_element()}={option}", f"unknown option '{option}' for config group "
                                        f"'{group}'; available: {', '.join(known)}",
                                        did_you_mean(str(option), known)))
    return problems
