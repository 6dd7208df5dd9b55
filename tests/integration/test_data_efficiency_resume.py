"""Exact resume with each data-efficiency feature on (2 ranks, ZeRO-2, gradient accumulation 2, dropout on):
8 uninterrupted steps equal 4 steps, a checkpoint, and 4 more in a new launch, bit for bit. The schedules'
states (curriculum, θ, random-LTD's kept length and layer-token count, the sampler's clusters and positions)
travel in the checkpoint. And PLD under ZeRO-3, where every rank must skip the same blocks: it trains when the
ranks are seeded alike and is refused, not hung, when they are not."""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness.launch import Launch, Runs
from tests.helpers import run_ranks
from tests.integration._data_efficiency_workloads import analyse, run_jobs

FEATURES = ("legacy", "pld", "ltd", "sampling", "all")


def collect(launch: Runs):
    """Straight runs and the saves halfway in one launch, then the resumed runs."""
    root = launch.root
    analyse(str(root / "index"))
    common = {"index_dir": str(root / "index")}
    first = [dict(common, feature=f, steps=8) for f in FEATURES]
    first += [dict(common, feature=f, steps=4, save_at=4, save_dir=str(root / f)) for f in FEATURES]
    straight_and_saved = launch(Launch(run_jobs, 2, (first,), timeout=600, rank=0))
    resumed = launch(Launch(run_jobs, 2, ([dict(common, feature=f, steps=4, load=str(root / f)) for f in FEATURES],),
                            timeout=600, rank=0))
    return {f: (straight_and_saved[i], straight_and_saved[len(FEATURES) + i], resumed[i])
            for i, f in enumerate(FEATURES)}


@pytest.mark.parametrize("feature", FEATURES)
def test_resume_is_exact_with_each_feature(runs, feature):
    straight, first_half, second_half = runs[feature]
    assert first_half["losses"] == straight["losses"][:4]
    assert second_half["losses"] == straight["losses"][4:]          # exact float equality
    assert second_half["theta"] == straight["theta"]
    assert second_half["layer_tokens"] == straight["layer_tokens"]
    for key, value in straight["params"].items():
        assert np.array_equal(second_half["params"][key], value), key


def test_pld_under_zero3_trains_or_refuses_but_never_hangs():
    from tests.integration._data_efficiency_workloads import pld_zero3

    outcomes = run_ranks(pld_zero3, 2, timeout=300)
    assert all(isinstance(o["same"], list) and len(o["same"]) == 6 for o in outcomes)
    assert all("every rank must skip the same layers" in o["apart"] for o in outcomes)
