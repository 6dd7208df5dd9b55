"""An Optuna sweeper for Hydra (``hydra/sweeper=optuna``) that works with Optuna 3.5 and later.

Each trial is one job of the multirun: the sampler proposes values for the swept params, the launcher runs
the task with them as overrides, and the task's return value is the objective (for ``dsrun train``, the
run's final eval loss). How a sweep override becomes an Optuna distribution:

=====================================  =====================================================================
``a,b,c`` or ``choice(a, b, c)``       ``CategoricalDistribution([a, b, c])``
``range(start, stop, step=s)``         ints: ``IntDistribution(start, stop, step=s)``; else
                                       ``FloatDistribution(start, stop, step=s)``; ``stop`` is included
                                       (Optuna's ``high``), as in Hydra 1.1's ``low/high/step`` form
``interval(low, high)``                ``FloatDistribution(low, high)``
``int(interval(low, high))``           ``IntDistribution(low, high)``
``tag(log, interval(low, high))``      the same with ``log=True``
=====================================  =====================================================================

A param that is not a sweep (``key=value``) is passed to every trial unchanged. Command-line sweeps join
``hydra.sweeper.params`` and win for the same key.

A trial fails when its job raises or returns no number (``None``, NaN, inf); it is told to Optuna as
FAIL and the sweep goes on while at most ``max_failure_rate * n_trials`` trials have failed. Past that,
the sweep launches no more trials and ends normally (the finished trials' results are kept); the log says
why. ``optimization_results.yaml`` in the sweep directory holds the best params and value.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Dict, List, MutableMapping, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

RESULTS_FILE = "optimization_results.yaml"


def distribution_for(override: Override) -> Any:
    """The Optuna distribution for one sweep override (see the module docstring)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    key = override.get_key_element()
    log_scale = "log" in getattr(value, "tags", set())
    if isinstance(value, ChoiceSweep):
        choices = list(value.list)
        bad = [c for c in choices if not (c is None or isinstance(c, (bool, int, float, str)))]
        if bad:
            raise HydraException(f"optuna sweeper: {key}: choices must be numbers, strings, booleans or null; "
                                 f"got {bad[0]!r}")
        return CategoricalDistribution(choices)
    if isinstance(value, RangeSweep):
        if value.shuffle:
            raise HydraException(f"optuna sweeper: {key}: shuffle(range(...)) means nothing to a sampler; "
                                 f"drop shuffle()")
        if all(isinstance(x, int) for x in (value.start, value.stop, value.step)):
            return IntDistribution(int(value.start), int(value.stop), log=log_scale, step=int(value.step))
        return FloatDistribution(float(value.start), float(value.stop), log=log_scale,
                                 step=None if log_scale else float(value.step))
    if isinstance(value, IntervalSweep):
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    raise HydraException(f"optuna sweeper: {key}: unsupported sweep {override.input_line!r}")


def override_text(key: str, value: Any) -> str:
    """``key=value`` in Hydra's override syntax; strings that Hydra would parse as something else are quoted."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, str):
        try:
            (parsed,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
            if parsed.value() == value and not parsed.is_sweep_override():
                return f"{key}={value}"
        except Exception:  # noqa: BLE001 - not parseable as is: quote it
            pass
        return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return f"{key}={value!r}"


def _instantiate_plain(config: Any) -> Any:
    """Instantiate a ``_target_`` config, leaving out null fields so the library's own defaults apply."""
    from hydra.utils import instantiate

    if config is None:
        return None
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    if isinstance(config, MutableMapping) and "_target_" in config:
        return instantiate({k: v for k, v in config.items() if v is not None})
    return config


