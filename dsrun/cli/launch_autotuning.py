"""``dsrun launch --autotuning tune|run SCRIPT ... --deepspeed ds_config.json`` (DeepSpeed's ``deepspeed
--autotuning``): tune the script's DeepSpeed config with dsrun's Optuna tuner (dsrun/autotuning/script.py,
docs/autotuning.md "Tuning a script"); ``run`` then launches the script with the best config.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

# launcher flags a trial must not repeat: it is one local launch that the tuner supervises
_NOT_FORWARDED = {"autotuning", "script", "script_args", "dry_run", "save_pid", "max_restarts"}


def launcher_flags(args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """The launcher flags of ``args`` (parsed by a parser ``add_arguments`` builds) that differ from their
    defaults, as command-line words."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    words: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in _NOT_FORWARDED or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1] if action.option_strings[0].startswith("-") and \
            not action.option_strings[0].startswith("--") else action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        else:
            words += [flag, str(value)]
    return words


def run(args: argparse.Namespace, world_size: int, add_arguments: Callable[[argparse.ArgumentParser], None]) -> int:
    from dsrun.autotuning import build_space, settings_from
    from dsrun.autotuning.script import ScriptTuner, find_config_arg, space_mapping
    from dsrun.cli.tune import Reporter, tune_and_report
    from dsrun.config import ds_section, load_ds_config
    from dsrun.utils.errors import Problem, UserError

    _, path = find_config_arg(args.script_args)
    if not Path(path).is_file():
        raise UserError(Problem("--deepspeed", f"{path} is not a file", "pass the script's DeepSpeed config JSON"))
    user_ds = json.loads(Path(path).read_text())
    if not ds_section(user_ds, "autotuning").enabled:
        raise UserError(Problem("autotuning.enabled", f"{path} does not enable autotuning",
                                'add "autotuning": {"enabled": true} to it, as DeepSpeed requires'))
    section = load_ds_config(path, world_size=None, world_size_source="dsrun launch --autotuning").autotuning
    # the keys the user set, as settings_from reads them (an unset overwrite is False there, as before)
    settings = settings_from(section, section.model_dump(exclude_unset=True), space_mapping(user_ds, bool(section.fast)), Path.cwd())
    space = build_space(settings, {k: v for k, v in user_ds.items() if v != "auto"}, world_size, script=True)
    tuner: Any = ScriptTuner(settings, space, user_ds, launcher_flags(args, add_arguments), args.script, args.script_args)
    reporter = Reporter(settings, space)
    tuner.on_event = reporter.event
    return tune_and_report(tuner, reporter, args.autotuning == "run")
