"""Two real rank processes building the default corpus into one fresh cache at the same time."""
from __future__ import annotations

from tests.helpers import run_ranks


def _build_and_take(rank: int, world_size: int, cache_dir: str) -> dict:
    from dsrun.data import pystdlib_corpus

    corpus = pystdlib_corpus(seq_len=32, max_bytes=120_000, cache_dir=cache_dir)
    loader = corpus.train_loader(4, rank=rank, world_size=world_size, seed=3)
    indices = [loader.sampler.next_indices() for _ in range(5)]
    return {"tokens": corpus.train_tokens.tobytes(), "indices": indices}


def test_concurrent_ranks_share_one_corpus_and_take_disjoint_batches(tmp_path):
    rank0, rank1 = run_ranks(_build_and_take, 2, str(tmp_path), timeout=120)
    assert rank0["tokens"] == rank1["tokens"]  # the same corpus whichever rank wrote the cache
    assert len(list((tmp_path / "data").glob("*.npy"))) == 1  # and no temporary files left behind
    assert not list((tmp_path / "data").glob(".*"))
    for step in range(5):
        assert not set(rank0["indices"][step]) & set(rank1["indices"][step])
