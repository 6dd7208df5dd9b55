"""A small on-disk cache of tokenised arrays, keyed by a fingerprint of what produced them.

Writes are atomic (a private temporary file, then ``os.replace``), so several ranks building the same corpus
at once never see a half-written file: the last writer wins with identical content.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

CACHE_ENV = "DSRUN_CACHE_DIR"


def cache_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``explicit``, else ``$DSRUN_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsrun``, else ``~/.cache/dsrun``;
    tokenised corpora live in its ``data/`` folder."""
    if explicit:
        root = Path(explicit).expanduser()
    elif os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsrun"
    return root / "data"


def fingerprint(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts (file lists, sizes, options, versions; any other object
    by its ``str``)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_or_build(path: Path, build: Callable[[], np.ndarray]) -> tuple[np.ndarray, bool]:
    """The array cached at ``path`` (memory-mapped), or ``build()`` saved there first.

    Returns ``(array, from_cache)``. An unreadable cache file is rebuilt rather than trusted.
    """
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r"), True
        except (OSError, ValueError):
            pass
    array = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
        np.save(temporary, array)
        os.replace(temporary, path)
    except OSError as error:
        # A read-only or full cache folder must not stop training; the corpus is simply rebuilt next time.
        warnings.warn(f"dsrun: could not cache tokens at {path}: {error}", stacklevel=2)
    return array, False
