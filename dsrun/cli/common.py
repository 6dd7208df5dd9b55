"""Arguments and helpers shared by the subcommands that compose a RunSpec."""
from __future__ import annotations

import argparse


def add_compose_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipes-dir", action="append", default=[], metavar="DIR",
                        help="a folder of your own recipes (repeatable; also $DSRUN_RECIPES_PATH)")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides: +recipe=NAME, group=option (zero=stage3), key=value "
                             "(ds.optimizer.params.lr=3e-4 or optimizer.params.lr=3e-4), +key=value, ~key, "
                             "ds_config=FILE")
