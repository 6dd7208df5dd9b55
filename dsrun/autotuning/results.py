"""The results of a study: ``summary.txt``, ``ds_config_optimal.json``, ``cmd_optimal.txt`` and the rows of
the tables the CLI prints.

``summary.txt`` starts with DeepSpeed's table (``tuning_space | num_experiments | best_metric_val |
best_exp_name``, one row per ZeRO stage and ``global``; tabulate's "pipe" format), then every experiment,
the best metric and experiment, each failed trial's full error, each pruned trial's reason, and ends with
DeepSpeed's line ``Tuning completed in H:MM:SS.ffffff. Total number of experiments: N.`` (N = launched
experiments; the time adds up every session of a resumed study).
"""
from __future__ import annotations

import datetime as dt
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dsrun.autotuning.settings import TuneSettings
from dsrun.autotuning.study import (DUPLICATE, INTERRUPTED, INVALID, LAUNCHED, PRUNED, Tuner, optimal_command,
                                    trial_traffic)

if TYPE_CHECKING:
    import optuna

SUMMARY = "summary.txt"
OPTIMAL_CONFIG = "ds_config_optimal.json"
OPTIMAL_CMD = "cmd_optimal.txt"


@dataclass
class TrialRow:
    number: int
    name: str
    status: str  # complete | failed | pruned | invalid | interrupted | duplicate
    tuning_space: str
    params: dict[str, Any]
    value: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # reason (pruned), one-line error (failed), "same as trial N" (duplicate)
    error: str = ""  # the full error text
    comm_bytes: float | None = None  # the estimator's bytes leaving a rank per optimizer step (traffic)


def trial_rows(study: optuna.Study) -> list[TrialRow]:
    from optuna.trial import TrialState

    rows = []
    for t in study.get_trials(deepcopy=False):
        kind = t.user_attrs.get("kind")
        if t.state == TrialState.RUNNING:
            status = "running"
        elif kind == INTERRUPTED:
            status = "interrupted"
        elif kind == DUPLICATE:
            status = "duplicate"
        elif kind == INVALID:
            status = "invalid"
        elif t.state == TrialState.PRUNED:
            status = "pruned"
        elif t.state == TrialState.COMPLETE:
            status = "complete"
        else:
            status = "failed"
        note = (t.user_attrs.get("reason") or t.user_attrs.get("error_line") or "")
        if status == "duplicate":
            note = f"same configuration as trial {t.user_attrs.get('duplicate_of')}"
        elif status == "interrupted":
            note = t.user_attrs.get("error", "")
        rows.append(TrialRow(t.number, t.user_attrs.get("exp_name", "?"), status,
                             t.user_attrs.get("tuning_space", ""), dict(t.user_attrs.get("config") or t.params),
                             t.value if t.state == TrialState.COMPLETE else None,
                             dict(t.user_attrs.get("metrics") or {}), note,
                             t.user_attrs.get("error", "") if status in ("failed", "invalid") else "",
                             trial_traffic(t)))
    return rows


def pipe_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[bool]) -> str:
    """A table in tabulate's "pipe" format (what DeepSpeed's summary uses)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(  # noqa: E731
        (v.rjust(w) if num else v.ljust(w)) for v, w, num in zip(vals, widths, numeric)) + " |"
    rule = "| " + " | ".join(("-" * (w - 1) + ":") if num else (":" + "-" * (w - 1))
                             for w, num in zip(widths, numeric)) + " |"
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def _cell(value: object) -> str:
    """Any table cell as text (None: empty)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def space_table_rows(rows: Sequence[TrialRow], settings: TuneSettings) -> list[list[Any]]:
    """DeepSpeed's rows: per tuning space (z0…z3) and ``global``: experiments launched, best value, best name."""
    launched = [r for r in rows if r.status in ("complete", "failed")]
    result = []
    for space in sorted({r.tuning_space for r in launched}) + ["global"]:
        mine = [r for r in launched if space == "global" or r.tuning_space == space]
        best = best_row(mine, settings)
        result.append([space, len(mine), best.value if best else None, best.name if best else ""])
    return result


def best_row(rows: Sequence[TrialRow], settings: TuneSettings) -> TrialRow | None:
    """The best completed row, chosen as :meth:`~dsrun.autotuning.study.Tuner.best_trial` chooses."""
    done = [r for r in rows if r.status == "complete"]
    return settings.pick_best(done, lambda r: r.value, lambda r: r.comm_bytes)


