"""DeepSpeed's commands run by dsrun: what the executables ``dsrun alias install-bin DIR`` writes call.

- ``deepspeed [LAUNCHER FLAGS] SCRIPT ARGS`` is ``dsrun launch --as-deepspeed`` with DeepSpeed's flags
  (``--num_gpus`` / ``--num_accelerators``: ranks per node, on CPU too; ``--num_nodes``, ``-H/--hostfile``,
  ``-i/--include``, ``-e/--exclude``, ``--master_addr``, ``--master_port``, ``--launcher``, ``--launcher_args``,
  ``--no_ssh``, ``--node_rank``, ``--force_multi``, ``--bind_cores_to_rank``, ``--bind_core_list``, ...; the
  full list is ``dsrun launch --help``). Unambiguous prefixes of the flags are taken, as DeepSpeed's parser does.
- ``ds_report`` is ``dsrun report``.
- ``ds_elastic -c CONFIG [-w WORLD_SIZE]`` prints the config's elasticity section and the batch size and GPU
  counts it allows, as DeepSpeed's ``ds_elastic`` does.

A mistake (an unknown flag, an inconsistent set, a config the launcher refuses) is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NoReturn, Sequence

from dsrun.utils.errors import EXIT_USAGE, UserError


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusal is one line (``PROG: error: ...``, with a suggestion) and exit 2."""

    def error(self, message: str) -> NoReturn:
        from dsrun.utils.suggest import did_you_mean

        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        unknown = [word for word in message.partition(":")[2].split() if word.startswith("-")]
        hint = did_you_mean(unknown[0], flags) if unknown and "unrecognized" in message else ""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{f' ({hint})' if hint else ''}; "
                              f"see {self.prog} --help\n")


def _refused(prog: str, error: UserError) -> int:
    for problem in error.problems:
        print(f"{prog}: error: {problem}", file=sys.stderr)
    return EXIT_USAGE


def deepspeed(argv: Sequence[str]) -> int:
    """``deepspeed ARGS``: launch the script on dsrun's launcher, ``import deepspeed`` loading dsrun."""
    from dsrun.cli.launch import add_arguments, run
    from dsrun.launcher.options import options_from_args

    parser = OneLineParser(prog="deepspeed", description="DeepSpeed's launcher, run by dsrun (docs/deepspeed-alias.md)")
    add_arguments(parser)
    parser.allow_abbrev = True  # as DeepSpeed's parser (--launcher_arg); add_arguments turns it off for dsrun's
    args = parser.parse_args(list(argv))
    args.as_deepspeed = True
    try:
        problems = options_from_args(args).problems()
        if problems:
            raise UserError(problems)
        return run(args)
    except UserError as error:
        return _refused("deepspeed", error)


def ds_report(argv: Sequence[str]) -> int:
    """``ds_report``: dsrun's report of the compiled ops and the environment."""
    from dsrun.cli import report

    parser = OneLineParser(prog="ds_report", description=(report.__doc__ or "").strip())
    report.add_arguments(parser)
    parser.add_argument("--hide_operator_status", action="store_true", help="leave out the compiled ops")
    parser.add_argument("--hide_errors_and_warnings", action="store_true",
                        help="accepted for DeepSpeed's scripts; dsrun's report has no such section")
    return report.run(parser.parse_args(list(argv)))


def ds_elastic(argv: Sequence[str]) -> int:
    """``ds_elastic -c CONFIG [-w WORLD_SIZE]``: the elastic batch size and valid GPU counts of a config."""
    from dsrun.alias import DEEPSPEED_API_VERSION
    from dsrun.elasticity import ElasticityError, compute_elastic_config

    parser = OneLineParser(prog="ds_elastic", description="DeepSpeed's elasticity calculator, run by dsrun")
    parser.add_argument("-c", "--config", required=True, help="DeepSpeed config json")
    parser.add_argument("-w", "--world-size", type=int, default=0, help="intended/current world size")
    args = parser.parse_args(list(argv))
    try:
        with open(args.config) as f:
            ds_config = json.load(f)
    except (OSError, ValueError) as error:
        print(f"ds_elastic: error: cannot read {args.config}: {error}", file=sys.stderr)
        return EXIT_USAGE
    rule = "-" * 42
    print(f"{rule}\nElasticity config:\n{rule}")
    print(json.dumps(ds_config.get("elasticity"), indent=4, sort_keys=True))
    try:
        if args.world_size > 0:
            batch, gpus, micro = compute_elastic_config(ds_config, DEEPSPEED_API_VERSION, world_size=args.world_size)
            print(f"{rule}\nCalculated results for world size {args.world_size}:\n{rule}")
        else:
            batch, gpus = compute_elastic_config(ds_config, DEEPSPEED_API_VERSION)
            micro = None
            print(f"{rule}\nCalculated results:\n{rule}")
    except ElasticityError as error:
        print(f"ds_elastic: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(f"final_batch_size .... {batch}")
    print(f"valid_gpus .......... {gpus}")
    if micro is not None:
        print(f"micro_batch_size .... {micro}")
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "deepspeed": deepspeed, "ds_report": ds_report, "ds_elastic": ds_elastic}


def console(name: str) -> None:
    """Run the command ``name`` on this process's arguments and end the process with its exit code."""
    from dsrun.launcher.protocol import exit_without_teardown

    try:
        code = COMMANDS[name](sys.argv[1:])
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        code = 130
    exit_without_teardown(code)
