"""Where tokens come from: the standard library corpus, text files, token files, tokenizers, the cache."""
from __future__ import annotations

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dsrun.data import (get_tokenizer, load_token_file, pystdlib_corpus, select_stdlib_files, text_corpus,
                        token_corpus)
from dsrun.utils.errors import UserError
from dsrun.utils.paths import conf_dir


def test_stdlib_selection_is_deterministic_capped_and_real_python():
    first = select_stdlib_files(max_bytes=300_000)
    assert first == select_stdlib_files(max_bytes=300_000)
    assert sum(n for _, _, n in first) == 300_000
    relative = [r for r, _, _ in first]
    assert not any(part in ("site-packages", "test", "__pycache__") for r in relative for part in r.split("/"))
    assert any(r.endswith(".py") for r in relative)


def test_stdlib_corpus_is_cached_and_reused(tmp_path, monkeypatch):
    corpus = pystdlib_corpus(seq_len=64, max_bytes=200_000, cache_dir=str(tmp_path))
    assert not corpus.from_cache and corpus.vocab_size == 256
    assert len(corpus.train_tokens) + len(corpus.eval_tokens) > 200_000  # plus the blank lines between files
    assert b"def " in bytes(np.asarray(corpus.train_tokens[:50_000], dtype=np.uint8))
    cached = list((tmp_path / "data").glob("pystdlib-*.npy"))
    assert len(cached) == 1

    def no_reading(*args, **kwargs):
        raise AssertionError("the cached corpus must not re-read the files")

    monkeypatch.setattr("dsrun.data.pystdlib.tokenize_files", no_reading)
    again = pystdlib_corpus(seq_len=64, max_bytes=200_000, cache_dir=str(tmp_path))
    assert again.from_cache
    assert np.array_equal(again.train_tokens, corpus.train_tokens)
    assert np.array_equal(again.eval_tokens, corpus.eval_tokens)
    # a different selection is a different cache entry
    monkeypatch.undo()
    assert not pystdlib_corpus(seq_len=64, max_bytes=150_000, cache_dir=str(tmp_path)).from_cache


def test_default_data_config_instantiates_with_the_model_context(tmp_path):
    data = OmegaConf.load(conf_dir() / "data" / "pystdlib.yaml")
    assert (conf_dir() / "data" / "pystdlib.yaml").read_text().startswith("# @package data\n")
    root = OmegaConf.create({"model": {"block_size": 32}, "data": data})
    root.data.max_bytes = 50_000
    root.data.cache_dir = str(tmp_path)
    corpus = instantiate(root.data)
    assert corpus.seq_len == 32
    inputs, targets = next(corpus.train_loader(2))
    assert inputs.shape == targets.shape == (2, 32)
    corpus.check_vocab(256)
    with pytest.raises(UserError, match="model.vocab_size"):
        corpus.check_vocab(128)


