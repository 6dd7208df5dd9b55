"""Every sparsity layout equals DeepSpeed's documented construction on hand-checked fixtures.

Each fixture is small enough to derive by hand from the construction (the comments do); the same cases were
also checked against DeepSpeed's own ``sparsity_config.py`` (18,336 configurations, identical except where
DeepSpeed raises: BigBird unidirectional with more random blocks than a row has earlier columns).
"""
from __future__ import annotations

import random

import pytest
import torch

from dsrun.config.misc import SPARSE_MODE_KEYS, SparseAttentionConfig
from dsrun.ops.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                        FixedSparsityConfig, LocalSlidingWindowSparsityConfig, SparsityConfig,
                                        VariableSparsityConfig, sparsity_config_from_dict)
from dsrun.ops.sparse_attention.from_config import MODE_CLASSES, MODE_KEYS, SECTION_DEFAULTS
from dsrun.utils.errors import ConfigError


def grid(*heads: str) -> torch.Tensor:
    """A layout from rows of 0/1 characters, one string (rows separated by spaces) per head."""
    return torch.tensor([[[int(c) for c in row] for row in head.split()] for head in heads], dtype=torch.int64)


CASES = {
    # windows [0-3] [4-7] [8-9]; the last block of each full window (3, 7) is global, and the short last
    # window's at the same offset, moved left to fit: min(8 + 3, 10 - 1) = 9. Bidirectional: whole columns.
    "fixed bidirectional": (lambda: FixedSparsityConfig(1, block=4), 40, None, grid(
        "1111000101 1111000101 1111000101 1111000101 0001111101 0001111101 0001111101 0001111101 "
        "0001000111 0001000111")),
    # unidirectional: lower-triangular windows, global columns from their own row down
    "fixed unidirectional": (lambda: FixedSparsityConfig(1, block=4, attention="unidirectional"), 40, None, grid(
        "1000000000 1100000000 1110000000 1111000000 0001100000 0001110000 0001111000 0001111100 "
        "0001000110 0001000111")),
    # 3-block windows; head h uses the (h % 3 + 1)-th block from each window's end: head 0 -> 2, 5 (+6 for
    # the short window), head 1 -> 1, 4 (+6); horizontal: the global rows attend everywhere
    "fixed per head, horizontal": (lambda: FixedSparsityConfig(
        2, block=4, different_layout_per_head=True, num_local_blocks=3, horizontal_global_attention=True,
        num_different_global_patterns=3), 28, None, grid(
        "1110011 1110011 1111111 0011111 0011111 1111111 1111111",
        "1110101 1111111 1110101 0101111 1111111 0101111 1111111")),
    # random block per row (seed 0; may be in the future, as in DeepSpeed), windows of 1, 2, 3, then 3 again
    # (3-5, 6-7), global ranges [0,1) and [5,7) as columns from their first row down (unidirectional)
    "variable": (lambda: VariableSparsityConfig(
        1, block=4, num_random_blocks=1, local_window_blocks=[1, 2, 3], global_block_indices=[0, 5],
        global_block_end_indices=[1, 7], attention="unidirectional"), 32, 0, grid(
        "10000010 11000010 11100000 10011000 10011001 10011110 10001110 10000111")),
    # random 1 per row (seed 0), sliding window of 3, block 0 global both ways
    "bigbird": (lambda: BigBirdSparsityConfig(1, block=4, num_random_blocks=1), 32, 0, grid(
        "11111111 11100010 11110000 10111000 10011101 10001110 10001111 10000011")),
    # two global blocks, random blocks from earlier columns only, then the lower triangle of everything
    "bigbird unidirectional": (lambda: BigBirdSparsityConfig(
        1, block=4, num_random_blocks=1, num_global_blocks=2, attention="unidirectional"), 32, 0, grid(
        "10000000 11000000 11100000 11110000 11011000 11011100 11010110 11001011")),
    # sliding window of 3; blocks 0 and 5 global both ways
    "bslongformer": (lambda: BSLongformerSparsityConfig(1, block=4, global_block_indices=[0, 5]), 32, None, grid(
        "11111111 11100100 11110100 10111100 10011100 11111111 10000111 10000111")),
    # window of 5, unidirectional: the two previous blocks and the diagonal
    "local sliding window": (lambda: LocalSlidingWindowSparsityConfig(1, block=4, num_sliding_window_blocks=5), 28,
                             None, grid("1000000 1100000 1110000 0111000 0011100 0001110 0000111")),
    "local sliding window bidirectional": (lambda: LocalSlidingWindowSparsityConfig(
        1, block=4, attention="bidirectional"), 24, None, grid("110000 111000 011100 001110 000111 000011")),
    "dense": (lambda: DenseSparsityConfig(2, block=8), 24, None, torch.ones(2, 3, 3, dtype=torch.int64)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_the_documented_construction(name):
    make, seq_len, seed, expected = CASES[name]
    if seed is not None:
        random.seed(seed)
    layout = make().make_layout(seq_len)
    assert layout.dtype == torch.int64 and layout.shape == expected.shape
    assert torch.equal(layout, expected)


def test_one_layout_is_copied_to_every_head_unless_each_has_its_own():
    random.seed(1)
    shared = BigBirdSparsityConfig(4, block=4, num_random_blocks=2).make_layout(64)
    assert all(torch.equal(shared[h], shared[0]) for h in range(4))
    random.seed(1)
    own = BigBirdSparsityConfig(4, block=4, num_random_blocks=2, different_layout_per_head=True).make_layout(64)
    assert torch.equal(own[0], shared[0]) and not all(torch.equal(own[h], own[0]) for h in range(4))


@pytest.mark.parametrize("make, message", [
    (lambda: FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3), "multiple of num_global_blocks"),
    (lambda: FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True), "bidirectional"),
    (lambda: FixedSparsityConfig(2, num_different_global_patterns=2), "different_layout_per_head"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_different_global_patterns=5), "exceed"),
    (lambda: VariableSparsityConfig(2, global_block_indices=[0, 4], global_block_end_indices=[2]), "same length"),
    (lambda: BSLongformerSparsityConfig(2, global_block_indices=[4], global_block_end_indices=[4]), "smaller"),
    (lambda: BigBirdSparsityConfig(2, block=16).make_layout(48 + 1), "multiple of the block size"),
    (lambda: BigBirdSparsityConfig(2, block=16, num_random_blocks=4).make_layout(48), "num_random_blocks=4"),
    (lambda: BSLongformerSparsityConfig(2, block=16, num_sliding_window_blocks=5).make_layout(48), "sliding"),
])
def test_invalid_settings_are_refused_as_deepspeed_does(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_an_unknown_attention_type_is_not_implemented():
    with pytest.raises(NotImplementedError):
        BigBirdSparsityConfig(2, attention="sideways")


def test_the_base_class_asks_for_make_layout():
    with pytest.raises(NotImplementedError, match="make_layout"):
        SparsityConfig(num_heads=2).make_layout(32)


# --- the DeepSpeed config section -> a layout class ------------------------------------------------------------
def test_section_defaults_and_mode_keys_agree_with_the_config_schema():
    assert SparseAttentionConfig().model_dump() == SECTION_DEFAULTS
    assert {mode: frozenset(keys) for mode, keys in MODE_KEYS.items()} == SPARSE_MODE_KEYS
    assert set(MODE_CLASSES) == set(SPARSE_MODE_KEYS)


@pytest.mark.parametrize("mode", list(MODE_KEYS))
def test_each_mode_passes_exactly_its_keys_with_the_section_defaults(mode):
    built = sparsity_config_from_dict({"mode": mode}, num_heads=3)
    assert type(built) is MODE_CLASSES[mode] and built.num_heads == 3 and built.block == 16
    for key in MODE_KEYS[mode]:
        assert getattr(built, key) == SECTION_DEFAULTS[key], key
    if mode == "bigbird":  # the section's default, not the class's (1)
        assert built.num_random_blocks == 0


def test_a_bad_section_names_the_key():
    with pytest.raises(ConfigError, match=r"ds\.sparse_attention\.num_local_block: unknown key.*num_local_blocks"):
        sparsity_config_from_dict({"num_local_block": 2}, 4, path="ds.sparse_attention")
    with pytest.raises(ConfigError, match=r"sparse_attention\.mode: got 'bigbirb'.*bigbird"):
        sparsity_config_from_dict({"mode": "bigbirb"}, 4)
    with pytest.raises(ConfigError, match="sparse_attention: num_local_blocks"):
        sparsity_config_from_dict({"num_local_blocks": 3, "num_global_blocks": 2}, 4)
