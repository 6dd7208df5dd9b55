"""Where dsrun's own YAML lives, both in a source checkout and after a regular (non-editable) install.

In the repository, ``conf/`` and ``recipes/`` sit beside the ``dsrun`` package. A wheel ships them as the
data packages ``dsrun._conf`` and ``dsrun._recipes`` (see ``pyproject.toml``).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _data_dir(package: str, repo_name: str) -> Path:
    checkout = _PACKAGE_DIR.parent / repo_name
    if (_PACKAGE_DIR.parent / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise FileNotFoundError(f"dsrun is installed without its '{repo_name}' folder; reinstall dsrun")


def conf_dir() -> Path:
    """The folder holding ``dsrun.yaml`` and the config groups."""
    return _data_dir("dsrun._conf", "conf")


def recipes_dir() -> Path:
    """The folder holding the built-in recipes."""
    return _data_dir("dsrun._recipes", "recipes")


def user_path(path: str | os.PathLike[str]) -> str:
    """``path`` with ``~`` expanded, relative to where the user launched the run even when Hydra has
    changed into the run directory."""
    from hydra.utils import to_absolute_path

    return to_absolute_path(os.path.expanduser(str(path)))
