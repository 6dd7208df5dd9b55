"""Tuning a user's script: DeepSpeed's ``deepspeed --autotuning tune|run SCRIPT ... --deepspeed ds_config.json``
(``dsrun launch --autotuning ...``), through the same Optuna study as ``dsrun tune``.

The script's DeepSpeed config (``--deepspeed FILE``, ``--deepspeed_config FILE`` or ``--deepscale_config
FILE`` in its arguments) and its ``autotuning`` section are the settings (docs/autotuning.md, same keys). The
space is DeepSpeed's fast mode: the ZeRO stage (the config's own stage when it sets one, else 0-3) times the
micro batch sizes ``autotuning`` asks for; gradient accumulation keeps the config's value. Every experiment
is a real ``dsrun launch`` of the script with the same launcher flags, its config replaced by the trial's
(``RESULTS_DIR/<exp>/ds_config_trial.json``: the configuration, with ``autotuning.metric_path`` pointing at
``<exp>/run/metrics.json`` and ``wall_clock_breakdown`` on) and each ``arg_mappings`` flag set to its value.
The engine measures steps up to ``end_profile_step``, writes the file and exits
(:mod:`dsrun.engine.autotuning_probe`); the tuner computes the metric from the window, as for recipes.

Results: DeepSpeed's layout (``RESULTS_DIR/<exp>/{ds_config.json,cmd.txt,exp.json,metrics.json,...}``,
``summary.txt``, ``ds_config_optimal.json``, ``cmd_optimal.txt``: the script's own command with the best
config); ``--autotuning run`` then runs ``cmd_optimal.txt``.

Not honoured, each refused or said: ``autotuning.fast: false`` (DeepSpeed's per-stage ZeRO templates; dsrun
tunes more knobs only for recipes, ``autotuning=full``) is refused; there is no model-info run and no memory
pruning (dsrun's estimator needs a dsrun model: a configuration that does not fit fails and is recorded).
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dsrun.autotuning.settings import SpaceValue, TuneSettings
from dsrun.autotuning.space import ACCUMULATION_KEY, MICRO_BATCH_KEY, STAGE_KEY, SearchSpace
from dsrun.autotuning.study import EventFn, Tuner
from dsrun.autotuning.trial import Experiment
from dsrun.config import ds_section
from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from optuna.trial import Trial


SCRIPT_CONFIG_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepscale_config")
TRIAL_CONFIG = "ds_config_trial.json"
ALL_STAGES = [0, 1, 2, 3]


def find_config_arg(script_args: Sequence[str]) -> tuple[int, str]:
    """``(index of the value, path)`` of the DeepSpeed config the script's arguments name."""
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if flag not in SCRIPT_CONFIG_FLAGS:
            continue
        if eq:
            return i, value
        if i + 1 < len(script_args) and not script_args[i + 1].startswith("-"):
            return i + 1, script_args[i + 1]
    raise UserError(Problem("--autotuning", "the script's arguments name no DeepSpeed config",
                            "pass it as DeepSpeed's autotuner expects: SCRIPT ... --deepspeed ds_config.json"))


def with_config(script_args: Sequence[str], index: int, path: Path) -> list[str]:
    """The script's arguments with the config at ``index`` replaced by ``path``."""
    args = list(script_args)
    flag, eq, _ = args[index].partition("=")
    args[index] = f"{flag}={path}" if eq and flag in SCRIPT_CONFIG_FLAGS else str(path)
    return args


def with_flag(script_args: Sequence[str], flag: str, value: SpaceValue) -> list[str]:
    """``flag value`` set in the script's arguments (replacing its value when present, else appended)."""
    args = list(script_args)
    text = str(value)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            args[i + 1] = text
            return args
        if arg.startswith(flag + "="):
            args[i] = f"{flag}={text}"
            return args
    return [*args, flag, text]


def _concrete(value: object) -> bool:
    """Is a value of the user's config (any JSON value) set, not left to the tuner?"""
    return value is not None and value != "auto"