def _objective(value: Any, n_objectives: int) -> Optional[List[float]]:
    """The job's return value as a list of finite floats, or None when it is not one."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) != n_objectives:
        return None
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        return None
    return floats if all(math.isfinite(v) for v in floats) else None


class OptunaSweeper(Sweeper):
    def __init__(self, sampler: Any, direction: Any, storage: Any, study_name: Optional[str], n_trials: int,
                 n_jobs: int, max_failure_rate: float = 0.0, search_space: Optional[DictConfig] = None,
                 params: Optional[DictConfig] = None, custom_search_space: Optional[str] = None) -> None:
        if search_space:
            raise HydraException("optuna sweeper: hydra.sweeper.search_space is Hydra 1.1's form; write the "
                                 "space as hydra.sweeper.params, e.g. lr: tag(log, interval(1e-5, 1e-2))")
        if n_trials < 1 or n_jobs < 1:
            raise HydraException(f"optuna sweeper: n_trials and n_jobs must be at least 1, got {n_trials} "
                                 f"and {n_jobs}")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise HydraException(f"optuna sweeper: max_failure_rate must be in [0, 1], got {max_failure_rate}")
        self.sampler_config = sampler
        self.directions = [str(d) for d in direction] if isinstance(direction, Sequence) and not isinstance(
            direction, str) else [str(direction)]
        self.storage = storage
        self.study_name = study_name
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.max_failure_rate = max_failure_rate
        self.params = {str(k): v for k, v in (params or {}).items()}
        self.custom_search_space = custom_search_space
        self.hydra_context: Optional[HydraContext] = None
        self.config: Optional[DictConfig] = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    # ---- the search space --------------------------------------------------------------------------------
    def _space(self, arguments: List[str]) -> tuple[Dict[str, Any], List[str]]:
        """(key → distribution for the swept params, overrides fixed for every trial)."""
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        from_config = [f"{key}={value}" for key, value in self.params.items()]
        by_key: Dict[str, Override] = {}
        for override in parser.parse_overrides(from_config) + parser.parse_overrides(arguments):
            by_key[override.get_key_element()] = override  # the command line comes last and wins
        space = {key: distribution_for(o) for key, o in by_key.items() if o.is_sweep_override()}
        fixed = [o.input_line for o in by_key.values() if not o.is_sweep_override()]
        return space, fixed

    def _sampler(self, space: Dict[str, Any]) -> Any:
        sampler = self.sampler_config
        if isinstance(sampler, (DictConfig, dict)):  # not instantiated by Hydra (a plain mapping)
            try:
                sampler = _instantiate_plain(sampler)
            except Exception as err:
                raise HydraException(f"optuna sweeper: cannot build hydra.sweeper.sampler ({err})") from err
        if isinstance(sampler, GridFromParams):
            sampler = sampler.build(space)
        return sampler

    # ---- the sweep -----------------------------------------------------------------------------------------
    def sweep(self, arguments: List[str]) -> List[Any]:
        import optuna
        from hydra.utils import get_method
        from optuna.trial import TrialState

        assert self.config is not None and self.launcher is not None
        space, fixed = self._space(arguments)
        if not space and not self.custom_search_space:
            raise HydraException("optuna sweeper: nothing to search; give params as sweeps, e.g. "
                                 "'lr=tag(log, interval(1e-5, 1e-2))' or hydra.sweeper.params")
        study = optuna.create_study(study_name=self.study_name, storage=_instantiate_plain(self.storage),
                                    sampler=self._sampler(space), directions=self.directions,
                                    load_if_exists=True)
        custom = get_method(self.custom_search_space) if self.custom_search_space else None
        n_trials = self.n_trials
        if getattr(study.sampler, "grid_size", None) is not None:
            done = sum(t.state.is_finished() for t in study.trials)
            n_trials = min(n_trials, max(0, study.sampler.grid_size - done))
            log.info(f"grid of {study.sampler.grid_size} points, {done} done before: {n_trials} trial(s) to run")
        log.info(f"Study name: {study.study_name}; storage: {self.storage}; sampler: "
                 f"{type(study.sampler).__name__}; directions: {self.directions}")
        for key, distribution in space.items():
            log.info(f"  {key}: {distribution}")
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        returns: List[Any] = []
        launched = failed = 0
        while launched < n_trials:
            trials = [study.ask(fixed_distributions=space) for _ in range(min(self.n_jobs, n_trials - launched))]
            batch = []
            for trial in trials:
                if custom is not None:
                    custom(self.config, trial)
                batch.append(fixed + [override_text(key, value) for key, value in trial.params.items()])
            self.validate_batch_is_legal(batch)
            try:
                results = self.launcher.launch(batch, initial_job_idx=launched)
            except KeyboardInterrupt:  # the trials that were running are failed, not left RUNNING in the study
                for trial in trials:
                    study.tell(trial, state=TrialState.FAIL)
                raise
            launched += len(batch)
            for trial, result in zip(trials, results):
                try:
                    value = result.return_value
                except Exception as err:  # noqa: BLE001 - the job raised: a failed trial, not a failed sweep
                    log.warning(f"trial {trial.number} failed: {type(err).__name__}: {err}")
                    value = None
                objective = _objective(value, len(self.directions))
                if objective is None:
                    failed += 1
                    study.tell(trial, state=TrialState.FAIL)
                    log.warning(f"trial {trial.number} recorded as failed (its job returned {value!r}, "
                                f"not {len(self.directions)} finite number(s))")
                else:
                    study.tell(trial, objective)
            returns.append(results)
            if failed > self.max_failure_rate * n_trials:
                log.error(f"{failed} of {launched} trials failed, more than max_failure_rate="
                          f"{self.max_failure_rate} of {n_trials} trials; launching no more trials")
                break
        self._write_results(study, sweep_dir)
        return returns

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        from optuna.trial import TrialState

        completed = [t for t in study.trials if t.state == TrialState.COMPLETE]
        results: Dict[str, Any] = {"name": "optuna", "study_name": study.study_name,
                                   "n_complete": len(completed), "n_failed": sum(
                                       t.state == TrialState.FAIL for t in study.trials)}
        if completed and len(self.directions) == 1:
            best = study.best_trial
            results.update(best_params=dict(best.params), best_value=best.value, best_trial=best.number)
            log.info(f"Best parameters: {best.params}; best value: {best.value}")
        elif completed:
            results["solutions"] = [{"params": dict(t.params), "values": list(t.values)}
                                    for t in study.best_trials]
            log.info(f"Pareto front: {results['solutions']}")
        OmegaConf.save(OmegaConf.create(results), sweep_dir / RESULTS_FILE)


class GridFromParams:
    """The grid sampler before its grid is known: by default the grid is the sweep's discrete params."""

    def __init__(self, search_space: Optional[Dict[str, Any]] = None, seed: Optional[int] = None) -> None:
        self.search_space, self.seed = search_space, seed

    def build(self, space: Dict[str, Any]) -> Any:
        from optuna.samplers import GridSampler

        grid = {str(k): list(v) for k, v in (self.search_space or {}).items()}
        for key, distribution in space.items():
            if key in grid:
                continue
            if hasattr(distribution, "choices"):
                grid[key] = list(distribution.choices)
            elif getattr(distribution, "step", None) and not distribution.log:
                grid[key] = _steps(distribution)
            else:
                raise HydraException(f"optuna sweeper: the grid sampler needs discrete params; {key} is "
                                     f"continuous (use choice(...) or range(...))")

        class SweepGridSampler(GridSampler):
            """Optuna's grid sampler stops an ``optimize`` loop when the grid is done, which a sweep (ask and
            tell, no loop) cannot; the sweeper caps its trials at the grid's size instead."""

            def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
                pass

        sampler = SweepGridSampler(grid, seed=self.seed)
        sampler.grid_size = math.prod(len(values) for values in grid.values())
        return sampler


def grid_sampler(search_space: Optional[Dict[str, Any]] = None, seed: Optional[int] = None) -> GridFromParams:
    """``_target_`` of ``hydra/sweeper/sampler=grid``."""
    if isinstance(search_space, DictConfig):
        search_space = OmegaConf.to_container(search_space, resolve=True)
    return GridFromParams(search_space, seed)


def _steps(distribution: Any) -> List[Any]:
    """Every value of a stepped Int/Float distribution, low to high inclusive."""
    count = int(round((distribution.high - distribution.low) / distribution.step)) + 1
    values = [distribution.low + i * distribution.step for i in range(count)]
    return [int(v) for v in values] if isinstance(distribution.step, int) else [round(v, 12) for v in values]
