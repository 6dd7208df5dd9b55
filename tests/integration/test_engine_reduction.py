"""``no_sync()``, ``enable_backward_allreduce = False`` with ``allreduce_gradients()``, and DeepSpeed's
``buffered_allreduce_fallback`` on 2 ranks at ZeRO stages 0 and 1 (stages 2-3 refuse ``no_sync``, as in
DeepSpeed): the gradients a rank kept to itself are reduced once, and the step equals plain PyTorch's
(float64, one process). Tolerance: a few fp32 roundings of O(1) sums (rtol 1e-5, atol 1e-7 for SGD steps
of 0.1 x gradients of order 1)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness.launch import Launch, Runs
from tests.integration import _surface_workloads as work

STAGES = [0, 1]


LAUNCHES = {"stages": Launch(work.reduction_stages, 2, (STAGES,), timeout=300)}


def collect(runs: Runs):
    return runs["stages"], work.reduction_reference()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", ["no_sync", "deferred"])
def test_gradients_kept_back_are_reduced_once(runs, stage, case):
    ranks, ref = runs
    for rank in ranks:
        for name, value in ref[case].items():
            np.testing.assert_allclose(rank[stage][case][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
        assert rank[stage]["applied"]


@pytest.mark.parametrize("stage", STAGES)
def test_buffered_allreduce_fallback_averages(runs, stage):
    ranks, _ = runs
    for rank in ranks:
        small, square = rank[stage]["fallback"]
        np.testing.assert_array_equal(small, np.full(3, 1.5))  # (1 + 2) / 2
        np.testing.assert_array_equal(square, np.full((2, 2), 5.0))  # (0 + 10) / 2
