"""``python -m dsrun.alias script.py ARGS``: run one script with ``import deepspeed`` loading dsrun (and
DeepSpeed's commands, ``deepspeed``, ``ds_report``, ``ds_elastic``, first on its children's PATH)."""
from __future__ import annotations

import os
import runpy
import sys

from dsrun.alias import install
from dsrun.alias.commands import environment_with_bin, temporary_bin
from dsrun.utils.errors import EXIT_USAGE, UserError


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) >= 2 else EXIT_USAGE
    try:
        install()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    # the script's own children find DeepSpeed's commands (deepspeed, ds_report, ds_elastic) first on PATH
    os.environ.update(environment_with_bin(dict(os.environ), temporary_bin()))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    if script == "-m":
        sys.argv = sys.argv[1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
