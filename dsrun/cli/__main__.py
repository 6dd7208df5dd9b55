"""``dsrun``: the dispatcher.

Each subcommand lives in its own module under ``dsrun.cli`` and exposes ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their subcommand runs, so ``dsrun --help`` stays fast.
A :class:`~dsrun.utils.errors.UserError` becomes one line per problem on stderr and exit code 2; a
traceback is shown only with ``--debug`` or ``HYDRA_FULL_ERROR=1``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from dsrun import __version__
from dsrun.launcher.protocol import DEBUG_ENV
from dsrun.utils.errors import EXIT_USAGE, UserError

# name -> (module, one-line summary). Keep sorted by how users meet them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("dsrun.cli.train", "compose a recipe and train it (Hydra overrides; -m for multirun)"),
    "config": ("dsrun.cli.config", "print the resolved RunSpec or DeepSpeed config; validate a DeepSpeed config file"),
    "recipes": ("dsrun.cli.recipes", "list the available recipes"),
    "export-job": ("dsrun.cli.export_job", "write a Kubernetes manifest (PyTorchJob, TrainJob, JobSet) or an sbatch "
                   "script that trains a recipe on a cluster through torchrun/srun, resuming on restart"),
    "launch": ("dsrun.cli.launch", "launch a script on one or many machines, like the deepspeed launcher"),
    "tune": ("dsrun.cli.tune", "tune a recipe's ZeRO stage, micro batch and other knobs with Optuna (real short runs)"),
    "estimate-memory": ("dsrun.cli.estimate_memory", "estimate memory per rank and per host for a recipe or a parameter count"),
    "generate": ("dsrun.cli.generate", "generate text with a trained model (a run directory or checkpoint; TP over the ranks)"),
    "convert": ("dsrun.cli.convert", "convert checkpoints: zero-to-fp32 (one fp32 state dict), ds-to-universal, "
                "to-hf (a Hugging Face model folder)"),
    "export": ("dsrun.cli.export", "export a trained run compressed for real: packed int weights, pruned tensors gone"),
    "alias": ("dsrun.cli.alias", "install DeepSpeed's commands (deepspeed, ds_report, ds_elastic) into a folder: alias install-bin DIR"),
    "report": ("dsrun.cli.report", "show the compiled ops (built, compatible, SIMD level) and the environment"),
    "ops": ("dsrun.cli.ops", "build the compiled ops ahead of time: dsrun ops build [NAME...|--all]"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsrun",
        description="Declarative experiment runner for large-model training (DeepSpeed-compatible).",
        epilog="Run 'dsrun SUBCOMMAND --help' for a subcommand's options.",
    )
    parser.add_argument("--version", action="version", version=f"dsrun {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, (module_name, summary) in SUBCOMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def _subcommand_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    module_name, summary = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"dsrun {name}", description=(module.__doc__ or summary).strip())
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    module.add_arguments(parser)
    return parser, module


def _debug_requested(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    top = build_parser()
    # Find the subcommand: the first argument that is not a top-level option.
    command_index = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command_index is None:
        top.parse_args(argv)  # handles --help / --version
        top.print_help()
        return EXIT_USAGE if argv else 0
    name = argv[command_index]
    if name not in SUBCOMMANDS:
        from dsrun.utils.suggest import did_you_mean

        hint = did_you_mean(name, SUBCOMMANDS)
        print(f"dsrun: unknown subcommand '{name}'; expected one of {', '.join(SUBCOMMANDS)}"
              + (f" ({hint})" if hint else ""), file=sys.stderr)
        return EXIT_USAGE
    rest = [a for i, a in enumerate(argv) if i != command_index and not (i < command_index and a == "--debug")]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # the ranks show their tracebacks too
    try:
        parser, module = _subcommand_parser(name)
        # a subcommand whose positionals may follow its options (``SOURCE --prompt X key=value``) says so
        intermixed = getattr(module, "INTERMIXED_ARGS", False)
        args = parser.parse_intermixed_args(rest) if intermixed else parser.parse_args(rest)
        return int(module.run(args) or 0)
    except UserError as err:
        if debug:
            raise
        for problem in err.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dsrun: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dsrun config --json | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def console() -> None:
    """The ``dsrun`` command (and ``python -m dsrun``): :func:`main`, then an exit without the interpreter's
    teardown (:func:`~dsrun.launcher.protocol.exit_without_teardown`); :func:`main` itself returns, for callers
    in the same process."""
    from dsrun.launcher.protocol import exit_without_teardown

    exit_without_teardown(main())


if __name__ == "__main__":
    console()
