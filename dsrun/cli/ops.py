"""Build dsrun's compiled ops ahead of time into the op cache, so that no run compiles on first use.

  dsrun ops build --all          build every op
  dsrun ops build cpu_adam       build the named ops
"""
from __future__ import annotations

import argparse
import sys
import time

from dsrun.utils.errors import Problem, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build"], help="what to do (build)")
    parser.add_argument("names", nargs="*", metavar="NAME", help="ops to build (see 'dsrun report')")
    parser.add_argument("--all", action="store_true", help="build every op")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines and output")


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: F401  (imported before the timer starts: it is not part of any op's load time)
    from op_builder import ALL_OPS, OpBuildError, get_builder

    from dsrun.utils.suggest import did_you_mean

    if args.all == bool(args.names):
        raise UserError(Problem("dsrun ops build", "name the ops to build or pass --all, not both or neither",
                                f"ops: {', '.join(ALL_OPS)}"))
    names = list(ALL_OPS) if args.all else args.names
    unknown = [n for n in names if n not in ALL_OPS]
    if unknown:
        raise UserError([Problem(f"op '{n}'", f"unknown; expected one of {', '.join(ALL_OPS)}",
                                 did_you_mean(n, ALL_OPS) or "") for n in unknown])
    failed = 0
    for name in names:
        builder = get_builder(name)
        started = time.perf_counter()
        try:
            builder.load(verbose=args.verbose)
        except OpBuildError as err:
            failed += 1
            print(f"{name}: FAILED\n{err}", file=sys.stderr)
            continue
        info = builder.last_load
        how = {"built": "built", "cache": "already built", "prebuilt": "prebuilt at install"}[info.source]
        print(f"{name}: {how} in {time.perf_counter() - started:.1f}s -> {info.path}")
    return 1 if failed else 0
