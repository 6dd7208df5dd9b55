"""Print the resolved RunSpec (YAML) or DeepSpeed config (--json), or validate a DeepSpeed config file.

Examples:
  dsrun config +recipe=gpt_zero3            the whole RunSpec, resolved, as YAML
  dsrun config --json +recipe=gpt_zero3     only the resolved DeepSpeed config, as JSON
  dsrun config --validate ds_config.json --world-size 8
  dsrun config --explain zero_optimization.reduce_bucket_size    type, default, status in dsrun, meaning

A config that enables a feature dsrun does not implement is refused (exit code 2), one line per key; with
"dsrun_allow_unimplemented": true it runs without them, with one warning line per key. Every key's status:
docs/config_support.md.
"""
from __future__ import annotations

import argparse
import json
import sys

from dsrun.cli.common import add_compose_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--json", action="store_true", help="print only the resolved DeepSpeed config as JSON")
    parser.add_argument("--validate", metavar="FILE",
                        help="validate a DeepSpeed JSON/hjson/YAML file as DeepSpeed would at initialize")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="world size for --validate's batch-size check (default 1)")
    parser.add_argument("--support-table", action="store_true",
                        help="print every key's status in dsrun as the markdown table of docs/config_support.md")
    parser.add_argument("--explain", metavar="KEY",
                        help="print a DeepSpeed key's type, default, status in dsrun (implemented, no effect by "
                             "design, not implemented) and meaning")
    add_compose_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.explain or args.support_table:
        from dsrun.config.support import explain, render_markdown

        print(explain(args.explain) if args.explain else render_markdown(), end="\n" if args.explain else "")
        return 0
    if args.validate:
        return _validate_file(args)
    from omegaconf import OmegaConf

    from dsrun.compose import compose_runspec, runspec_to_yaml
    from dsrun.config import announce
    from dsrun.runspec import resolve_run

    run_ = resolve_run(compose_runspec(args.overrides, args.recipes_dir))
    announce(run_.ds)
    if args.json:
        print(json.dumps(run_.ds_dict(), indent=2))
        return 0
    spec = OmegaConf.to_container(run_.runspec, resolve=True)
    spec["ds"] = run_.ds_dict()
    print(runspec_to_yaml(OmegaConf.create(spec)), end="")
    return 0


def _validate_file(args: argparse.Namespace) -> int:
    from dsrun.config import announce, load_ds_config
    from dsrun.utils.errors import EXIT_USAGE, ConfigError, UserError

    if args.overrides:
        raise UserError(f"--validate takes a file, not overrides (got {' '.join(args.overrides)})")
    if args.world_size is not None and args.world_size < 1:
        raise UserError("--world-size: must be at least 1")
    world_size = args.world_size or 1
    source = f"--world-size {world_size}" if args.world_size else "default --world-size 1"
    try:  # the same loading initialize does: schema, batch sizes, rules, the support ledger
        cfg = load_ds_config(args.validate, world_size=world_size, world_size_source=source)
    except ConfigError as err:
        for problem in err.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    announce(cfg)
    print("valid")
    return 0
