"""The opt-in ``deepspeed`` alias: make ``import deepspeed`` load dsrun without editing a script.

Three ways to switch it on, all refusing to shadow a real DeepSpeed:

- ``dsrun launch --as-deepspeed train.py`` puts :func:`site_dir` first on every rank's ``PYTHONPATH``;
- ``import dsrun.alias; dsrun.alias.install()`` does the same in the running interpreter (before the first
  ``import deepspeed``, e.g. at the top of a notebook that then uses Hugging Face's Trainer);
- ``python -m dsrun.alias script.py ARGS`` runs one script with the alias installed.

:func:`site_dir` holds a ``deepspeed`` package (a shim that forwards every name to dsrun) and a
``deepspeed.dist-info`` whose version, :data:`DEEPSPEED_API_VERSION`, is the DeepSpeed release whose API
dsrun implements, so version gates such as Hugging Face's ``is_deepspeed_available()`` pass.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from pathlib import Path

from dsrun.alias.finder import activate
from dsrun.utils.errors import Problem, UserError


def site_dir() -> Path:
    """The folder to put on the import path for ``import deepspeed`` to load dsrun."""
    return Path(__file__).resolve().parent / "site"


def _read_version() -> str:
    for line in (site_dir() / "deepspeed.dist-info" / "METADATA").read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise RuntimeError("dsrun/alias/site/deepspeed.dist-info/METADATA has no Version line")


DEEPSPEED_API_VERSION: str = _read_version()


def real_deepspeed(search_path: list[str] | None = None) -> str | None:
    """Where a real (non-alias) ``deepspeed`` package lies on ``search_path`` (default ``sys.path``), or None."""
    ours = str(site_dir())
    paths = [p for p in (sys.path if search_path is None else search_path)
             if os.path.realpath(p or ".") != os.path.realpath(ours)]
    spec = importlib.machinery.PathFinder.find_spec("deepspeed", paths)
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "?"


def _refusal(found: str) -> Problem:
    return Problem("deepspeed alias", f"a real DeepSpeed is installed ({found}); the alias would shadow it",
                   "uninstall it (pip uninstall deepspeed) or use another environment, or import dsrun directly")


def activate_in_shim(shim_path: list[str]) -> str:
    """Called by the shim package on ``import deepspeed``: refuse to shadow, start the finder, give the version."""
    shim_dirs = {os.path.realpath(os.path.dirname(p)) for p in shim_path}
    found = real_deepspeed([p for p in sys.path if os.path.realpath(p or ".") not in shim_dirs])
    if found is not None:
        raise ImportError(str(_refusal(found)))
    activate()
    return DEEPSPEED_API_VERSION


def install() -> None:
    """Make ``import deepspeed`` load dsrun in this interpreter; UserError if a real DeepSpeed is installed.

    Call it before anything imports ``deepspeed``.
    """
    found = real_deepspeed()
    if found is not None:
        raise UserError(_refusal(found))
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and getattr(loaded, "__version__", None) != DEEPSPEED_API_VERSION:
        raise UserError(Problem("deepspeed alias", "another 'deepspeed' module is already imported",
                                "install the alias before the first import of deepspeed"))
    ours = str(site_dir())
    if ours not in sys.path:
        sys.path.insert(0, ours)
    importlib.invalidate_caches()  # importlib.metadata and find_spec must see the new path entry
    activate()


def environment_with_alias(environ: dict[str, str]) -> dict[str, str]:
    """A copy of ``environ`` whose PYTHONPATH starts with :func:`site_dir` (for child processes)."""
    found = real_deepspeed()
    if found is not None:
        raise UserError(_refusal(found))
    env = dict(environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(site_dir())] + [p for p in parts if p != str(site_dir())])
    return env
