"""What ``dsrun tune`` reads: DeepSpeed's ``autotuning`` section (``ds.autotuning``) and the recipe's ``tune``
section (the search space and dsrun's own knobs), checked into one :class:`TuneSettings`.

``tune`` keys (set by the ``conf/autotuning/`` groups; every one can be overridden, ``tune.space.KEY=[...]``):

* ``space``: ``{override key: [values]}``, nested (``zero_optimization: {stage: [0, 1]}``) or with dotted keys; a
  key is what ``dsrun train`` accepts as an override, with DeepSpeed keys written with or without ``ds.``
  (``zero_optimization.stage``, ``train_micro_batch_size_per_gpu``, ``data.seq_len``). Without ``train_micro_batch_size_per_gpu`` the micro batch sizes come from
  ``ds.autotuning`` (``num_tuning_micro_batch_sizes`` powers of two from ``min_train_micro_batch_size_per_gpu``).
* ``memory_limit``: bytes per rank a trial may need by the memory estimator (``"2GiB"``, ``"500MB"`` or a
  number); null: this machine's budget (one device's memory, or on CPU the RAM shared by the ranks).
* ``trial_timeout``: seconds before a trial's launch is stopped and recorded as failed (default 600).
* ``seed``: the samplers' seed (default 1234).
* ``comm_tolerance``: how far (a fraction of the best measured metric) a trial may be from the best and still
  win by sending fewer bytes: among the trials within it, the best is the one with the least estimated
  communication leaving a rank per step (``dsrun.estimate.comm_volume``). Default 0: exact ties only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

from dsrun.utils.errors import Problem, UserError
from dsrun.utils.suggest import did_you_mean

if TYPE_CHECKING:
    from dsrun.config.misc import AutotuningConfig

SpaceValue = bool | int | float | str | None  # a value a search-space key may take (checked by settings_from)
T = TypeVar("T")

TUNE_KEYS = ("space", "memory_limit", "trial_timeout", "seed", "comm_tolerance")
DEFAULT_TRIAL_TIMEOUT = 600.0
DEFAULT_SEED = 1234
METRICS = {"throughput": ("samples/s", "maximize"), "latency": ("ms per step", "minimize"),
           "flops": ("FLOPS per rank", "maximize")}
TUNERS = ("gridsearch", "random", "model_based")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str | None, key: str) -> int | None:
    """``"2GiB"``, ``"500MB"``, ``"1.5e9"`` or a number → bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)\s*", str(value).lower())
    if match and match.group(2) in _UNITS:
        number = float(match.group(1)) * _UNITS[match.group(2)]
        if number > 0:
            return int(number)
    raise UserError(Problem(key, f"got {value!r}; expected a size in bytes such as 2GiB, 500MB or 1e9"))


