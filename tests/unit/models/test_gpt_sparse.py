"""The built-in GPT with ``model.attention: sparse``: the DeepSpeed config's ``sparse_attention`` section acts
on it, key by key, and a section the GPT would not read is refused."""
from __future__ import annotations

import random

import pytest
import torch

from dsrun.compose import compose_runspec
from dsrun.models import GPT
from dsrun.ops.sparse_attention import CausalSparseSelfAttention
from dsrun.runspec import resolve_run
from dsrun.utils.errors import ConfigError

SHAPE = dict(vocab_size=64, block_size=256, n_layer=1, n_head=2, n_embd=16)


def causal_blocks(section: dict) -> set[tuple[int, int, int]]:
    """The (head, row, column) blocks the GPT's first layer attends over for a section."""
    random.seed(0)
    attention = GPT(**SHAPE, attention="sparse", sparse_attention=section).transformer["h"][0].attn.sparse
    index = attention.block_index(SHAPE["block_size"], torch.device("cpu"), causal=True)
    return {(int(h), int(r), int(c)) for h, r, c in zip(index.head, index.row, index.col)}


# (base section, the key, another value): each change gives the GPT other blocks to attend over
KEY_CHANGES = [
    ({"mode": "fixed"}, "mode", "bslongformer"),
    ({"mode": "fixed"}, "block", 32),
    ({"mode": "bigbird", "num_random_blocks": 2}, "different_layout_per_head", True),
    ({"mode": "fixed"}, "num_local_blocks", 2),
    ({"mode": "fixed"}, "num_global_blocks", 2),
    ({"mode": "bigbird"}, "num_global_blocks", 2),
    ({"mode": "fixed"}, "horizontal_global_attention", True),
    ({"mode": "fixed", "different_layout_per_head": True}, "num_different_global_patterns", 2),
    ({"mode": "bigbird"}, "num_random_blocks", 2),
    ({"mode": "variable"}, "num_random_blocks", 2),
    ({"mode": "variable"}, "local_window_blocks", [2, 8]),
    ({"mode": "variable"}, "global_block_indices", [3]),
    ({"mode": "bslongformer"}, "global_block_indices", [0, 9]),
    ({"mode": "bslongformer", "global_block_indices": [2]}, "global_block_end_indices", [5]),
    ({"mode": "variable", "global_block_indices": [2]}, "global_block_end_indices", [5]),
    ({"mode": "bslongformer"}, "num_sliding_window_blocks", 5),
    ({"mode": "bigbird"}, "num_sliding_window_blocks", 7),
]


@pytest.mark.parametrize("base, key, value", KEY_CHANGES, ids=[f"{b['mode']}-{k}" for b, k, _ in KEY_CHANGES])
def test_each_sparse_attention_key_changes_what_the_gpt_attends_to(base, key, value):
    assert causal_blocks(base) != causal_blocks({**base, key: value})


def test_attention_direction_acts_through_horizontal_global_attention():
    """The GPT is a decoder: whatever the layout, it drops the blocks above the diagonal, so ``attention``
    matters only as the condition for horizontal global blocks, which it refuses for unidirectional."""
    horizontal = {"mode": "fixed", "horizontal_global_attention": True}
    assert causal_blocks({**horizontal, "attention": "bidirectional"}) != causal_blocks({"mode": "fixed"})
    with pytest.raises(ConfigError, match="model.sparse_attention: horizontal_global_attention needs"):
        causal_blocks({**horizontal, "attention": "unidirectional"})


def test_sparse_gpt_with_a_dense_layout_is_the_dense_gpt():
    torch.manual_seed(0)
    dense = GPT(**SHAPE).double()
    sparse = GPT(**SHAPE, attention="sparse", sparse_attention={"mode": "dense", "block": 32}).double()
    missing, unexpected = sparse.load_state_dict(dense.state_dict(), strict=False)
    assert unexpected == [] and all(name.endswith("master_layout") for name in missing)
    tokens = torch.randint(0, 64, (2, 200))  # not a multiple of the block: padded inside, cut from the output
    # float64: the two paths differ by rounding only (sums of at most 256 terms of size ~1: ~1e-13)
    assert torch.allclose(sparse(tokens), dense(tokens), rtol=0, atol=1e-11)
    assert isinstance(sparse.transformer["h"][0].attn.sparse, CausalSparseSelfAttention)


def test_model_options_are_checked():
    with pytest.raises(ConfigError, match="model.attention: unknown value 'sparce'"):
        GPT(**SHAPE, attention="sparce")
    with pytest.raises(ConfigError, match="model.sparse_attention: is set but model.attention is 'dense'"):
        GPT(**SHAPE, sparse_attention={"mode": "fixed"})
    with pytest.raises(ConfigError, match="model.sparse_attention.blok: unknown key"):
        GPT(**SHAPE, attention="sparse", sparse_attention={"blok": 16})


def test_the_attention_option_passes_ds_sparse_attention_to_the_gpt():
    cfg = compose_runspec(["attention=sparse", "ds.sparse_attention.mode=bigbird",
                           "+ds.sparse_attention.num_random_blocks=2"])
    assert cfg.model.attention == "sparse"
    assert cfg.model.sparse_attention == {"mode": "bigbird", "block": 16, "num_random_blocks": 2}
    resolve_run(cfg)  # a valid run


def test_a_section_the_gpt_would_ignore_is_refused():
    with pytest.raises(ConfigError, match="ds.sparse_attention: is set but model.attention is 'dense'"):
        resolve_run(compose_runspec(["+ds.sparse_attention.mode=fixed"]))


def test_kernel_injection_refuses_a_sparse_gpt():
    """The fused inference path computes dense attention; it must not silently replace the sparse one."""
    from dsrun.inference.fused_gpt import FusedGPT
    from dsrun.utils.errors import UserError

    with pytest.raises(UserError, match="replace_with_kernel_inject: the fused path computes dense attention"):
        FusedGPT(GPT(**SHAPE, attention="sparse", sparse_attention={"mode": "fixed"}))
