"""Datasets for the recipes: token corpora split into train/eval, with deterministic resumable loaders.

Sources (each a ``_target_`` in ``conf/data/``): :func:`pystdlib_corpus` (the default: the Python standard
library, byte-level, no download), :func:`text_corpus` (your text files) and :func:`token_corpus`
(pre-tokenised ``.npy`` / ``.bin``). Each returns a :class:`TokenCorpus`; ask it for
``train_loader(batch_size, rank, world_size, seed)`` and ``eval_loader(...)``.
"""
from __future__ import annotations

from dsrun.data.corpus import TokenCorpus, split_tokens
from dsrun.data.dataset import TokenWindows
from dsrun.data.files import load_token_file, text_corpus, token_corpus
from dsrun.data.pystdlib import pystdlib_corpus, select_stdlib_files
from dsrun.data.sampler import EvalLoader, ResumableSampler, TrainLoader
from dsrun.data.tokenizers import get_tokenizer

__all__ = ["EvalLoader", "ResumableSampler", "TokenCorpus", "TokenWindows", "TrainLoader", "get_tokenizer",
           "load_token_file", "pystdlib_corpus", "select_stdlib_files", "split_tokens", "text_corpus",
           "token_corpus"]