def test_text_files_from_file_directory_and_glob(tmp_path):
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha " * 400)
    (folder / "sub" / "b.txt").write_text("beta " * 400)
    (folder / "image.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    (folder / ".hidden.txt").write_text("secret")  # hidden: skipped
    cache = str(tmp_path / "cache")
    from_dir = text_corpus(str(folder), seq_len=16, cache_dir=cache)
    assert [p.rsplit("/", 1)[-1] for p in from_dir.sources] == ["a.txt", "b.txt"]
    text = from_dir.decode(np.concatenate([from_dir.train_tokens, from_dir.eval_tokens]))
    assert text == "alpha " * 400 + "\n\n" + "beta " * 400
    from_glob = text_corpus(str(folder / "**" / "*.txt"), seq_len=16, cache_dir=cache)
    assert from_glob.sources == from_dir.sources and from_glob.from_cache
    single = text_corpus(str(folder / "a.txt"), seq_len=16, cache_dir=cache, max_bytes=1000)
    assert len(single.train_tokens) + len(single.eval_tokens) == 1000
    with pytest.raises(UserError, match="data.path"):
        text_corpus(str(tmp_path / "missing.txt"), cache_dir=cache)


def test_text_cache_notices_edited_files(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("one two three " * 100)
    cache = str(tmp_path / "cache")
    assert not text_corpus(str(file), seq_len=8, cache_dir=cache).from_cache
    assert text_corpus(str(file), seq_len=8, cache_dir=cache).from_cache
    file.write_text("four five six seven " * 100)
    changed = text_corpus(str(file), seq_len=8, cache_dir=cache)
    assert not changed.from_cache and changed.decode(changed.train_tokens[:4]) == "four"


def test_npy_and_bin_token_files(tmp_path):
    ids = (np.arange(20_000) % 1000).astype(np.uint16)
    np.save(tmp_path / "train.npy", ids)
    ids.astype("<u4").tofile(tmp_path / "train32.bin")
    ids.tofile(tmp_path / "train16.bin")
    from_npy = token_corpus(str(tmp_path / "train.npy"), seq_len=32)
    from_bin32 = token_corpus(str(tmp_path / "train32.bin"), seq_len=32, dtype="uint32")
    from_bin16 = token_corpus(str(tmp_path / "train16.bin"), seq_len=32)
    for corpus in (from_npy, from_bin32, from_bin16):
        assert corpus.vocab_size == 1000
        assert np.array_equal(np.concatenate([corpus.train_tokens, corpus.eval_tokens]), ids)
        inputs, targets = next(corpus.train_loader(4))
        assert inputs.shape == (4, 32) and targets.max() < 1000
    separate = token_corpus(str(tmp_path / "train.npy"), seq_len=32, eval_path=str(tmp_path / "train16.bin"),
                            vocab_size=4096)
    assert len(separate.train_tokens) == len(separate.eval_tokens) == 20_000 and separate.vocab_size == 4096


def test_token_file_mistakes_are_user_errors(tmp_path):
    np.save(tmp_path / "floats.npy", np.zeros(100, dtype=np.float32))
    (tmp_path / "odd.bin").write_bytes(b"\0" * 5)
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.int32))
    with pytest.raises(UserError, match="1-D integer"):
        load_token_file(tmp_path / "floats.npy")
    with pytest.raises(UserError, match="whole number"):
        load_token_file(tmp_path / "odd.bin")
    with pytest.raises(UserError, match="data.dtype"):
        load_token_file(tmp_path / "odd.bin", dtype="float16")
    with pytest.raises(UserError, match="data.vocab_size"):
        token_corpus(str(tmp_path / "ids.npy"), seq_len=8, vocab_size=500)


def test_a_truncated_or_damaged_npy_token_file_is_a_user_error_naming_its_key(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.int64))
    whole = (tmp_path / "ids.npy").read_bytes()  # a 128-byte header, then 8,000 bytes of ids
    (tmp_path / "half.npy").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "header.npy").write_bytes(whole[:60])
    with pytest.raises(UserError, match=r"data.path: .*half.npy is not a whole .npy file \(it is truncated: its "
                                        r"header promises 1,000 int64 values, 8,128 bytes in all, and it holds 4,064\)"):
        load_token_file(tmp_path / "half.npy")
    with pytest.raises(UserError, match=r"data.path: .*header.npy is not a whole .npy file \(its header cannot be read"):
        load_token_file(tmp_path / "header.npy")
    with pytest.raises(UserError, match=r"data.eval_path: .*half.npy is not a whole .npy file"):
        token_corpus(str(tmp_path / "ids.npy"), seq_len=8, eval_path=str(tmp_path / "half.npy"))


def test_tokenizers_bytes_round_trip_and_optional_ones_explain_themselves(monkeypatch):
    byte_level = get_tokenizer("bytes")
    text = "héllo, wörld"
    assert byte_level.decode(byte_level.encode(text.encode())) == text
    with pytest.raises(UserError, match="did you mean 'tiktoken'"):
        get_tokenizer("tiktokn:gpt2")

    def missing(name):
        raise ImportError(f"No module named '{name}'")

    monkeypatch.setattr("dsrun.data.tokenizers.importlib.import_module", missing)
    with pytest.raises(UserError, match="pip install tiktoken"):
        get_tokenizer("tiktoken:gpt2")
    with pytest.raises(UserError, match="pip install tokenizers"):
        get_tokenizer("tokenizers:tokenizer.json")


def test_relative_paths_are_taken_from_the_launch_directory(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("relative paths work " * 50)
    monkeypatch.chdir(tmp_path)
    corpus = text_corpus("notes.txt", seq_len=8, cache_dir=str(tmp_path / "cache"))
    assert corpus.sources == [str(tmp_path / "notes.txt")]
