"""``deepspeed.runtime.hybrid_engine_graph``: which generations replay decode graphs, and the eager fallback a CPU
(where no graph can be captured) takes. The CUDA capture and replay themselves need a GPU."""
from __future__ import annotations

import torch

from dsrun.accelerator import get_accelerator
from dsrun.alias.paths import target_of
from dsrun.inference.decode_graphs import (DecodeGraphCache, decode_steps_from_generate_kwargs,
                                           validate_cuda_graph_support)


class _Config:
    release_inference_cache, inference_tp_size = False, 1


def test_only_a_pinned_length_decodes_from_graphs():
    assert decode_steps_from_generate_kwargs({"max_new_tokens": 32, "min_new_tokens": 32}) == 31
    for kwargs in ({"max_new_tokens": 32}, {"max_new_tokens": 32, "min_new_tokens": 8}, {"max_length": 64}, {}):
        assert decode_steps_from_generate_kwargs(kwargs) is None
    if get_accelerator().name == "cpu":
        assert validate_cuda_graph_support(_Config(), zero_stage=2) == "CUDA graphs require the CUDA accelerator"
    assert target_of("deepspeed.runtime.hybrid_engine_graph") == "dsrun.inference.decode_graphs"


def test_decode_steps_fall_back_to_eager_for_good_when_no_graph_can_be_captured():
    calls = []

    def forward(**kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return kwargs["input_ids"] * 2

    cache = DecodeGraphCache(forward, max_positions=4)
    step = {"input_ids": torch.ones(2, 1, dtype=torch.long)}
    cache.begin_sequence(8)  # longer than max_positions: eager
    assert cache._use_graphs is False and torch.equal(cache(**step), step["input_ids"] * 2)
    cache.begin_sequence(3)
    assert cache._use_graphs
    assert torch.equal(cache(input_ids=torch.ones(2, 5, dtype=torch.long)), torch.full((2, 5), 2))  # the prompt
    if get_accelerator().name == "cpu":  # capture fails: this and every later sequence run eagerly
        assert torch.equal(cache(**step), step["input_ids"] * 2) and cache.captured_positions == 0
        cache.begin_sequence(3)
        assert cache._use_graphs is False and torch.equal(cache(**step), step["input_ids"] * 2)
        assert calls == [1, 5, 1, 1]