def space_mapping(user_ds: Mapping[str, Any], fast: bool) -> dict[str, Any]:
    """The ``tune`` mapping of a script's study: the ZeRO stage (the config's own, or 0-3) in fast mode."""
    if not fast:
        raise UserError(Problem("autotuning.fast", "false is not available for a script: dsrun tunes a script's "
                                "ZeRO stage and micro batch size only (DeepSpeed's fast mode)",
                                "drop \"fast\": false, or tune a recipe with dsrun tune autotuning=full"))
    zero = ds_section(user_ds, "zero_optimization")  # an "auto" stage is dropped there: not set
    return {"space": {STAGE_KEY: [int(zero.stage)] if "stage" in zero.model_fields_set else ALL_STAGES}}


def base_config(user_ds: Mapping[str, Any]) -> dict[str, Any]:
    """The user's config without the batch keys left to the tuner (``"auto"``) and without ``autotuning``."""
    ds = copy.deepcopy(dict(user_ds))
    ds.pop("autotuning", None)
    for key in (MICRO_BATCH_KEY, ACCUMULATION_KEY, "train_batch_size"):
        if key in ds and not _concrete(ds[key]):
            del ds[key]
    return ds


class ScriptTuner(Tuner):
    """The study over a user's script: each trial a ``dsrun launch`` of it (see the module docstring)."""

    def __init__(self, settings: TuneSettings, space: SearchSpace, user_ds: Mapping[str, Any],
                 launcher_args: Sequence[str], script: str, script_args: Sequence[str],
                 on_event: EventFn | None = None):
        super().__init__(settings, space, [], [], compose=None, on_event=on_event)
        self.user_ds = dict(user_ds)
        self.launcher_args, self.script, self.script_args = list(launcher_args), script, list(script_args)
        self.config_index, _ = find_config_arg(self.script_args)

    def model_info(self) -> dict[str, Any]:
        if self.settings.model_info and self.settings.model_info.get("num_params"):
            return {**self.settings.model_info, "source": "autotuning.model_info"}
        return {"source": "not profiled: a script's model is not known to dsrun before it runs (no memory pruning)"}

    def trial_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The DeepSpeed config of ``config`` as it would train (no ``autotuning`` section)."""
        ds = base_config(self.user_ds)
        for key in (STAGE_KEY, MICRO_BATCH_KEY, ACCUMULATION_KEY):
            value = self.space.value(config, key)
            head, _, tail = key.partition(".")
            if tail:
                ds[head] = {**(ds.get(head) or {}), tail: value}
            else:
                ds[key] = value
        ds["train_batch_size"] = self.space.train_batch_size(config)
        return ds

    def command(self, config: Mapping[str, Any], config_path: Path) -> list[str]:
        """The script's launch with ``config_path`` as its config and each ``arg_mappings`` flag set."""
        args = with_config(self.script_args, self.config_index, config_path)
        for key, flag in self.settings.arg_mappings.items():
            value = self.space.value(config, key) if key in (STAGE_KEY, MICRO_BATCH_KEY, ACCUMULATION_KEY) \
                else config.get(key)
            if value is not None:
                args = with_flag(args, flag, value)
        return [sys.executable, "-m", "dsrun", "launch", *self.launcher_args, self.script, *args]

    def _run_trial(self, trial: Trial, params: dict[str, Any], config: dict[str, Any], name: str) -> None:
        s = self.settings
        directory = s.results_dir / name
        run_dir = directory / "run"
        if run_dir.exists():  # an interrupted attempt of this configuration
            shutil.rmtree(run_dir)
        ds = self.trial_config(config)
        measured = {**ds, "wall_clock_breakdown": True, "steps_per_print": s.end_profile_step + 1,
                    "autotuning": {**ds_section(self.user_ds, "autotuning").model_dump(exclude_unset=True), "enabled": True,
                                   "metric_path": str(run_dir / "metrics.json"),
                                   "start_profile_step": s.start_profile_step, "end_profile_step": s.end_profile_step}}
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TRIAL_CONFIG).write_text(json.dumps(measured, indent=2) + "\n")
        exp = Experiment(name, directory, self.command(config, directory / TRIAL_CONFIG), ds,
                         {"trial": trial.number, "params": params, "num_gpus": self.space.world_size,
                          "script": self.script})
        self._launch_and_measure(trial, exp)

    def optimal_command(self, best_params: dict[str, Any], optimal_config: Path) -> list[str]:
        return self.command(self.space.config(best_params), optimal_config)
