"""Activation checkpointing across processes: partitioned activations over a model-parallel group of two
(with the contiguous buffer and ``number_checkpoints``), and ZeRO 0-3, offload and frozen parameters."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.harness.launch import Launch
from tests.integration import _actckpt_workloads as w
from tests.harness.models import GPT_KW
from tests.harness.models import NANOGPT_SEQ as SEQ

# one block's input: the 4 x 16 tokens of the global batch, n_embd floats each
INPUT_BYTES = 4 * SEQ * GPT_KW["n_embd"] * 4
LAYERS = GPT_KW["n_layer"]


LAUNCHES = {"partition": Launch(w.partition_suite, 2, timeout=300), "zero": Launch(w.zero_suite, 2, timeout=600)}


@pytest.fixture(scope="module")
def partition_results(runs) -> list[dict]:
    return runs["partition"]


@pytest.fixture(scope="module")
def zero_results(runs) -> list[dict]:
    return runs["zero"]


@pytest.mark.parametrize("fn", ["reentrant", "non_reentrant"])
def test_partitioned_activations_halve_what_each_rank_keeps_with_identical_gradients(partition_results, fn):
    for rank_result in partition_results:
        reference = rank_result["none"]["grads"]
        runs = {kind: rank_result[f"{kind}/{fn}"] for kind in ("whole", "partitioned", "contiguous2", "contiguous3")}
        for kind, run in runs.items():
            for name, grad in reference.items():
                np.testing.assert_array_equal(run["grads"][name], grad, err_msg=f"{kind}: {name}")
        whole, parted = Counter(runs["whole"]["storages"]), Counter(runs["partitioned"]["storages"])
        # each block's input (INPUT_BYTES) is kept as this rank's half
        assert whole - parted == Counter({INPUT_BYTES: LAYERS})
        assert parted - whole == Counter({INPUT_BYTES // 2: LAYERS})
        # contiguous: the halves live in one buffer of number_checkpoints slots
        for slots in (2, 3):
            contiguous = Counter(runs[f"contiguous{slots}"]["storages"])
            assert parted - contiguous == Counter({INPUT_BYTES // 2: LAYERS})
            assert contiguous - parted == Counter({slots * INPUT_BYTES // 2: 1})
        assert "number_checkpoints: 1 slots, but this forward makes checkpoint call 2" in \
            rank_result[f"too_few_slots/{fn}"]


def test_zero_stages_offload_and_frozen_parameters_train_as_without_checkpointing(zero_results):
    """Checkpointing changes no arithmetic: each checkpointed run is bitwise the run of the same stage
    without it (the ZeRO-3 parameters gathered again for the recompute, the frozen ones never updated)."""
    results = zero_results[0]
    for key, (stage, mode, fn, zero) in w.ZERO_CASES.items():
        plain = results[w.plain_case(key)]
        np.testing.assert_array_equal(results[key]["losses"], plain["losses"], err_msg=key)
        np.testing.assert_array_equal(results[key]["params"], plain["params"], err_msg=key)
        assert results[key]["frozen_unchanged"] and results[key]["trained"], key


def test_zero3_with_non_reentrant_checkpointing_and_frozen_parameters_matches_zero0(zero_results):
    """ZeRO-3 and ZeRO-0 sum the same two gradients (a two-term sum does not depend on the order) and
    apply AdamW element by element, so they differ only where a compiled kernel rounds an element
    differently by its position in a shard (one ulp of one update, ~2^-24 * lr): over 6 steps the losses,
    means of 32 token losses near 5.5, move by orders of magnitude less than 1e-6 of themselves."""
    results = zero_results[0]
    zero3, zero0 = results["3/full"], results["0/none"]
    np.testing.assert_allclose(zero3["losses"], zero0["losses"], rtol=1e-6, atol=0)
    assert zero3["trained"] and zero3["frozen_unchanged"]
