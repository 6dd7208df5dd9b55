"""Turning text into token ids: bytes by default, ``tiktoken`` or ``tokenizers`` when installed.

A tokenizer is chosen by a short spec string (the ``data.tokenizer`` key):

- ``bytes`` (default): one token per byte, vocabulary 256, no dependency, lossless for any file.
- ``tiktoken:NAME``: a tiktoken encoding such as ``tiktoken:gpt2`` (needs ``pip install tiktoken`` and the
  encoding's files, which tiktoken downloads once or reads from ``TIKTOKEN_CACHE_DIR``).
- ``tokenizers:PATH``: a Hugging Face ``tokenizer.json`` file (needs ``pip install tokenizers``).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from dsrun.utils.errors import Problem, UserError
from dsrun.utils.paths import user_path
from dsrun.utils.suggest import did_you_mean

KINDS = ("bytes", "tiktoken", "tokenizers")


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ByteTokenizer:
    """Each byte is a token (0-255): any file round-trips exactly and no vocabulary needs training."""

    name = "bytes"
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    def __init__(self, encoding: str):
        tiktoken = _require("tiktoken", f"tiktoken:{encoding}")
        self.name = f"tiktoken:{encoding}"
        try:
            self._encoding = tiktoken.get_encoding(encoding)
        except Exception as error:  # unknown name, or the encoding file cannot be fetched offline
            raise UserError(Problem("data.tokenizer", f"tiktoken cannot load encoding '{encoding}': {error}",
                                    "check the name (e.g. gpt2, cl100k_base) or set TIKTOKEN_CACHE_DIR")) from error
        self.vocab_size = int(self._encoding.n_vocab)

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._encoding.encode_ordinary(data.decode("utf-8", errors="replace"))
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])


class HFTokenizer:
    def __init__(self, path: str):
        tokenizers = _require("tokenizers", f"tokenizers:{path}")
        file = Path(user_path(path))
        if not file.is_file():
            raise UserError(Problem("data.tokenizer", f"no tokenizer file at {file}",
                                    "give the path of a tokenizer.json"))
        self.name = f"tokenizers:{file.resolve()}"
        self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        self.vocab_size = int(self._tokenizer.get_vocab_size())

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def _require(package: str, spec: str):
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise UserError(Problem("data.tokenizer", f"'{spec}' needs the {package} package, which is not installed",
                                f"pip install {package}, or use tokenizer=bytes")) from error


def get_tokenizer(spec: str = "bytes") -> Tokenizer:
    """The tokenizer named by ``spec`` (see the module docstring)."""
    kind, _, argument = str(spec).partition(":")
    if kind == "bytes" and not argument:
        return ByteTokenizer()
    if kind == "tiktoken" and argument:
        return TiktokenTokenizer(argument)
    if kind == "tokenizers" and argument:
        return HFTokenizer(argument)
    hint = did_you_mean(kind, KINDS) or "e.g. bytes, tiktoken:gpt2, tokenizers:/path/tokenizer.json"
    raise UserError(Problem("data.tokenizer", f"unknown tokenizer {spec!r}; allowed: bytes, tiktoken:NAME, "
                            "tokenizers:PATH", hint))