def flatten_space(space: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{zero_optimization: {stage: [0, 1]}}`` → ``{"zero_optimization.stage": [0, 1]}``; dotted keys are
    accepted as they are. A later entry wins, so ``tune.space.zero_optimization.stage=[1,2]`` on the command
    line replaces the recipe's list whichever way the recipe wrote it."""
    flat: dict[str, Any] = {}
    for key, value in space.items():
        if isinstance(value, Mapping):
            flat.update(flatten_space(value, f"{prefix}{key}."))
        else:
            flat.pop(f"{prefix}{key}", None)
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass(frozen=True)
class TuneSettings:
    """Every input of a tuning run. Paths are absolute. ``arg_mappings`` maps a tuned DeepSpeed key to
    extra ``dsrun train`` override keys that receive the same value (DeepSpeed maps them to script flags)."""

    results_dir: Path
    exps_dir: Path
    overwrite: bool
    metric: str
    start_profile_step: int
    end_profile_step: int
    fast: bool
    max_train_batch_size: int | None
    min_train_batch_size: int
    min_micro_batch: int
    max_micro_batch: int
    num_tuning_micro_batch_sizes: int
    tuner_type: str
    tuner_early_stopping: int
    tuner_num_trials: int
    arg_mappings: dict[str, str] = field(default_factory=dict)
    model_info: dict[str, Any] | None = None
    space: dict[str, list[SpaceValue]] = field(default_factory=dict)
    memory_limit: int | None = None
    trial_timeout: float = DEFAULT_TRIAL_TIMEOUT
    seed: int = DEFAULT_SEED
    comm_tolerance: float = 0.0
    mp_size: int = 1  # autotuning.mp_size: the tuned job's model-parallel degree (its data-parallel size: world / it)

    @property
    def direction(self) -> str:
        return METRICS[self.metric][1]

    @property
    def unit(self) -> str:
        return METRICS[self.metric][0]

    def better(self, a: float, b: float | None) -> bool:
        """Is metric value ``a`` better than ``b`` (None: nothing yet)?"""
        if b is None:
            return True
        return a < b if self.direction == "minimize" else a > b

    def close_to(self, a: float, best: float) -> bool:
        """Is metric value ``a`` within ``comm_tolerance`` of the best value ``best``?"""
        if self.direction == "minimize":
            return a <= best * (1 + self.comm_tolerance)
        return a >= best * (1 - self.comm_tolerance)

    def pick_best(self, candidates: list[T], value: Callable[[T], float | None],
                  comm: Callable[[T], float | None]) -> T | None:
        """The best of ``candidates`` (in trial order): the best ``value(c)`` (None: not measured), or among
        those within ``comm_tolerance`` of it the one with the least ``comm(c)`` (estimated bytes leaving a
        rank per step; None counts as unknown, after every known figure); the metric decides among equals."""
        measured = [c for c in candidates if value(c) is not None]
        top = None
        for c in measured:
            if top is None or self.better(value(c), value(top)):
                top = c
        if top is None:
            return None
        close = [c for c in measured if self.close_to(value(c), value(top))]
        unknown = float("inf")
        return min(close, key=lambda c: (unknown if comm(c) is None else comm(c), c is not top))


def settings_from(autotuning: AutotuningConfig, raw_autotuning: Mapping[str, Any], tune: Mapping[str, Any] | None,
                  cwd: Path, *, memory_limit: int | float | str | None = None,
                  trial_timeout: float | None = None) -> TuneSettings:
    """Build the settings from the validated ``ds.autotuning`` section (``dsrun.config`` model),
    the section as the user wrote it (``raw_autotuning``, to see which keys were set) and ``tune``.

    ``memory_limit`` / ``trial_timeout`` (command-line flags) win over ``tune``'s. Raises
    :class:`UserError` naming the key for anything that cannot be tuned.
    """
    problems: list[Problem] = []
    tune = dict(tune or {})
    for key in tune:
        if key not in TUNE_KEYS:
            problems.append(Problem(f"tune.{key}", "unknown key", did_you_mean(key, TUNE_KEYS)
                                    or f"tune has {', '.join(TUNE_KEYS)}"))
    if raw_autotuning.get("enabled") is False:
        problems.append(Problem("ds.autotuning.enabled", "is false, so this config asks not to be tuned",
                                "set ds.autotuning.enabled=true (the autotuning groups do)"))
    space = tune.get("space") or {}
    if not isinstance(space, Mapping):
        problems.append(Problem("tune.space", f"got {type(space).__name__}; expected a mapping "
                                "{override key: [values]}", "see docs/autotuning.md"))
        space = {}
    clean_space: dict[str, list[Any]] = {}
    for key, values in flatten_space(space).items():
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        bad = [v for v in values if not (v is None or isinstance(v, (bool, int, float, str)))]
        if bad:
            problems.append(Problem(f"tune.space.{key}", f"got {bad[0]!r}; values must be numbers, "
                                    "booleans, strings or null"))
        elif not values:
            problems.append(Problem(f"tune.space.{key}", "has no values", "give at least one value"))
        else:
            clean_space[str(key)] = values
    at = autotuning
    if at.end_profile_step < max(1, at.start_profile_step):
        problems.append(Problem("ds.autotuning.end_profile_step", f"got {at.end_profile_step}; must be >= "
                                f"start_profile_step ({at.start_profile_step}) and >= 1"))
    timeout = trial_timeout if trial_timeout is not None else tune.get("trial_timeout", DEFAULT_TRIAL_TIMEOUT)
    try:
        timeout = float(timeout if timeout is not None else DEFAULT_TRIAL_TIMEOUT)
        if timeout <= 0:
            raise ValueError
    except (TypeError, ValueError):
        problems.append(Problem("tune.trial_timeout", f"got {timeout!r}; expected seconds > 0"))
        timeout = DEFAULT_TRIAL_TIMEOUT
    try:
        limit = parse_bytes(memory_limit if memory_limit is not None else tune.get("memory_limit"),
                            "--memory-limit" if memory_limit is not None else "tune.memory_limit")
    except UserError as err:
        problems += err.problems
        limit = None
    tolerance = tune.get("comm_tolerance") or 0.0
    try:
        tolerance = float(tolerance)
        if not 0 <= tolerance < 1:
            raise ValueError
    except (TypeError, ValueError):
        problems.append(Problem("tune.comm_tolerance", f"got {tolerance!r}; expected a fraction in [0, 1)",
                                "e.g. 0.05: within 5% of the best metric, prefer the trial sending fewer bytes"))
        tolerance = 0.0
    mappings = {str(k).strip(): str(v).strip() for k, v in (at.arg_mappings or {}).items()}
    if problems:
        raise UserError(problems)
    results_dir = (cwd / at.results_dir).resolve()
    return TuneSettings(
        results_dir=results_dir, exps_dir=(cwd / at.exps_dir).resolve(),
        # dsrun resumes by default (DeepSpeed's README default); `overwrite: true` starts a fresh study
        overwrite=bool(raw_autotuning.get("overwrite", False)),
        metric=at.metric, start_profile_step=max(1, at.start_profile_step), end_profile_step=at.end_profile_step,
        fast=at.fast, max_train_batch_size=at.max_train_batch_size, min_train_batch_size=at.min_train_batch_size,
        min_micro_batch=at.min_train_micro_batch_size_per_gpu, max_micro_batch=at.max_train_micro_batch_size_per_gpu,
        num_tuning_micro_batch_sizes=at.num_tuning_micro_batch_sizes, tuner_type=at.tuner_type,
        tuner_early_stopping=at.tuner_early_stopping, tuner_num_trials=at.tuner_num_trials,
        arg_mappings=mappings, model_info=at.model_info.model_dump() if at.model_info else None,
        space=clean_space, memory_limit=limit, trial_timeout=timeout,
        seed=int(tune.get("seed", DEFAULT_SEED) if tune.get("seed") is not None else DEFAULT_SEED),
        comm_tolerance=tolerance, mp_size=at.mp_size)
