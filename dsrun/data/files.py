"""User data: text files (tokenised and cached) and pre-tokenised ``.npy`` / ``.bin`` token files.

Text: ``path`` is a file, a directory (every non-hidden file below it) or a glob (``~/books/**/*.txt``);
files are read in sorted path order, files that look binary (a NUL byte in their first 8 KiB) are skipped,
and files are joined with a blank line. Tokens: a ``.npy`` array of integers, or a headerless ``.bin`` of
little-endian ``uint16`` (default) or ``uint32`` ids.
"""
from __future__ import annotations

import glob
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from dsrun.data.cache import cache_root, fingerprint, load_or_build
from dsrun.data.corpus import TokenCorpus, split_tokens
from dsrun.data.tokenizers import Tokenizer, get_tokenizer, token_dtype
from dsrun.utils.errors import Problem, UserError
from dsrun.utils.paths import user_path

SEPARATOR = b"\n\n"
BIN_DTYPES = ("uint16", "uint32")
_SNIFF_BYTES = 8192


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as handle:
        return b"\0" in handle.read(_SNIFF_BYTES)


def resolve_text_files(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The text files ``path`` names (file, directory or glob; or a list of them), sorted, binaries skipped."""
    entries = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    found: list[Path] = []
    for entry in entries:
        text = user_path(entry)
        if any(char in text for char in "*?["):
            candidates = [Path(p) for p in glob.glob(text, recursive=True)]
        elif Path(text).is_dir():
            candidates = [p for p in Path(text).rglob("*")
                          if not any(part.startswith(".") for part in p.relative_to(text).parts)]
        elif Path(text).is_file():
            candidates = [Path(text)]
        else:
            raise UserError(Problem("data.path", f"{text} does not exist", "give a file, a directory or a glob"))
        found.extend(p for p in candidates if p.is_file() and p.stat().st_size > 0)
    files = sorted({p.resolve() for p in found if not _looks_binary(p)})
    if not files:
        raise UserError(Problem("data.path", f"no non-empty text files match {path!r}",
                                "check the path; pre-tokenised ids belong in data=tokens"))
    return files


def tokenize_files(files: Sequence[Path], tokenizer: Tokenizer, max_bytes: int | None = None) -> np.ndarray:
    """Tokens of the files' bytes joined by a blank line, reading at most ``max_bytes`` bytes in all."""
    pieces: list[np.ndarray] = []
    separator = tokenizer.encode(SEPARATOR)
    remaining = max_bytes if max_bytes is not None else -1
    for index, file in enumerate(files):
        if remaining == 0:
            break
        with open(file, "rb") as handle:
            data = handle.read(remaining if remaining > 0 else -1)
        if max_bytes is not None:
            remaining -= len(data)
        if index:
            pieces.append(separator)
        pieces.append(tokenizer.encode(data))
    dtype = token_dtype(tokenizer.vocab_size)
    return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype=dtype)


def text_corpus(path: str | Sequence[str], seq_len: int = 128, eval_fraction: float = 0.05,
                tokenizer: str = "bytes", max_bytes: int | None = None,
                cache_dir: str | None = None) -> TokenCorpus:
    """A corpus from the user's text files (``data=text data.path=...``)."""
    files = resolve_text_files(path)
    encoder = get_tokenizer(tokenizer)
    # Keyed by every file's path, size and modification time: an edited file is tokenised afresh.
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = fingerprint("text", stats, encoder.name, max_bytes)
    tokens, from_cache = load_or_build(cache_root(cache_dir) / f"text-{key}.npy",
                                       lambda: tokenize_files(files, encoder, max_bytes))
    train, evaluation = split_tokens(tokens, eval_fraction, seq_len)
    return TokenCorpus(train, evaluation, seq_len, encoder.vocab_size, description=f"text {path}",
                       tokenizer=encoder, from_cache=from_cache, sources=[str(f) for f in files])


