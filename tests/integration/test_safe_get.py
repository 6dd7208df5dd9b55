"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` on 2 ranks at ZeRO stages 0-3: the same full tensors at
every stage, equal to plain PyTorch's (float64, one process); a value set through them changes training as
assigning it in plain PyTorch would. The local pieces of the ranks put together are the full value.

Tolerances: the ranks train in fp32 and the reference in float64; every quantity here is a short sum or a few
Adam steps of O(1) values, so they agree to a few hundred fp32 roundings (rtol 1e-5, atol 1e-6 for values of
order 1e-2 to 1). Across stages the arithmetic on 2 ranks is the same sums in the same order, so stages agree
to a few roundings (rtol 1e-6)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness.launch import Launch, Runs
from tests.integration import _surface_workloads as work

STAGES = [0, 1, 2, 3]


LAUNCHES = {"stages": Launch(work.safe_api_stages, 2, (STAGES,), timeout=400)}


def collect(runs: Runs):
    return runs["stages"], work.reference()


@pytest.mark.parametrize("stage", STAGES)
def test_full_values_equal_plain_pytorch_at_every_stage(runs, stage):
    ranks, ref = runs
    for rank in ranks:  # every rank gets the full value
        got = rank[stage]
        for what in ("grad", "fp32", "exp_avg", "exp_avg_sq", "final"):
            for name, value in ref[what].items():
                np.testing.assert_allclose(got[what][name], value, rtol=1e-5, atol=1e-6, err_msg=f"{what} {name}")
                np.testing.assert_allclose(got[what][name], ranks[0][0][what][name], rtol=1e-6, atol=1e-8,
                                           err_msg=f"stage {stage} vs stage 0: {what} {name}")


@pytest.mark.parametrize("stage", STAGES)
def test_set_full_values_change_training_like_plain_pytorch(runs, stage):
    ranks, ref = runs
    for rank in ranks:
        np.testing.assert_array_equal(rank[stage]["after_set"], work.new_weight().double().numpy())
        # the third step's forward used the new weight (the loss) and its update the zeroed moment (the weights)
        assert rank[stage]["loss3"] == pytest.approx(ref["loss3"], rel=1e-5)
        for name, value in ref["final"].items():
            np.testing.assert_allclose(rank[stage]["final"][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("stage", STAGES)
def test_local_pieces_make_up_the_full_value(runs, stage):
    ranks, _ = runs
    for what, full in (("local_fp32", "fp32"), ("local_exp_avg", "exp_avg")):
        for name, value in ranks[0][stage][full].items():
            pieces = [rank[stage][what][name] for rank in ranks]
            if stage == 0:  # nothing is partitioned: each rank holds the whole value
                for piece in pieces:
                    np.testing.assert_array_equal(piece, value.reshape(-1))
                continue
            if stage == 3:  # equal shards, the last one padded with zeros
                assert len({p.size for p in pieces}) == 1
            joined = np.concatenate(pieces)
            np.testing.assert_array_equal(joined[:value.size], value.reshape(-1))
            assert not joined[value.size:].any()
