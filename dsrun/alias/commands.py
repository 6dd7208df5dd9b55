"""DeepSpeed's executables (``deepspeed``, ``ds_report``, ``ds_elastic``) as small scripts that run dsrun.

Never installed by default, so a real DeepSpeed in the same environment keeps its own commands: they exist only
in a folder the user names (``dsrun alias install-bin DIR``) or in a temporary folder that
``dsrun launch --as-deepspeed`` and ``python -m dsrun.alias`` put first on their children's ``PATH``
(:func:`temporary_bin`). Each script runs this interpreter (its ``#!`` line) with this copy of dsrun first on
the import path and on ``PYTHONPATH``, so the ranks it launches import the same dsrun, and calls the command's
entry point, :func:`dsrun.cli.deepspeed_commands.console`.
"""
from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

# the commands, each run by dsrun.cli.deepspeed_commands.console(name) (named as text: the alias sits below the CLI)
COMMANDS: tuple[str, ...] = ("deepspeed", "ds_report", "ds_elastic")

_SCRIPT = """#!{python}
# DeepSpeed's `{name}` command, run by dsrun (written by `dsrun alias install-bin`; see docs/deepspeed-alias.md).
import os
import sys

ROOT = {root!r}
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
_parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + _parts)  # the ranks import this dsrun too

from dsrun.cli.deepspeed_commands import console

console({name!r})
"""


def dsrun_root() -> Path:
    """The folder holding this ``dsrun`` package (and ``op_builder``): what the scripts put on the path."""
    return Path(__file__).resolve().parents[2]


def install_bin(directory: str | os.PathLike[str]) -> list[Path]:
    """Write the ``deepspeed``, ``ds_report`` and ``ds_elastic`` executables into ``directory`` (created if
    missing; existing files of those names are replaced). Returns their paths."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in COMMANDS:
        path = folder / name
        path.write_text(_SCRIPT.format(python=sys.executable, name=name, root=str(dsrun_root())))
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        written.append(path)
    return written


def environment_with_bin(environ: dict[str, str], bin_dir: str | os.PathLike[str]) -> dict[str, str]:
    """A copy of ``environ`` whose ``PATH`` starts with ``bin_dir``."""
    env = dict(environ)
    parts = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != str(bin_dir)]
    env["PATH"] = os.pathsep.join([str(bin_dir)] + parts)
    return env


def temporary_bin() -> Path:
    """A fresh temporary folder holding the executables, removed when this process exits."""
    folder = Path(tempfile.mkdtemp(prefix="dsrun-deepspeed-bin-"))
    atexit.register(shutil.rmtree, folder, True)
    install_bin(folder)
    return folder
