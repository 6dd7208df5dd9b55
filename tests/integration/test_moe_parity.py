"""Expert parallelism is exact: ep=2 on 2 gloo ranks against ep=1 holding every expert, on the same shards.

One launch runs every case (``_moe_workloads.moe_suite``): the MoE layer alone for k = 1, 2, 3 with token
dropping, with ``drop_tokens=False`` and with the dropless path (outputs, ``l_aux``, every gradient, the
logged all-to-all bytes), a deliberately skewed routing with ``drop_tokens=False`` (ranks need different
capacities: they must agree, not hang), and the engine at ZeRO stages 0-3 (one SGD step; the new weights
equal the reference's). Tolerances come from fp32 arithmetic (``_moe_workloads.fp32_bound``): the two sides
sum the same terms in a different order.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness.launch import Launch, Runs
from tests.integration import _moe_workloads as w

# multi-process launches (tens of seconds each on a loaded 2-core machine): slow, as the engine parity tests
pytestmark = pytest.mark.slow

U = 2.0 ** -24


LAUNCHES = {"suite": Launch(w.moe_suite, 2, timeout=420)}


def collect(runs: Runs) -> list[dict]:
    return runs["suite"]


def _close(a: np.ndarray, b: np.ndarray, n_terms: int, what: str) -> None:
    scale = max(1.0, float(np.abs(b).max()))
    bound = w.fp32_bound(n_terms, scale)
    diff = float(np.abs(a - b).max())
    assert diff <= max(bound, 1e-6 * scale), f"{what}: |diff| {diff} > bound {bound}"


def test_layer_output_aux_and_gradients_match_ep1(runs) -> None:
    for rank, result in enumerate(runs):
        for key, case in result["layer"].items():
            k = int(key[1]) if key.startswith("k") else 1
            n_terms = 2 * w.TOKENS * k  # a gradient sums at most every token's k choices of both shards
            _close(case["out"], case["ref_out"], k + 1, f"rank {rank} {key} output")
            assert abs(case["l_aux"] - case["ref_l_aux"]) <= 4 * w.EXPERTS * U * max(1.0, case["ref_l_aux"]), key
            assert set(case["grads"]) == set(case["ref_grads"]), key
            for name, grad in case["grads"].items():
                _close(grad, case["ref_grads"][name], n_terms, f"rank {rank} {key} grad {name}")


def test_skewed_routing_without_dropping_agrees_on_capacity_and_matches_dropless(runs) -> None:
    results = runs  # finishing at all (run_ranks' timeout) is the no-hang half of this test
    caps = [r["layer"]["skew/nodrop"]["capacity"] for r in results]
    loads = [max(r["layer"]["skew/nodrop"]["counts"]) for r in results]
    assert loads[0] != loads[1], "the fixture must give the ranks different loads"
    assert caps == [max(loads)] * 2
    for r in results:
        np.testing.assert_allclose(r["layer"]["skew/nodrop"]["out"], r["layer"]["skew/dropless"]["out"],
                                   rtol=0, atol=w.fp32_bound(2, float(np.abs(r["layer"]["skew/dropless"]["out"]).max())))


def test_logged_all_to_all_bytes_equal_the_analytic_count(runs) -> None:
    for result in runs:
        for k in (1, 2, 3):
            case = result["layer"][f"k{k}/drop"]
            assert case["a2a_count"] == 4  # dispatch and return, forward and backward
            assert case["a2a_bytes"] == w.analytic_a2a_bytes(w.TOKENS, k, ep=2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_step_matches_ep1_reference(runs, stage: int) -> None:
    for rank, result in enumerate(runs):
        case = result["engine"][f"zero{stage}"]
        assert set(case["got"]) == set(case["ref"])
        for name, value in case["got"].items():
            _close(value, case["ref"][name], 2 * w.TOKENS * 2, f"rank {rank} ZeRO-{stage} {name}")
