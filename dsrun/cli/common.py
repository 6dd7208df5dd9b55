"""Arguments and helpers shared by the subcommands that compose a RunSpec."""
from __future__ import annotations

import argparse


def add_compose_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a subcommand that composes a RunSpec. Also: a migrated legacy key is reported by
    the ``dsrun.config`` logger, so its :class:`~dsrun.config.LegacyConfigWarning` copy is not shown too."""
    import warnings

    from dsrun.config.migrate import LegacyConfigWarning

    warnings.simplefilter("ignore", LegacyConfigWarning)
    parser.add_argument("--recipes-dir", action="append", default=[], metavar="DIR",
                        help="a folder of your own recipes (repeatable; also $DSRUN_RECIPES_PATH)")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides: +recipe=NAME, group=option (zero=stage3), key=value "
                             "(ds.optimizer.params.lr=3e-4 or optimizer.params.lr=3e-4), +key=value, ~key, "
                             "ds_config=FILE")


def say_stage(line: str, *, err: bool = False) -> None:
    """A progress line (``[dsrun] ...``), printed at once: what a command does next when that takes seconds
    (composing, checking, starting ranks), so a busy machine's wait is not silence. On stdout with the
    command's other ``[dsrun]`` lines (an error stays the only line on stderr); ``err`` for a command whose
    stdout is its result (``dsrun generate``'s text)."""
    import sys

    print(f"[dsrun] {line}", file=sys.stderr if err else sys.stdout, flush=True)