def format_duration(seconds: float) -> str:
    return str(dt.timedelta(seconds=seconds))


def summary_text(rows: Sequence[TrialRow], settings: TuneSettings, space_text: str, elapsed_s: float,
                 stop_reason: str, model_info: dict[str, Any] | None) -> str:
    best = best_row(rows, settings)
    parts = [pipe_table(["tuning_space", "num_experiments", "best_metric_val", "best_exp_name"],
                        space_table_rows(rows, settings), [False, True, True, False]), ""]
    parts.append(f"Tuning space: {space_text}")
    parts.append(f"Metric: {settings.metric} ({settings.unit}; {'lower' if settings.direction == 'minimize' else 'higher'}"
                 f" is better), steps {settings.start_profile_step}..{settings.end_profile_step}; "
                 f"tuner: {settings.tuner_type}; stopped: {stop_reason or 'not finished'}")
    if model_info:
        parts.append("Model info: " + ", ".join(f"{k}={v}" for k, v in model_info.items()
                                                 if k in ("num_params", "activation_mem_per_gpu", "hidden_size",
                                                          "num_layers", "source")))
    param_keys = list(dict.fromkeys(k for r in rows for k in r.params))
    table_rows = [[r.number, r.name, r.status, r.value, r.metrics.get("latency"), r.comm_bytes,
                   *[r.params.get(k) for k in param_keys], r.note] for r in rows]
    parts += ["", "Experiments (comm_bytes_per_step: the estimator's bytes leaving a rank per optimizer step"
              + (f"; within {settings.comm_tolerance:g} of the best metric the fewest bytes win" if
                 settings.comm_tolerance else "; fewer bytes break exact ties") + "):",
              pipe_table(["trial", "exp_name", "status", settings.metric, "latency_ms", "comm_bytes_per_step",
                          *param_keys, "note"],
                         table_rows, [True, False, False, True, True, True, *[False] * len(param_keys), False]), ""]
    if best:
        parts.append(f"Best metric: {best.value:.6g} {settings.unit} ({settings.metric})")
        parts.append(f"Best experiment: {best.name} (trial {best.number}), results in "
                     f"{settings.results_dir / best.name}")
    else:
        parts.append("Best metric: none (no trial completed)")
        parts.append("Best experiment: none")
    failed = [r for r in rows if r.status in ("failed", "invalid")]
    if failed:
        parts += ["", "Failed experiments (full error):"]
        for r in failed:
            parts += [f"--- trial {r.number} {r.name} ---", r.error.rstrip(), ""]
    pruned = [r for r in rows if r.status == "pruned"]
    if pruned:
        parts += ["", "Pruned before launch:"]
        parts += [f"trial {r.number} {r.name}: {r.note}" for r in pruned]
    launched = sum(1 for r in rows if r.status in ("complete", "failed"))
    parts += ["", f"Tuning completed in {format_duration(elapsed_s)}. Total number of experiments: {launched}.", ""]
    return "\n".join(parts)


def write_results(tuner: Tuner, rows: Sequence[TrialRow] | None = None) -> dict[str, Path]:
    """Write summary.txt, and for the best trial ds_config_optimal.json and cmd_optimal.txt."""
    s = tuner.settings
    rows = list(rows if rows is not None else trial_rows(tuner.study))
    paths = {"summary": s.results_dir / SUMMARY}
    best = best_row(rows, s)
    if best is not None:
        ds = json.loads((s.results_dir / best.name / "ds_config.json").read_text())
        paths["ds_config_optimal"] = s.results_dir / OPTIMAL_CONFIG
        paths["ds_config_optimal"].write_text(json.dumps(ds, indent=2) + "\n")
        command = tuner.optimal_command(best.params, paths["ds_config_optimal"])
        paths["cmd_optimal"] = s.results_dir / OPTIMAL_CMD
        paths["cmd_optimal"].write_text(shlex.join(command) + "\n")
    paths["summary"].write_text(summary_text(rows, s, tuner.space.describe(), tuner.elapsed_s, tuner.stop.text,
                                             tuner.study.user_attrs.get("model_info")))
    return paths


__all__ = ["TrialRow", "trial_rows", "write_results", "summary_text", "pipe_table", "best_row",
           "space_table_rows", "optimal_command", "LAUNCHED", "PRUNED"]
