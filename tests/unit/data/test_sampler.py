"""Deterministic, per-rank, resumable batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsrun.data import EvalLoader, ResumableSampler, TokenCorpus, TokenWindows, split_tokens
from dsrun.utils.errors import UserError

SEQ = 8


def _corpus(tokens: int = 4001, eval_fraction: float = 0.1) -> TokenCorpus:
    ids = (np.arange(tokens) * 7919 % 251).astype(np.uint16)
    train, evaluation = split_tokens(ids, eval_fraction, SEQ)
    return TokenCorpus(train, evaluation, SEQ, 256, description="synthetic")


def _take(loader, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(steps)]


def test_windows_are_next_token_pairs():
    dataset = TokenWindows(np.arange(100, dtype=np.uint16), SEQ)
    assert len(dataset) == 99 // SEQ
    inputs, targets = dataset[2]
    assert inputs.dtype == torch.int64 and inputs.tolist() == list(range(16, 24))
    assert targets.tolist() == list(range(17, 25))
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_same_seed_gives_the_same_batches_across_constructions():
    first = _take(_corpus().train_loader(4, rank=1, world_size=2, seed=7), 30)
    second = _take(_corpus().train_loader(4, rank=1, world_size=2, seed=7), 30)
    for (a_in, a_tg), (b_in, b_tg) in zip(first, second):
        assert torch.equal(a_in, b_in) and torch.equal(a_tg, b_tg)
    other_seed = _take(_corpus().train_loader(4, rank=1, world_size=2, seed=8), 30)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other_seed))


def test_ranks_take_disjoint_samples_and_together_cover_an_epoch():
    corpus = _corpus()
    world, batch = 3, 5
    samplers = [ResumableSampler(len(corpus.train), batch, rank, world, seed=3) for rank in range(world)]
    steps = len(corpus.train) // (world * batch)
    seen: list[int] = []
    for _ in range(steps):
        per_rank = [s.next_indices() for s in samplers]
        flat = [i for indices in per_rank for i in indices]
        assert len(set(flat)) == len(flat)  # no sample on two ranks in one step
        seen.extend(flat)
    assert len(set(seen)) == len(seen)  # and none twice within the epoch
    assert len(seen) == steps * world * batch


def test_resume_continues_at_the_exact_position():
    corpus = _corpus()
    reference = _take(corpus.train_loader(4, rank=0, world_size=2, seed=11), 400)  # crosses epochs
    interrupted = corpus.train_loader(4, rank=0, world_size=2, seed=11)
    _take(interrupted, 123)
    state = interrupted.state_dict()
    resumed = corpus.train_loader(4, rank=0, world_size=2, seed=11)
    resumed.load_state_dict(state)
    assert resumed.step == 123
    for expected, got in zip(reference[123:], _take(resumed, 400 - 123)):
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert torch.equal(resumed.batch_at(5)[0], reference[5][0])


def test_resume_with_another_world_size_continues_the_global_order():
    corpus = _corpus()
    two_ranks = [corpus.train_loader(4, rank=r, world_size=2, seed=5) for r in range(2)]
    for _ in range(10):
        for loader in two_ranks:
            next(loader)
    one_rank = corpus.train_loader(8, rank=0, world_size=1, seed=5)
    one_rank.load_state_dict(two_ranks[0].state_dict())
    # the next global batch of 8 is what the two ranks would have taken together
    together = torch.cat([next(two_ranks[0])[0], next(two_ranks[1])[0]])
    assert torch.equal(next(one_rank)[0], together)


def test_resume_with_a_different_seed_is_refused():
    corpus = _corpus()
    state = corpus.train_loader(4, seed=1).state_dict()
    with pytest.raises(UserError, match="seed"):
        corpus.train_loader(4, seed=2).load_state_dict(state)


def test_eval_split_is_disjoint_from_train_and_fixed():
    tokens = np.arange(5000, dtype=np.uint32)  # each id marks its own position
    train, evaluation = split_tokens(tokens, 0.1, SEQ)
    corpus = TokenCorpus(train, evaluation, SEQ, 5000, description="positions")
    train_positions = {int(t) for batch in _take(corpus.train_loader(16, seed=0), 40) for t in batch[1].flatten()}
    train_positions |= {int(t) for batch in _take(corpus.train_loader(16, seed=0), 40) for t in batch[0].flatten()}
    eval_positions = {int(t) for inputs, targets in corpus.eval_loader(4) for t in torch.cat([inputs, targets]).flatten()}
    assert eval_positions and not train_positions & eval_positions
    assert len(evaluation) == 500 and len(train) == 4500
    first = [b[0] for b in corpus.eval_loader(4, rank=1, world_size=2, max_batches=3)]
    second = [b[0] for b in corpus.eval_loader(4, rank=1, world_size=2, max_batches=3)]
    assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, second))


def test_eval_ranks_get_equal_disjoint_batches():
    corpus = _corpus()
    loaders = [EvalLoader(corpus.eval, 2, rank, 3) for rank in range(3)]
    assert len({len(loader) for loader in loaders}) == 1
    indices = [i for loader in loaders for step in range(len(loader)) for i in loader.indices_at(step)]
    assert len(indices) == len(set(indices))


def test_too_small_eval_split_is_a_user_error():
    corpus = _corpus(tokens=400, eval_fraction=0.05)
    with pytest.raises(UserError, match="eval_fraction"):
        corpus.eval_loader(64)
