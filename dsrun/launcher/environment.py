"""What environment a job's nodes get: exported prefixes and ``.dsrun_env`` / ``.deepspeed_env`` files.

Every node receives the launcher's variables whose names start with one of :data:`EXPORT_PREFIXES`, then
the ``KEY=VALUE`` lines of the environment files (a later file wins over an earlier one, files win over
prefixes). Files are looked up in the home directory first and then the working directory, so a project's
file overrides a user's defaults; ``DSRUN_ENV_FILE`` (or DeepSpeed's ``DS_ENV_FILE``) names one extra file
read last. Unlike DeepSpeed's parser, blank lines, ``#`` comments and ``export KEY=VALUE`` are accepted.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from dsrun.utils.errors import Problem, UserError, show

# DeepSpeed's list, plus GLOO: on CPU clusters GLOO_SOCKET_IFNAME plays the part NCCL_SOCKET_IFNAME does on GPUs.
EXPORT_PREFIXES: tuple[str, ...] = ("NCCL", "PYTHON", "MLFLOW", "UCX", "MV2", "OMP", "GLOO")
ENV_FILE_NAMES: tuple[str, ...] = (".deepspeed_env", ".dsrun_env")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines; the value is everything after the first ``=``, surrounding quotes removed."""
    values: dict[str, str] = {}
    problems: list[Problem] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME_RE.match(name):
            problems.append(Problem(f"{source}:{number}", f"bad line {show(raw.strip())}", "expected KEY=VALUE"))
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    if problems:
        raise UserError(problems)
    return values


def env_files(cwd: str | Path, environ: Mapping[str, str]) -> list[Path]:
    """The environment files that exist, in the order they are applied."""
    candidates: list[Path] = []
    home = environ.get("HOME")
    for folder in ([Path(home)] if home else []) + [Path(cwd)]:
        candidates.extend(folder / name for name in ENV_FILE_NAMES)
    for variable in ("DS_ENV_FILE", "DSRUN_ENV_FILE"):
        if environ.get(variable):
            candidates.append(Path(environ[variable]))
    seen: set[Path] = set()
    found = []
    for path in candidates:
        resolved = path.resolve()
        if resolved in seen or not path.is_file():
            continue
        seen.add(resolved)
        found.append(path)
    return found


def exported_environment(cwd: str | Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables every node of a job receives, sorted by name."""
    environ = os.environ if environ is None else environ
    exported = {name: value for name, value in environ.items() if name.startswith(EXPORT_PREFIXES)}
    for path in env_files(cwd, environ):
        try:
            text = path.read_text()
        except OSError as err:
            raise UserError(Problem(str(path), f"cannot read environment file: {err.strerror}")) from None
        exported.update(parse_env_file(text, str(path)))
    return dict(sorted(exported.items()))


def default_omp_threads(local_ranks: int) -> int:
    """The ``OMP_NUM_THREADS`` a rank gets when neither the user nor core binding sets it: the cores this
    process may use, divided among the node's ranks (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))
