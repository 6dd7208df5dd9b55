"""DeepSpeed's commands for a shell: ``dsrun alias install-bin DIR`` writes the ``deepspeed``, ``ds_report`` and
``ds_elastic`` executables into DIR; put DIR first on PATH and DeepSpeedExamples' ``run.sh`` scripts run unedited
(``deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json``, ``import deepspeed`` loading dsrun).

Nothing is installed by default, so a real DeepSpeed keeps its own commands; the ``deepspeed`` command refuses to
run where a real DeepSpeed package is importable. See docs/deepspeed-alias.md.

Example:
  dsrun alias install-bin ~/.local/dsrun-deepspeed/bin && export PATH=~/.local/dsrun-deepspeed/bin:$PATH
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = actions.add_parser("install-bin", help="write deepspeed, ds_report and ds_elastic into DIR")
    install.add_argument("dir", metavar="DIR", help="the folder to write them into (created if missing)")


def run(args: argparse.Namespace) -> int:
    from dsrun.alias import real_deepspeed
    from dsrun.alias.commands import install_bin
    from dsrun.utils.errors import Problem, UserError

    found = real_deepspeed()
    if found is not None:
        raise UserError(Problem("dsrun alias install-bin", f"a real DeepSpeed is installed ({found}); its commands "
                                "would be shadowed", "use another environment for dsrun's deepspeed command"))
    for path in install_bin(args.dir):
        print(path)
    return 0
