"""MiCS and hpZ on 4 gloo ranks against plain ZeRO-3 (one launch, ``_mics_workloads.suite``).

MiCS changes how the gradient sum is grouped (reduce-scatter over a shard group of 2, then all-reduce across
the 2 replicas): another valid fp32 ordering, so its losses and final parameters must stay within the
derived bound between two runs (tests/tolerance.py). Everything else here does the same arithmetic as plain
ZeRO-3 and is compared exactly: hpZ gathers the same values from another group, a hierarchical gather puts
the same pieces in the same places, MiCS_Init partitions as the engine would, and a resumed run continues
from exactly the saved state. Which process group carried each collective comes from the comms logger.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.model_states import model_state_bytes
from tests import tolerance as t
from tests.harness.launch import Launch
from tests.integration import _mics_workloads as m
from tests.harness.models import loss_terms
from tests.harness.runs import reference_run

WORLD = 4


def launches(root) -> dict:
    return {"suite": Launch(m.suite, WORLD, (str(root),), timeout=900)}


@pytest.fixture(scope="module")
def results(runs) -> list[dict]:
    return runs["suite"]


@functools.lru_cache(maxsize=None)
def spread() -> t.Spread:
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return reference_run(m.NAME, m.STEPS, 2 * WORLD, 0.0, d, parts, reverse)
    return t.spread(run, torch.float32, loss_terms(m.NAME, 2 * WORLD))


def _shard(rank: int, size: int) -> str:
    first = rank - rank % size
    return ",".join(str(r) for r in range(first, first + size))


def _replicas(rank: int, size: int) -> str:
    return ",".join(str(r) for r in range(rank % size, WORLD, size))


def _elements(numels: list[int], ranks: int) -> int:
    return sum(math.ceil(n / ranks) for n in numels)


def _estimated_parameter_bytes(numels: list[int], **layout: int) -> int:
    """What dsrun's memory estimator predicts for the parameters of one rank."""
    spec = EstimateInputs(total_params=sum(numels), largest_layer_params=max(numels), ranks_per_node=WORLD,
                          zero_stage=3, precision="fp32", device="cpu", **layout)
    return model_state_bytes(spec).device_params


def test_mics_partitions_over_shard_groups_and_matches_zero3(results: list[dict]) -> None:
    """mics_shard_size=2: half the model's parameter bytes per rank, gathers and reduce-scatters inside the
    shard group, one all-reduce across replicas per step; losses as plain ZeRO-3's. The hierarchical
    gather (mics_hierarchical_params_gather, a shard group of 4 over two nodes of 2) runs in two levels."""
    plain, mics = results[0]["plain"], results[0]["mics"]
    t.assert_tracks(mics, plain, spread(), "MiCS vs ZeRO-3", against="run")
    numels = plain["numels"]
    assert all(n % 2 == 0 for n in numels)  # so "half the model" is exact, no padding
    model_bytes = sum(numels) * 4
    assert mics["memory"]["parameters"] * 2 == model_bytes
    assert mics["memory"]["parameters"] == _estimated_parameter_bytes(numels, mics_shard_size=2)
    assert plain["memory"]["parameters"] == _elements(numels, 4) * 4
    for out in results:
        rank = out["rank"]
        shard, replicas = _shard(rank, 2), _replicas(rank, 2)
        for key in ("mics", "mics_init"):
            got = out[key]
            assert set(got["forward"]["all_gather"]) == {shard}
            assert set(got["backward"]["reduce_scatter"]) == {shard}
            assert got["backward"]["all_reduce"] == {replicas: 1}  # once per step, the accumulated shards
        # zero.MiCS_Init partitions the same way: the same run
        assert out["mics_init"]["losses"] == out["mics"]["losses"]
        np.testing.assert_array_equal(out["mics_init"]["params"], out["mics"]["params"])
        hier = out["mics_hier"]
        local, across = _shard(rank, 2), _replicas(rank, 2)
        gathers = hier["forward"]["all_gather"]
        assert set(gathers) == {local, across} and gathers[local] == gathers[across]
        assert set(hier["backward"]["all_gather"]) == {local, across}
        assert hier["losses"] == out["plain"]["losses"]
        np.testing.assert_array_equal(hier["params"], out["plain"]["params"])


def test_hpz_backward_gathers_stay_in_the_secondary_group(results: list[dict]) -> None:
    """zero_hpz_partition_size=2: the forward gathers over all 4 ranks, every backward gather inside the
    rank's group of 2; each rank holds the secondary partition on top; the losses are plain ZeRO-3's."""
    numels = results[0]["plain"]["numels"]
    for out in results:
        rank, secondary, world = out["rank"], _shard(out["rank"], 2), ",".join(map(str, range(WORLD)))
        hpz, plain = out["hpz_no_prefetch"], out["plain"]
        assert set(hpz["forward"]["all_gather"]) == {world}
        assert hpz["backward"]["all_gather"] == {secondary: plain["backward"]["all_gather"][world]}
        assert hpz["forward"]["all_gather"][world] == plain["forward"]["all_gather"][world]
        # with prefetching, gathers for backward start early: still all from the secondary partitions
        prefetched = out["hpz"]
        counts = {g: sum(prefetched[phase].get("all_gather", {}).get(g, 0) for phase in ("forward", "backward"))
                  for g in (world, secondary)}
        assert counts == {world: hpz["forward"]["all_gather"][world],
                          secondary: hpz["backward"]["all_gather"][secondary]}
        for key in ("hpz", "hpz_no_prefetch"):
            assert out[key]["memory"]["parameters"] == (_elements(numels, 4) + _elements(numels, 2)) * 4
            assert out[key]["memory"]["parameters"] == _estimated_parameter_bytes(numels, hpz_partition_size=2)
            assert out[key]["losses"] == plain["losses"], rank
            np.testing.assert_array_equal(out[key]["params"], plain["params"])


def test_mics_and_hpz_checkpoints_resume(results: list[dict]) -> None:
    """Saved under MiCS (mics_shard_size=2) or hpZ (zero_hpz_partition_size=2) and loaded into the same
    layout, training continues exactly as without the interruption; zero_to_fp32 rebuilds the saved model."""
    for out in results:
        for key in ("resume/mics", "resume/hpz"):
            assert out[key]["resumed"] == out[key]["uninterrupted"], key
    assert results[0]["resume/mics"]["consolidated"] is True
    assert results[0]["resume/hpz"]["consolidated"] is True
