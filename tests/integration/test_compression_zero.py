"""QAT under sharded parameters: ZeRO-2 and ZeRO-3 on 2 ranks match ZeRO-0 within 1e-5 over 50 steps.

With two ranks every gradient average is the same two-term sum in every stage, so the runs agree to
rounding; the fake quantization then sees the same weights and rounds them the same way. The four runs are
``Case`` records (tests/harness/runs.py), run by one 2-rank launch.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness.launch import Launch
from tests.harness.runs import Case, max_rel_param_diff, rel_diff, world_suite, zero3_config

TOL = 1e-5
STEPS = 50
# 8 -> 4 bits (grouped) with activation quantization, and learned sparse masks (their scores are ZeRO
# parameters like any other)
QAT = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 4,
                              "schedule_offset": 5},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 10},
                                     "modules": ["*"]}}},
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 10},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attn"]}}},
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 15},
        "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.c_fc"]}}},
}
CASES = [Case(key, "nanogpt", zero3_config(stage, 2, 1, compression_training=QAT), zero_init=zero_init, steps=STEPS)
         for key, stage, zero_init in (("stage0", 0, False), ("stage2", 2, False), ("stage3", 3, False),
                                       ("stage3_zero_init", 3, True))]
LAUNCHES = {"qat": Launch(world_suite, 2, (CASES,), timeout=600)}
pytestmark = pytest.mark.slow  # one 2-rank launch, four 50-step runs: about a minute on 2 loaded cores


def test_qat_under_zero2_and_zero3_matches_zero0(runs):
    results = runs["qat"]
    base = results[0]["stage0"]
    assert len(base["losses"]) == STEPS
    for name in ("stage2", "stage3", "stage3_zero_init"):
        got = results[0][name]
        for step, (a, b) in enumerate(zip(got["losses"], base["losses"])):
            assert rel_diff(a, b) <= TOL, f"{name} step {step}: loss {a} vs ZeRO-0 {b}"
        assert max_rel_param_diff(got["params"], base["params"]) <= TOL, name
        np.testing.assert_array_equal(results[1][name]["params"], got["params"])  # every rank alike
