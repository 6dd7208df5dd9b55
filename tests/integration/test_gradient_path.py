"""The engine's gradient path on 2 gloo ranks, one launch (issue 36, items 1 and 4).

**A script's own ``loss.backward()``** then ``engine.step()`` trains as ``engine.backward(loss)`` does, at ZeRO
stages 0-3 in fp32 and bf16. Bound: the two runs differ only in where the division by the accumulation steps
(2) happens: on the loss before backward, or on each parameter's gradient before torch accumulates it. Division
by a power of two is exact in fp32 and bf16 (no value here is near the subnormal range), and every backward
operation is linear in the incoming gradient with rounding that commutes with a power-of-two scale, so the
gradients, and therefore every loss, are bitwise equal: the bound is 0. fp16 (the loss must be multiplied by
the loss scale, which only ``engine.backward`` does) refuses at the first ``step()``; an optimizer step with no
gradient since the last one refuses at every stage.

**What goes on the wire** for ``prescale_gradients`` x ``gradient_predivide_factor`` is DeepSpeed's payload:
the sum of |x| the reduction collectives receive during backward, against sum |gradient| of the rank's own
micro-batch in plain torch. The divisors are powers of two, so each payload element is exactly the gradient
divided and the float64 sums of the same fp32 values agree to float64 rounding (rtol 1e-12). The average that
reaches the optimizer is the same in every combination: the weights after one SGD step are bitwise equal.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_ranks
from tests.integration import _gradient_path_workloads as work

WORLD = 2


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(work.gradient_path, WORLD, timeout=600)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_loss_backward_trains_as_engine_backward(ranks, stage, precision):
    for rank in ranks:
        engine = rank[("direct", stage, precision, "engine")]
        direct = rank[("direct", stage, precision, "torch")]
        assert direct["steps"] == work.STEPS
        assert direct["moved"] > 1e-3  # the weights moved (Adam, lr 1e-2, 4 steps)
        assert direct["losses"][-work.GAS] < direct["losses"][0] - 0.05  # the same micro-batch, 3 steps later
        assert direct["losses"] == engine["losses"], f"stage {stage} {precision}: loss.backward() differs"


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_loss_backward_refused_at_first_step(ranks, stage):
    for rank in ranks:
        got = rank[("fp16", stage)]
        assert got["message"] is not None and "engine.backward(loss)" in got["message"], got["message"]
        assert got["message"].startswith("engine.step():") and "\n" not in got["message"]
        assert got["unchanged"] and got["micro"] == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_without_gradient_refused(ranks, stage):
    for rank in ranks:
        got = rank[("no_grad", stage)]
        assert got["message"] is not None and "no gradient was produced" in got["message"], got["message"]
        assert got["unchanged"] and got["steps"] == 1


def expected_divisor(stage: int, scatter: bool, prescale: bool, factor: float) -> float:
    """DeepSpeed: prescale divides by the world size; otherwise an all-reduce (engine.allreduce_bucket, ZeRO-1/2
    without reduce-scatter) by the factor, a reduce-scatter (ZeRO-1/2 average_tensor, ZeRO-3) by world x factor."""
    if prescale:
        return WORLD
    return factor * WORLD if (stage == 3 or (stage in (1, 2) and scatter)) else factor


@pytest.mark.parametrize("stage,scatter", work.PAYLOAD_STAGES)
def test_reduction_payload_follows_deepspeed(ranks, stage, scatter):
    for rank in ranks:
        runs = {combo: rank[("payload", stage, scatter) + combo] for combo in work.COMBOS}
        for (prescale, factor), got in runs.items():
            divisor = expected_divisor(stage, scatter, prescale, factor)
            assert got["collectives"] > 0
            np.testing.assert_allclose(got["payload"], rank["local"] / divisor, rtol=1e-12,
                                       err_msg=f"prescale={prescale} factor={factor}")
        first = runs[work.COMBOS[0]]["weights"]
        for combo, got in runs.items():
            np.testing.assert_array_equal(got["weights"], first, err_msg=f"{combo}: the average changed")


def test_allreduce_bucket_payload_follows_deepspeed(ranks):
    for r, rank in enumerate(ranks):
        for prescale, factor in work.COMBOS:
            sent, mean = rank[("payload", 0, True, prescale, factor)]["bucket"]
            assert sent == pytest.approx(3 * (r + 1) / expected_divisor(0, False, prescale, factor), rel=1e-12)
            assert mean == [1.5, 1.5, 1.5]  # (1 + 2) / 2
