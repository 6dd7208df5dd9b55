"""DeepSpeed-Chat's hybrid engine on 2 gloo ranks at ZeRO-3 (``hybrid_engine.*``, docs/hybrid_engine.md).

With ``hybrid_engine.enabled`` ``initialize`` returns a ``DeepSpeedHybridEngine``. One launch runs DeepSpeed-Chat's
loop (generate, train on the answers, generate again) for Hugging Face GPT-2 and Llama built from small configs,
four ways: ``pin_parameters`` (every parameter gathered once per generate), ``inference_tp_size: 2`` with ``tp_gather_partition_size: 1`` and ``release_inference_cache``, Llama's grouped-query
attention split over 2 ranks, and ``pin_parameters: false`` (each layer gathered by its hooks at every forward).
Each rank generates its own prompts; the tokens must equal the whole model's greedy ``generate`` at the same
weights, and the training losses a plain ZeRO-3 engine's on the same sequences (bit for bit: the generation
leaves the shards alone). The all-gathers are counted by the comms logger.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import run_ranks
from tests.integration._hybrid_engine_ranks import NEW_TOKENS, cases

pytest.importorskip("transformers")

RUNS = {
    "pinned": ("gpt2", {"max_out_tokens": 16}),
    "split": ("gpt2", {"inference_tp_size": 2, "tp_gather_partition_size": 1, "release_inference_cache": True}),
    "llama_split": ("llama", {"inference_tp_size": 2, "max_out_tokens": 16}),
    "unpinned": ("gpt2", {"pin_parameters": False, "max_out_tokens": 16}),
}
TP_PROMPT_GATHER = 1  # the all-gather of the group's prompts before a tensor-parallel generate


@pytest.fixture(scope="module")
def results():
    return run_ranks(cases, 2, RUNS, timeout=400)


def _each(results, case):
    return [rank[case] for rank in results]


def _same_tokens(entry):
    for generated, whole in zip(entry["generated"], entry["whole"]):
        assert torch.equal(generated, whole), (generated, whole)


def _workspace_bytes(entry, max_out, tp=1, batch=2):
    shape = entry["shape"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    # keys and values of every layer: (batch of the group, kv heads of this rank, max_out_tokens, head_dim), fp32
    return entry["layers"] * 2 * batch * tp * shape["num_key_value_heads"] // tp * max_out * head_dim * 4


def test_generate_at_zero3_matches_the_whole_model_and_gathers_each_parameter_once(results):
    for entry in _each(results, "pinned"):
        assert entry["engine"] == "DeepSpeedHybridEngine"
        _same_tokens(entry)
        assert entry["gathers"] == [entry["parameters"]] * len(entry["gathers"])  # one pass, every parameter once
        assert entry["groups"][0] == [entry["layers"]]


def test_training_between_generations_equals_a_plain_zero3_engine(results):
    for case in RUNS:
        for entry in _each(results, case):
            assert entry["losses"] == entry["plain_losses"], case


def test_inference_tp_splits_the_blocks_and_generates_the_same_tokens(results):
    for case, groups in (("split", [1, 1]), ("llama_split", [2])):  # tp_gather_partition_size 1, and 8 (default)
        for entry in _each(results, case):
            _same_tokens(entry)
            assert entry["groups"] == [groups] * len(entry["groups"])
            # the blocks in len(groups) gathers, the rest once, each parameter once; and the prompts over the group
            assert entry["gathers"] == [entry["parameters"] + TP_PROMPT_GATHER] * len(entry["gathers"])


def test_max_out_tokens_sizes_the_workspace_and_bounds_the_generation(results):
    for entry in _each(results, "pinned"):
        assert entry["workspace"] == [_workspace_bytes(entry, 16)] * 2
        assert entry["workspace_after_training"] == _workspace_bytes(entry, 16)  # kept while training
        assert entry["over_budget"].startswith("UserError: hybrid_engine.max_out_tokens: a 5-token prompt and 16 "
                                               "new tokens make 21, over max_out_tokens=16")
    for entry in _each(results, "llama_split"):  # the group's 2 x 2 prompts, 1 of the 2 key/value heads per rank
        assert entry["workspace"] == [_workspace_bytes(entry, 16, tp=2)] * 2
    for entry in _each(results, "split"):  # release_inference_cache: nothing held after a generate
        assert entry["workspace"] == [0, 0] and entry["workspace_after_training"] == 0


def test_pin_parameters_false_gathers_each_layer_at_every_forward(results):
    for entry in _each(results, "unpinned"):
        _same_tokens(entry)
        for gathers in entry["gathers"]:  # one forward per new token, each gathering every parameter (or more)
            assert gathers % NEW_TOKENS == 0 and gathers // NEW_TOKENS >= entry["parameters"]
