"""List the recipes dsrun can compose (built-in, $DSRUN_RECIPES_PATH and --recipes-dir): each name with the first
sentence of its description, whole, wrapped to the terminal's width."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipes-dir", action="append", default=[], metavar="DIR",
                        help="also list the recipes in this folder (repeatable)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dsrun.compose import list_recipes

    table = Table(title="recipes (use: dsrun train +recipe=NAME)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("description", overflow="fold")  # a long word breaks; no text is dropped
    for name, (_, description) in list_recipes(args.recipes_dir).items():
        table.add_row(name, description)
    Console().print(table)  # the terminal's width ($COLUMNS, else 80 when not a terminal); rows wrap
    return 0
