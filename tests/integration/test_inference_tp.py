"""Automatic tensor parallelism on 2 gloo ranks: the split model computes what the whole one computes.

For dsrun's GPT (learned and rotary positions) and each Hugging Face architecture (GPT-2, Llama, Mistral, OPT,
BERT, T5, built from small configs with random weights), the TP=2 logits equal the single-process model's within
the bound fp32 arithmetic allows for a different summation order (``fp32_bound``; the same check in float64
shows the split itself is exact), and greedy generations are identical token for token. The comms logger's
all-reduce bytes equal the analytic count: two all-reduces of the hidden state per block per forward.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_ranks
from tests.integration._inference_models import (HF_NAMES, allreduce_per_token, compare_split, fp32_bound,
                                                  injected_split, user_model_split)

DSRUN_NAMES = ("dsrun-gpt", "dsrun-gpt-rotary")


@pytest.fixture(scope="module")
def dsrun_results():
    return run_ranks(compare_split, 2, list(DSRUN_NAMES), timeout=240)


@pytest.fixture(scope="module")
def hf_results():
    pytest.importorskip("transformers")
    return run_ranks(compare_split, 2, list(HF_NAMES), timeout=400)


def _check(results, name):
    for rank_result in results:
        entry = rank_result[name]
        for dtype in ("float32", "float64"):
            got, want = entry[dtype]["split"], entry[dtype]["reference"]
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= fp32_bound(entry, dtype), (name, dtype, np.abs(got - want).max())
        if "generated" in entry:
            np.testing.assert_array_equal(entry["generated_split"], entry["generated"])
    # every rank ends with the same logits (the all-reduce leaves them identical)
    np.testing.assert_array_equal(results[0][name]["float32"]["split"], results[1][name]["float32"]["split"])


@pytest.mark.parametrize("name", DSRUN_NAMES)
def test_dsrun_gpt_split_over_two_ranks_matches_the_whole_model(dsrun_results, name):
    _check(dsrun_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", HF_NAMES)
def test_hugging_face_model_split_over_two_ranks_matches_the_whole_model(hf_results, name):
    _check(hf_results, name)


def test_allreduce_bytes_per_generated_token_equal_the_analytic_count():
    batch, length, new = 2, 7, 5
    result = run_ranks(allreduce_per_token, 2, batch, length, new, timeout=180)[0]
    layers, width = result["shape"]["n_layer"], result["shape"]["n_embd"]
    per_position = 2 * layers * batch * width * 4  # two fp32 all-reduces of [B, 1, d] per block
    fused = result["fused"]["stats"]["all_reduce"]
    # the prompt once, then each generated token but the last goes through the blocks once
    assert fused["message_bytes"] == per_position * (length + new - 1)
    assert fused["count"] == 2 * layers * new
    plain = result["plain"]["stats"]["all_reduce"]  # no cache: every step runs the whole context again
    assert plain["message_bytes"] == per_position * sum(length + k for k in range(new))
    assert plain["count"] == 2 * layers * new
    np.testing.assert_array_equal(result["fused"]["tokens"], result["plain"]["tokens"])


def test_kernel_injection_split_over_two_ranks_matches_the_whole_model():
    pytest.importorskip("transformers")
    results = run_ranks(injected_split, 2, ["gpt2", "llama"], timeout=240)
    for result in results:
        for name, qkv_columns in (("gpt2", 3 * 32 // 2), ("llama", (4 + 2 * 2) * 8 // 2)):  # this rank's heads
            entry = result[name]
            assert entry["qkv_columns"] == [(32, qkv_columns)] * 2
            # fp32, 2 blocks of 6 products in a row and the head; the split changes only the summation order
            unit = np.finfo(np.float32).eps / 2
            bound = 2 * 13 * entry["longest_sum"] * unit * max(1.0, np.abs(entry["reference"]).max())
            assert np.abs(entry["split"] - entry["reference"]).max() <= bound
            np.testing.assert_array_equal(entry["generated_split"], entry["generated"])
    np.testing.assert_array_equal(results[0]["gpt2"]["split"], results[1]["gpt2"]["split"])


def test_injection_policy_splits_a_user_model_whose_names_auto_tp_does_not_know():
    results = run_ranks(user_model_split, 2, timeout=120)
    for result in results:
        assert result["heads"] == [2, 2]
        assert result["plan"][0] == "layers.0 (UserBlock): to_qkv[x3] -> mix; expand -> shrink"
        # fp32, 2 blocks (5 sequential sums), longest sum 96
        bound = 2 * 5 * 96 * np.finfo(np.float32).eps / 2 * max(1.0, np.abs(result["reference"]).max())
        assert np.abs(result["split"] - result["reference"]).max() <= bound


@pytest.mark.slow
def test_two_tensor_parallel_pairs_in_a_world_of_four_from_each_group_source():
    from tests.integration._inference_models import group_sources

    results = run_ranks(group_sources, 4, timeout=240)
    for rank, result in enumerate(results):
        # fp32, 2 blocks (5 sequential sums), longest sum 128
        bound = 2 * 5 * 128 * np.finfo(np.float32).eps / 2 * max(1.0, np.abs(result["reference"]).max())
        for source in ("consecutive", "tp_group", "mpu", "tp.mpu"):
            entry = result[source]
            assert entry["tp"] == (rank % 2, 2)
            assert entry["all_reduce"] == 4  # two blocks, two all-reduces each, within the pair
            assert np.abs(entry["logits"] - result["reference"]).max() <= bound
