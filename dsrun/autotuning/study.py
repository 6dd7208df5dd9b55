"""The Optuna study: sampling configurations, pruning, launching, early stopping and resuming.

State lives in ``RESULTS_DIR/study.db`` (Optuna's SQLite storage, study ``dsrun-tune``). Running ``dsrun
tune`` again with the same results dir continues the study: finished trials (complete, pruned, failed) are
never repeated. A trial that was still running when the tuner was stopped (Ctrl-C, SIGKILL, a crash) is
marked failed with the note ``interrupted`` and its configuration is queued again, so it runs once more on
the next start; interrupted trials do not count against ``tuner_num_trials``.

``tuner_type`` picks the sampler: ``gridsearch`` → ``GridSampler`` (every configuration once, in a
seeded random order), ``random`` → ``RandomSampler``, ``model_based`` → ``TPESampler``. A sampler that
proposes a configuration already explored gets that trial's outcome back at no cost (the trial is recorded
as a duplicate and not counted). Tuning stops after ``tuner_num_trials`` trials, when every configuration
has been explored, or after ``tuner_early_stopping`` launched trials in a row without a better metric.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dsrun.autotuning.memory import MemoryGate
from dsrun.autotuning.metrics import ProfileError, metric_value, profile_metrics
from dsrun.autotuning.settings import TuneSettings
from dsrun.autotuning.space import MICRO_BATCH_KEY, ACCUMULATION_KEY, SearchSpace, batch_size_bound, override_key
from dsrun.autotuning.trial import (Experiment, error_summary, launch, measurement_overrides, stop_leftover_launch,
                                    train_command, without_keys)
from dsrun.utils.errors import Problem, UserError
from dsrun.utils.net import free_port

if TYPE_CHECKING:
    import optuna
    from omegaconf import DictConfig
    from optuna.trial import FrozenTrial, Trial, TrialState

    from dsrun.launcher.slurm_jobs import SrunTrials
    from dsrun.runspec import ResolvedRun

STUDY_NAME = "dsrun-tune"
STUDY_DB = "study.db"
MODEL_INFO_DIR = "profile_model_info"
MAX_DUPLICATES_IN_A_ROW = 200

# user attribute "kind" of a finished trial
LAUNCHED, PRUNED, INVALID, DUPLICATE, INTERRUPTED = "launched", "pruned", "invalid", "duplicate", "interrupted"

ComposeFn = Callable[[list[str]], "tuple[DictConfig, ResolvedRun]"]  # overrides -> (composed RunSpec, its validation)
EventFn = Callable[[str, dict[str, Any]], None]


def make_sampler(settings: TuneSettings, space: SearchSpace) -> Any:
    import optuna

    if settings.tuner_type == "gridsearch":
        class AskTellGridSampler(optuna.samplers.GridSampler):
            # GridSampler stops the study when the grid is done, which only works inside study.optimize;
            # the tuner's ask/tell loop checks for an exhausted space itself.
            def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                            values: Sequence[float] | None) -> None:
                pass

        return AskTellGridSampler(space.sampler_space(), seed=settings.seed)
    if settings.tuner_type == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    import warnings

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # multivariate
    return optuna.samplers.TPESampler(seed=settings.seed, n_startup_trials=min(4, max(1, space.size // 4)),
                                      multivariate=True)


def config_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def space_signature(settings: TuneSettings, space: SearchSpace) -> str:
    return json.dumps({"dims": space.dims, "fixed": space.fixed, "metric": settings.metric}, sort_keys=True,
                      default=str)


def ds_for_file(resolved: ResolvedRun) -> dict[str, Any]:
    """The resolved DeepSpeed config of a trial as it would train: without the ``autotuning`` block."""
    ds = resolved.ds_dict()
    ds.pop("autotuning", None)
    return ds


def _new_storage(db: Path) -> None:
    """Create Optuna's schema in ``db`` under a temporary name, then rename it into place: a reader that opens
    the file while the tuner starts (a test, ``optuna-dashboard``) sees no file or a whole one, never races
    the tuner to stamp the schema version."""
    import optuna

    partial = db.with_name(f".{db.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{partial}")
    storage.engine.dispose()
    os.replace(partial, db)


def trial_traffic(trial: FrozenTrial) -> float | None:
    """The estimator's bytes leaving a rank per optimizer step for a trial's configuration (None: unknown)."""
    comm = trial.user_attrs.get("estimated_comm_per_step")
    return None if not comm else float(comm["traffic_bytes"])


@dataclass
class StopReason:
    text: str = ""


class Tuner:
    """One ``dsrun tune``: ``run()`` tunes (resuming the study in ``settings.results_dir``) and returns the
    Optuna study."""

    def __init__(self, settings: TuneSettings, space: SearchSpace, base_overrides: Sequence[str],
                 recipes_dirs: Sequence[str], compose: ComposeFn, on_event: EventFn | None = None,
                 srun: SrunTrials | None = None):
        self.settings = settings
        self.srun = srun  # dsrun tune --slurm: every launch a Slurm job, srun starting its ranks
        self.space = space
        self.recipes_dirs = list(recipes_dirs)
        self.compose = compose
        self.on_event = on_event or (lambda kind, data: None)
        tuned = [override_key(k) for k in space.config({k: v[0] for k, v in space.dims.items()})]
        tuned += [f"ds.{MICRO_BATCH_KEY}", f"ds.{ACCUMULATION_KEY}", "ds.train_batch_size",
                  *settings.arg_mappings.values()]
        self.base_overrides = without_keys(base_overrides, [*tuned, "hydra.run.dir"])
        self.gate = MemoryGate(settings.memory_limit)
        self.stop = StopReason()
        self.study: Any = None
        self._session_start = time.monotonic()
        self._elapsed_before = 0.0

    # ------------------------------------------------------------------------------------------ study
    @property
    def db_path(self) -> Path:
        return self.settings.results_dir / STUDY_DB

    def _open_study(self) -> optuna.Study:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        s = self.settings
        s.results_dir.mkdir(parents=True, exist_ok=True)
        if s.overwrite and self.db_path.exists():
            self._discard_previous()
        if not self.db_path.exists():
            _new_storage(self.db_path)
        study = optuna.create_study(study_name=STUDY_NAME, storage=f"sqlite:///{self.db_path}",
                                    sampler=make_sampler(s, self.space), load_if_exists=True,
                                    direction=s.direction)
        signature = space_signature(s, self.space)
        previous = study.user_attrs.get("signature")
        if previous is not None and previous != signature and study.trials:
            raise UserError(Problem("ds.autotuning.results_dir",
                                    f"{s.results_dir} holds a study over another search space or metric",
                                    "set ds.autotuning.overwrite=true to start over, or pick another results_dir"))
        study.set_user_attr("signature", signature)
        study.set_user_attr("space", {k: list(v) for k, v in self.space.dims.items()})
        self._elapsed_before = float(study.user_attrs.get("tuning_seconds", 0.0))
        return study

    def _discard_previous(self) -> None:
        """``overwrite: true``: remove what an earlier study wrote (and only that)."""
        import optuna

        try:
            old = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{self.db_path}")
            names = {t.user_attrs.get("exp_name") for t in old.trials} - {None}
        except Exception:  # an unreadable database: nothing to clean up but the file
            names = set()
        for name in [*names, MODEL_INFO_DIR]:
            target = self.settings.results_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            (self.settings.exps_dir / f"{name}.json").unlink(missing_ok=True)
        for name in (STUDY_DB, "summary.txt", "ds_config_optimal.json", "cmd_optimal.txt"):
            (self.settings.results_dir / name).unlink(missing_ok=True)

    def _recover_interrupted(self) -> list[int]:
        """Trials left RUNNING by a tuner that was killed: mark them failed (interrupted) and queue their
        configurations again."""
        from optuna.trial import TrialState

        study, requeued = self.study, []
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            stop_leftover_launch(trial.user_attrs.get("launch_pid"))
            storage = study._storage
            storage.set_trial_user_attr(trial._trial_id, "kind", INTERRUPTED)
            storage.set_trial_user_attr(trial._trial_id, "error", "interrupted: dsrun tune stopped while this "
                                        "trial ran; its configuration was queued again")
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            if trial.params:
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
            requeued.append(trial.number)
        return requeued

    def _save_elapsed(self) -> None:
        self.study.set_user_attr("tuning_seconds", self.elapsed_s)

    @property
    def elapsed_s(self) -> float:
        return self._elapsed_before + time.monotonic() - self._session_start

    # ---------------------------------------------------------------------------------- model info
    def model_info(self) -> dict[str, Any]:
        """DeepSpeed's first run: the model's parameter count and activation memory. Given
        ``ds.autotuning.model_info.num_params``, nothing is launched; a previous run's file is reused."""
        s = self.settings
        path = s.results_dir / MODEL_INFO_DIR / "model_info.json"
        if s.model_info and s.model_info.get("num_params"):
            return {**s.model_info, "source": "ds.autotuning.model_info"}
        if path.is_file() and not s.overwrite:
            return json.loads(path.read_text())
        config = {MICRO_BATCH_KEY: 1, ACCUMULATION_KEY: 1}
        overrides = [*without_keys(self.base_overrides, [f"ds.{k}" for k in config]),
                     *self.space.overrides(config)]
        cfg, resolved = self.compose(overrides)
        measurement = measurement_overrides(1, free_port())
        command, env = self._command(train_command([*without_keys(overrides, measurement), *measurement],
                                                   self.recipes_dirs, s.results_dir / MODEL_INFO_DIR / "run"),
                                     MODEL_INFO_DIR)
        exp = Experiment(MODEL_INFO_DIR, s.results_dir / MODEL_INFO_DIR, command, ds_for_file(resolved),
                         {"num_gpus": resolved.world_size, "purpose": "model info"}, env)
        if exp.run_dir.exists():  # an interrupted attempt
            shutil.rmtree(exp.run_dir)
        exp.write_files(s.exps_dir)
        self.on_event("model_info_start", {"dir": str(exp.directory)})
        result = launch(exp, s.trial_timeout)
        if not result.ok:
            raise UserError(Problem("model info run", "the model is not runnable with this config: "
                                    + error_summary(result.error), f"see {exp.directory / 'stderr.log'}"))
        from dsrun.estimate.measure import load_measured_peaks

        try:
            peaks = load_measured_peaks(exp.run_dir)
        except UserError:
            peaks = {}
        activations = self.gate.estimate(cfg, micro_batch_size=1).activations
        model = cfg.model
        info = {"num_params": int(result.worker_metrics["num_params"]),
                "trainable_num_params": int(result.worker_metrics["num_params"]),
                "activation_mem_per_gpu": int(activations),
                "activation_mem_source": "dsrun estimator, micro batch 1",
                "measured_peak_bytes_per_rank": {str(k): int(v) for k, v in peaks.items()},
                "hidden_size": model.get("n_embd"), "num_layers": model.get("n_layer"), "rank": 0,
                "launch_seconds": round(result.elapsed_s, 2)}
        path.write_text(json.dumps(info, indent=2) + "\n")
        return info

    # -------------------------------------------------------------------------------------- the loop
    def _lock(self) -> None:
        """One tuner per results dir: a second one would take the first one's running trial for an
        interrupted one. The lock dies with its process, however it ends."""
        import fcntl

        self.settings.results_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.settings.results_dir / ".lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(Problem("ds.autotuning.results_dir", f"another dsrun tune is using "
                                    f"{self.settings.results_dir}", "wait for it, or pick another results_dir")) from None

    def run(self) -> optuna.Study:
        from optuna.trial import TrialState

        self._lock()
        try:
            self.study = self._open_study()
            requeued = self._recover_interrupted()
            if requeued:
                self.on_event("requeued", {"trials": requeued})
            info = self.model_info()
        except BaseException:
            self._lock_file.close()
            raise
        self.study.set_user_attr("model_info", info)
        self.on_event("model_info", info)
        explored = self._explored()
        duplicates_in_a_row = 0
        try:
            while True:
                counted = self._counted()
                if counted >= self.settings.tuner_num_trials:
                    self.stop.text = f"reached tuner_num_trials={self.settings.tuner_num_trials}"
                    break
                if len(explored) >= self.space.size:
                    self.stop.text = f"explored all {self.space.size} configurations"
                    break
                if self._early_stop():
                    break
                trial = self.study.ask()
                params = self.space.suggest(trial)
                trial.set_user_attr("config", params)
                key = config_key(params)
                if key in explored and "retry_of" not in trial.user_attrs:
                    self._tell_duplicate(trial, explored[key])
                    duplicates_in_a_row += 1
                    if duplicates_in_a_row >= MAX_DUPLICATES_IN_A_ROW:
                        self.stop.text = "the sampler proposed only explored configurations"
                        break
                    continue
                duplicates_in_a_row = 0
                self.on_event("trial_start", {"number": trial.number, "index": counted + 1,
                                              "total": min(self.settings.tuner_num_trials, self.space.size),
                                              "name": self.space.experiment_name(self.space.config(params))})
                self._evaluate(trial, params)
                explored[key] = self.study._storage.get_trial(trial._trial_id)
                self._save_elapsed()
                self.on_event("trial_end", {"trial": explored[key], "best": self.best_trial()})
        except KeyboardInterrupt:
            self.stop.text = "interrupted"
            running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if running:
                self._recover_interrupted()
            raise
        finally:
            self._save_elapsed()
            self._lock_file.close()
        return self.study

    def _explored(self) -> dict[str, FrozenTrial]:
        """Configurations with an outcome: key → the trial that has it."""
        from optuna.trial import TrialState

        done = {}
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                               TrialState.FAIL)):
            if t.user_attrs.get("kind") in (LAUNCHED, PRUNED, INVALID):
                done.setdefault(config_key(self.space.decode(t.params)), t)
        return done

    def _counted(self) -> int:
        return sum(1 for t in self.study.get_trials(deepcopy=False)
                   if t.state.is_finished() and t.user_attrs.get("kind") in (LAUNCHED, PRUNED, INVALID))

    def _launched(self) -> list[FrozenTrial]:
        return [t for t in self.study.get_trials(deepcopy=False)
                if t.state.is_finished() and t.user_attrs.get("kind") == LAUNCHED]

    def best_trial(self, by_metric_only: bool = False) -> FrozenTrial | None:
        """The best launched trial: by the metric, and among those within ``tune.comm_tolerance`` of it, the
        one whose configuration sends the fewest bytes (:meth:`TuneSettings.pick_best`); ``by_metric_only``:
        the best measured value alone (early stopping counts from it)."""
        from optuna.trial import TrialState

        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.user_attrs.get("kind") == LAUNCHED]
        comm = (lambda t: None) if by_metric_only else trial_traffic  # noqa: E731
        return self.settings.pick_best(done, lambda t: t.value, comm)

    def _early_stop(self) -> bool:
        launched = self._launched()
        best = self.best_trial(by_metric_only=True)
        since = [t for t in launched if best is None or t.number > best.number]
        if len(since) >= self.settings.tuner_early_stopping:
            self.stop.text = (f"early stopping: {len(since)} launched trials without improvement "
                              f"(tuner_early_stopping={self.settings.tuner_early_stopping})")
            return True
        return False

    def _tell_duplicate(self, trial: Trial, original: FrozenTrial) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("kind", DUPLICATE)
        trial.set_user_attr("duplicate_of", original.number)
        trial.set_user_attr("exp_name", original.user_attrs.get("exp_name"))
        if original.state == TrialState.COMPLETE:
            self.study.tell(trial, original.value)
        else:
            self.study.tell(trial, state=original.state if original.state == TrialState.PRUNED else TrialState.FAIL)

    # ------------------------------------------------------------------------------------ one trial
    def _finish(self, trial: Trial, kind: str, *, value: float | None = None, pruned: bool = False,
                **attrs: object) -> None:
        """Tell the study how ``trial`` ended; ``attrs`` become its user attributes (any JSON value)."""
        from optuna.trial import TrialState

        trial.set_user_attr("kind", kind)
        for key, val in attrs.items():
            trial.set_user_attr(key, val)
        if value is not None:
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=TrialState.PRUNED if pruned else TrialState.FAIL)

    def _evaluate(self, trial: Trial, params: dict[str, Any]) -> None:
        s, space = self.settings, self.space
        config = space.config(params)
        name = space.experiment_name(config)
        trial.set_user_attr("exp_name", name)
        trial.set_user_attr("tuning_space", space.tuning_space_of(config))
        bound = batch_size_bound(s, space.train_batch_size(config))  # max/min_train_batch_size
        if bound is not None:
            return self._finish(trial, PRUNED, pruned=True, reason=bound)
        self._run_trial(trial, params, config, name)

    def _run_trial(self, trial: Trial, params: dict[str, Any], config: dict[str, Any], name: str) -> None:
        """Compose, check the memory of, launch and measure one configuration (a ``dsrun train`` launch)."""
        s, space = self.settings, self.space
        overrides = [*self.base_overrides, *space.overrides(config, s.arg_mappings)]
        measurement = measurement_overrides(s.end_profile_step, free_port())
        try:
            cfg, resolved = self.compose(overrides)
        except UserError as err:
            text = "; ".join(str(p) for p in err.problems)
            return self._finish(trial, INVALID, error=f"invalid configuration: {text}", error_line=text)
        try:
            memory = self.gate.check(cfg)
        except UserError as err:  # settings the estimator refuses as the engine would (hpZ with MiCS)
            text = "; ".join(str(p) for p in err.problems)
            return self._finish(trial, INVALID, error=f"invalid configuration: {text}", error_line=text)
        trial.set_user_attr("estimated_bytes_per_rank", memory.need_bytes)
        if memory.comm is not None:
            trial.set_user_attr("estimated_comm_per_step", memory.comm)
        if not memory.fits:
            return self._finish(trial, PRUNED, pruned=True, reason=memory.reason)
        run_dir = s.results_dir / name / "run"
        if run_dir.exists():  # an interrupted attempt of this configuration
            shutil.rmtree(run_dir)
        command, env = self._command(train_command([*without_keys(overrides, measurement), *measurement],
                                                   self.recipes_dirs, run_dir), name)
        exp = Experiment(name, s.results_dir / name, command, ds_for_file(resolved),
                         {"trial": trial.number, "params": params, "overrides": overrides,
                          "num_gpus": resolved.plan.world_size, "num_nodes": len(resolved.plan.hosts),
                          "hostfile": resolved.plan.hostfile, "memory_estimate": memory.breakdown,
                          "memory_check": memory.reason, "comm_estimate_per_step": memory.comm}, env)
        self._launch_and_measure(trial, exp)

    def _command(self, command: list[str], name: str) -> tuple[list[str], dict[str, str]]:
        """A launch's command and what its environment adds: as it is, or a Slurm job's (``dsrun tune --slurm``)."""
        return self.srun.wrap(command, f"dsrun-tune-{name}") if self.srun is not None else (command, {})

    def _launch_and_measure(self, trial: Trial, exp: Experiment) -> None:
        """Write the experiment's files, launch it, and record its profile metric (or its failure)."""
        s = self.settings
        exp.write_files(s.exps_dir)
        (exp.directory / "metrics.json").unlink(missing_ok=True)
        result = launch(exp, s.trial_timeout, on_start=lambda pid: trial.set_user_attr("launch_pid", pid))
        trial.set_user_attr("launch_seconds", round(result.elapsed_s, 3))
        if not result.ok:
            return self._finish(trial, LAUNCHED, error=result.error, error_line=error_summary(result.error))
        try:
            profile = profile_metrics(result.worker_metrics, s.start_profile_step, s.end_profile_step)
            value = metric_value(profile, s.metric)
        except ProfileError as err:
            return self._finish(trial, LAUNCHED, error=str(err), error_line=str(err))
        (exp.directory / "metrics.json").write_text(json.dumps(profile, indent=2) + "\n")
        self._finish(trial, LAUNCHED, value=value, metrics={k: profile[k] for k in
                                                             ("latency", "throughput", "FLOPS_per_gpu")})

    def optimal_command(self, best_params: dict[str, Any], optimal_config: Path) -> list[str]:
        """The command that trains with the best configuration (``cmd_optimal.txt``)."""
        return optimal_command(self.base_overrides, best_params, self.space, self.settings, self.recipes_dirs,
                               optimal_config)


def optimal_command(base_overrides: Sequence[str], best_params: dict[str, Any], space: SearchSpace,
                    settings: TuneSettings, recipes_dirs: Sequence[str], optimal_config: Path) -> list[str]:
    """``dsrun train`` with the best DeepSpeed config as ``ds_config=`` plus the tuned RunSpec keys (those
    outside ``ds``, and arg_mappings' targets), which a DeepSpeed file cannot carry."""
    config = space.config(best_params)
    extra = [o for o in space.overrides(config, settings.arg_mappings) if not o.lstrip("+").startswith("ds.")]
    base = without_keys(base_overrides, ["ds_config", *[o.lstrip("+").split("=")[0] for o in extra]])
    base = [o for o in base if not o.lstrip("+~").startswith("ds.")]  # now inside the optimal config
    return [sys.executable, "-m", "dsrun", "train", *base, *extra, f"ds_config={optimal_config}",
            *[arg for d in recipes_dirs for arg in ("--recipes-dir", str(d))]]