def load_token_file(path: str | os.PathLike[str], dtype: str = "uint16", key: str = "data.path") -> np.ndarray:
    """A memory map of the token ids in a ``.npy`` or ``.bin`` file (``dtype`` applies to ``.bin`` only);
    ``key`` is the setting that named the file, for the errors."""
    file = Path(user_path(path))
    if not file.is_file():
        raise UserError(Problem(key, f"{file} does not exist", "give a .npy or .bin token file"))
    if file.suffix == ".npy":
        tokens = _load_npy(file, key)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise UserError(Problem(key, f"{file} holds a {tokens.dtype} array of shape {tokens.shape}",
                                    "save a 1-D integer array of token ids"))
        return tokens
    if file.suffix == ".bin":
        if dtype not in BIN_DTYPES:
            raise UserError(Problem("data.dtype", f"unknown dtype {dtype!r}; allowed: " + ", ".join(BIN_DTYPES)))
        item = np.dtype(dtype).newbyteorder("<")
        if file.stat().st_size % item.itemsize:
            raise UserError(Problem(key, f"{file} is {file.stat().st_size} bytes, not a whole number "
                                    f"of {dtype} ids", "check data.dtype"))
        return np.memmap(file, dtype=item, mode="r")
    raise UserError(Problem(key, f"{file} is neither .npy nor .bin", "for text files use data=text"))


def _load_npy(file: Path, key: str) -> np.ndarray:
    """A memory map of a ``.npy`` file, or the :class:`UserError` that says why it is not a whole one."""
    def damaged(what: str) -> UserError:
        return UserError(Problem(key, f"{file} is not a whole .npy file ({what})",
                                 f"write it again with numpy.save, or point {key} at an intact copy"))

    with open(file, "rb") as handle:
        try:
            version = np.lib.format.read_magic(handle)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(handle)
        except (ValueError, OSError, SyntaxError) as err:
            raise damaged(f"its header cannot be read: {err}") from None
        start = handle.tell()
    size = file.stat().st_size
    needed = start + math.prod(shape) * dtype.itemsize
    if size < needed:
        raise damaged(f"it is truncated: its header promises {math.prod(shape):,} {dtype} values, {needed:,} bytes "
                      f"in all, and it holds {size:,}")
    try:
        return np.load(file, mmap_mode="r")
    except ValueError as err:  # e.g. an object array (pickled data), which a token file never is
        raise damaged(str(err)) from None


def token_corpus(path: str, seq_len: int = 128, dtype: str = "uint16", vocab_size: int | None = None,
                 eval_fraction: float = 0.05, eval_path: str | None = None) -> TokenCorpus:
    """A corpus of pre-tokenised ids (``data=tokens data.path=...``).

    ``vocab_size`` defaults to the largest id + 1; when given, every id must be below it. With ``eval_path``
    the eval split is that file and ``path`` is all train; otherwise the tail of ``path`` is held out.
    """
    tokens = load_token_file(path, dtype)
    if eval_path:
        train, evaluation = tokens, load_token_file(eval_path, dtype, "data.eval_path")
    else:
        train, evaluation = split_tokens(tokens, eval_fraction, seq_len)
    largest = max(int(part.max()) for part in (train, evaluation) if len(part))
    smallest = min(int(part.min()) for part in (train, evaluation) if len(part))
    if smallest < 0:
        raise UserError(Problem("data.path", f"{path} holds a negative token id ({smallest})"))
    if vocab_size is None:
        vocab_size = largest + 1
    elif largest >= vocab_size:
        raise UserError(Problem("data.vocab_size", f"{vocab_size} but {path} holds id {largest}",
                                f"set data.vocab_size to at least {largest + 1}"))
    return TokenCorpus(train, evaluation, seq_len, int(vocab_size), description=f"tokens {path}",
                       sources=[str(path)] + ([str(eval_path)] if eval_path else []))
