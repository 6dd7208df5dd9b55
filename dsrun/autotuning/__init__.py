"""``dsrun tune``: an Optuna study over a recipe's search space, where every trial is a short, real
``dsrun train`` launch (docs/autotuning.md).

Layout: :mod:`~dsrun.autotuning.settings` (``ds.autotuning`` + the recipe's ``tune`` section →
:class:`TuneSettings`), :mod:`~dsrun.autotuning.space` (configurations, overrides, experiment names),
:mod:`~dsrun.autotuning.memory` (pruning with the memory estimator), :mod:`~dsrun.autotuning.trial` (one
launch and its files), :mod:`~dsrun.autotuning.metrics` (the profile-window metric),
:mod:`~dsrun.autotuning.study` (the Optuna study: samplers, resume, early stopping) and
:mod:`~dsrun.autotuning.results` (summary.txt, ds_config_optimal.json, cmd_optimal.txt).

Python API::

    settings = settings_from(resolved.ds.autotuning, raw_autotuning, cfg.tune, Path.cwd())
    space = build_space(settings, resolved.ds_dict(), resolved.world_size)
    tuner = Tuner(settings, space, overrides, recipes_dirs, compose=lambda o: (cfg, resolve_run(cfg)))
    study = tuner.run()            # an optuna.Study; resumes the one in settings.results_dir
    paths = write_results(tuner)   # summary, ds_config_optimal, cmd_optimal
"""
from __future__ import annotations

from dsrun.autotuning.metrics import METRIC_KEYS, ProfileError, metric_value, profile_metrics
from dsrun.autotuning.results import best_row, trial_rows, write_results
from dsrun.autotuning.settings import TuneSettings, parse_bytes, settings_from
from dsrun.autotuning.space import SearchSpace, build_space
from dsrun.autotuning.study import STUDY_DB, STUDY_NAME, Tuner

__all__ = ["METRIC_KEYS", "ProfileError", "STUDY_DB", "STUDY_NAME", "SearchSpace", "TuneSettings", "Tuner",
           "best_row", "build_space", "metric_value", "parse_bytes", "profile_metrics", "settings_from",
           "trial_rows", "write_results"]
