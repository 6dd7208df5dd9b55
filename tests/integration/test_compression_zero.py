"""QAT under sharded parameters: ZeRO-2 and ZeRO-3 on 2 ranks match ZeRO-0 within 1e-5 over 50 steps.

With two ranks every gradient average is the same two-term sum in every stage, so the runs agree to
rounding; the fake quantization then sees the same weights and rounds them the same way.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_ranks
from tests.integration import _compression_workloads as w
from tests.harness.runs import max_rel_param_diff, rel_diff

TOL = 1e-5
pytestmark = pytest.mark.slow  # one 2-rank launch, four 50-step runs: about a minute on 2 loaded cores


def test_qat_under_zero2_and_zero3_matches_zero0():
    results = run_ranks(w.qat_suite, 2, timeout=600)
    base = results[0]["stage0"]
    assert len(base["losses"]) == w.STEPS
    for name in ("stage2", "stage3", "stage3_zero_init"):
        got = results[0][name]
        for step, (a, b) in enumerate(zip(got["losses"], base["losses"])):
            assert rel_diff(a, b) <= TOL, f"{name} step {step}: loss {a} vs ZeRO-0 {b}"
        assert max_rel_param_diff(got["params"], base["params"]) <= TOL, name
        np.testing.assert_array_equal(results[1][name]["params"], got["params"])  # every rank alike
