"""The default corpus: the Python standard library's sources and bundled docs, byte-level.

Every machine that runs dsrun has it, so the recipes train on real text with no download. The selection is
deterministic: candidate files (``.py``, ``.txt``, ``.rst`` under the stdlib folder, leaving out
``site-packages``, test suites and caches) are ordered by the SHA-1 of their relative path, which spreads
the pick across the whole library, and taken in that order until ``max_bytes`` (the last file cut short).
The tokens are cached under the cache folder, keyed by the Python version and the selection (paths and
sizes), so a second run (or a second rank) reads them back instead of re-reading ~700 files.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import platform
import sysconfig
from pathlib import Path
from typing import Sequence

from dsrun.data.cache import cache_root, fingerprint, load_or_build
from dsrun.data.corpus import TokenCorpus, split_tokens
from dsrun.data.files import tokenize_files
from dsrun.data.tokenizers import get_tokenizer

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib-dynload"}
DEFAULT_EXTENSIONS = (".py", ".txt", ".rst")


def stdlib_root() -> Path:
    """The standard library's folder, from ``sysconfig`` (or where ``os`` was imported from)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root if root.is_dir() else Path(inspect.getfile(os)).parent


def _candidates(root: Path, extensions: Sequence[str]) -> list[tuple[str, Path, int]]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith((".", "config-")))
        for name in files:
            if name.endswith(tuple(extensions)):
                path = Path(folder) / name
                size = path.stat().st_size
                if size:
                    found.append((path.relative_to(root).as_posix(), path, size))
    return sorted(found)


def select_stdlib_files(max_bytes: int | None = 4_000_000,
                        extensions: Sequence[str] = DEFAULT_EXTENSIONS) -> list[tuple[str, Path, int]]:
    """``(relative path, path, bytes to read)`` of the chosen files, in reading order."""
    ordered = sorted(_candidates(stdlib_root(), extensions),
                     key=lambda c: hashlib.sha1(c[0].encode()).hexdigest())
    chosen, total = [], 0
    for relative, path, size in ordered:
        if max_bytes is not None and total >= max_bytes:
            break
        take = size if max_bytes is None else min(size, max_bytes - total)
        chosen.append((relative, path, take))
        total += take
    return chosen


def pystdlib_corpus(seq_len: int = 128, max_bytes: int | None = 4_000_000, eval_fraction: float = 0.05,
                    tokenizer: str = "bytes", extensions: Sequence[str] = DEFAULT_EXTENSIONS,
                    cache_dir: str | None = None) -> TokenCorpus:
    """The standard-library corpus (``data=pystdlib``, the default)."""
    extensions = tuple(str(e) for e in extensions)
    selection = select_stdlib_files(max_bytes, extensions)
    encoder = get_tokenizer(tokenizer)
    version = f"{platform.python_implementation()}-{platform.python_version()}"
    key = fingerprint("pystdlib", version, str(stdlib_root()), [(r, n) for r, _, n in selection], encoder.name,
                      max_bytes)
    path = cache_root(cache_dir) / f"pystdlib-{version}-{key}.npy"
    tokens, from_cache = load_or_build(path, lambda: tokenize_files([p for _, p, _ in selection], encoder,
                                                                    max_bytes))
    train, evaluation = split_tokens(tokens, eval_fraction, seq_len)
    return TokenCorpus(train, evaluation, seq_len, encoder.vocab_size,
                       description=f"Python {platform.python_version()} standard library", tokenizer=encoder,
                       from_cache=from_cache, sources=[r for r, _, _ in selection])
