"""``dsrun.elasticity`` against DeepSpeed: its documented example, the outcomes its own test-suite publishes,
its error classes, and a grid of cases checked against an independent brute-force statement of the search
(:mod:`.reference`)."""
from __future__ import annotations

import itertools

import pytest

import dsrun
from dsrun.config.elastic import HIGHLY_COMPOSITE
from dsrun.elasticity import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
                              compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config,
                              get_compatible_gpus)

from . import reference

VERSION = "0.14.1"
HCN = reference.highly_composite_upto(12000)


def _config(**section) -> dict:
    return {"elasticity": {"enabled": True, **section}}


@pytest.fixture
def ten_k() -> dict:
    """The configuration of DeepSpeed's own elasticity tests (tests/unit/elasticity/test_elastic.py)."""
    return _config(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500,
                   min_time=20, version=0.1)


def test_the_table_of_highly_composite_numbers_is_the_sieve():
    assert list(HIGHLY_COMPOSITE) == reference.highly_composite_upto(720720)


def test_documented_example():
    # compute_elastic_config's docstring example: max 2000, micro batches 2, 4, 6 over 1..10000 GPUs
    batch, valid = compute_elastic_config(_config(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1,
                                                  max_gpus=10000, min_time=20, version=0.1), VERSION)
    assert (batch, valid) == reference.v01([2, 4, 6], 2000, 1, 10000, True, HCN)
    assert batch == 1680 and valid == reference.divisors(840)  # every divisor g of 840 runs micro batches of 2


def test_deepspeeds_published_outcomes(ten_k):
    batch, valid = compute_elastic_config(ten_k, VERSION)
    assert (batch, len(valid)) == (9792, 23)
    for gpus in valid:  # every valid count runs whole micro batches
        assert any((batch // gpus) % m == 0 for m in [8, 12, 16, 17]) and batch % gpus == 0
    assert compute_elastic_config(ten_k, VERSION, world_size=64)[2] == 17
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(ten_k, VERSION, world_size=128)
    small = _config(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], min_gpus=1, max_gpus=1500, version=0.1)
    assert compute_elastic_config(small, VERSION, world_size=7)[2] == 3


def test_version_0_2_with_model_parallelism(ten_k, monkeypatch):
    ten_k["elasticity"].update(model_parallel_size=4, num_gpus_per_node=8, version=0.2)
    monkeypatch.setenv("WORLD_SIZE", "16")
    batch, valid = compute_elastic_config(ten_k, VERSION)
    expected = reference.v02([8, 12, 16, 17], 10000, 16, 32, 1500, True, 8, 4, HCN)
    assert (batch, valid) == expected[:2]
    assert compute_elastic_config(ten_k, VERSION, return_microbatch=True) == expected
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(ten_k, VERSION)
    ten_k["elasticity"]["model_parallel_size"] = 16  # does not divide 8 GPUs per node
    with pytest.raises(ElasticityError):
        compute_elastic_config(ten_k, VERSION, world_size=16)


@pytest.mark.parametrize("change, error", [
    ({"enabled": False}, ElasticityConfigError),
    ({"version": "0.3"}, ElasticityConfigError),
    ({"max_train_batch_size": None}, ElasticityConfigError),
    ({"micro_batch_sizes": None}, ElasticityConfigError),
    ({"micro_batch_sizes": [1, 4, -1, 2, -10]}, ElasticityConfigError),
    ({"micro_batch_sizes": 5}, ElasticityConfigError),
    ({"micro_batch_sizes": ["a", None, 0.5]}, ElasticityConfigError),
    ({"micro_batch_sizes": [2, 0.5, 4]}, ElasticityConfigError),
    ({"min_gpus": -1}, ElasticityConfigError),
    ({"max_gpus": -1}, ElasticityConfigError),
    ({"min_gpus": 64, "max_gpus": 32}, ElasticityConfigError),
    ({"min_time": -1}, ElasticityConfigError),
    ({"model_parallel_size": 4, "num_gpus_per_node": 8}, ElasticityConfigError),  # model parallel in v0.1
    ({"micro_batch_sizes": [8, 20000]}, ValueError),  # a micro batch above the maximum
], ids=lambda v: str(v) if not isinstance(v, type) else v.__name__)
def test_invalid_sections_raise_deepspeeds_errors(ten_k, change, error):
    for key, value in change.items():
        if value is None:
            del ten_k["elasticity"][key]
        else:
            ten_k["elasticity"][key] = value
    with pytest.raises(error):
        compute_elastic_config(ten_k, VERSION)


def test_missing_section_old_target_version_and_not_a_dict(ten_k):
    with pytest.raises(ElasticityConfigError, match="missing"):
        compute_elastic_config({}, VERSION)
    with pytest.raises(ElasticityError, match="0.3.8"):
        compute_elastic_config(ten_k, "0.2")
    assert compute_elastic_config(ten_k, "0.3.8")[0] == 9792
    with pytest.raises(ValueError):
        compute_elastic_config("elasticity", VERSION)
    with pytest.raises(ElasticityConfigError):
        compute_elastic_config(_config(), VERSION)  # enabled with nothing else


def test_version_0_1_micro_batch_needs_a_world_size(ten_k):
    # DeepSpeed divides by the world size 0 here (ZeroDivisionError); dsrun says what is missing
    with pytest.raises(ElasticityConfigError, match="world_size"):
        compute_elastic_config(ten_k, VERSION, return_microbatch=True)


def test_enabled_and_scheduler_check(ten_k, monkeypatch):
    assert elasticity_enabled(ten_k) and not elasticity_enabled({}) and not elasticity_enabled(
        {"elasticity": {"max_train_batch_size": 8}})
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"max_train_batch_size": 10000, "micro_batch_sizes": '
                                                      '[8, 12, 16, 17], "version": 0.1}')
    ensure_immutable_elastic_config(ten_k["elasticity"])
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"max_train_batch_size": 5000, "micro_batch_sizes": '
                                                      '[8, 12, 16, 17], "version": 0.1}')
    with pytest.raises(ElasticityConfigError, match="max_train_batch_size"):
        ensure_immutable_elastic_config(ten_k["elasticity"])


def test_public_under_deepspeeds_module_path():
    import dsrun.elasticity.config as ds_config_module

    assert dsrun.elasticity.compute_elastic_config is compute_elastic_config
    assert ds_config_module.ElasticityError is ElasticityError
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)


# --- the grid -----------------------------------------------------------------------------------------------
MICROS = [[1], [2], [3], [2, 4, 6], [8, 12, 16, 17], [1, 2, 3, 7], [5, 7], [4, 8], [6, 10, 15]]
MAX_BATCHES = [8, 64, 100, 500, 2000, 10000]
GPU_RANGES = [(1, 10000), (0, 0), (2, 16), (32, 1500), (5, 5), (7, 7)]
GRID_V01 = [(m, b, r, p) for m, b, r, p in itertools.product(MICROS, MAX_BATCHES, GPU_RANGES, (True, False))
            if max(m) <= b]


@pytest.mark.parametrize("micro, max_batch, gpus, prefer", GRID_V01,
                         ids=[f"{m}-{b}-{r[0]}..{r[1]}-{'larger' if p else 'smaller'}" for m, b, r, p in GRID_V01])
def test_version_0_1_grid(micro, max_batch, gpus, prefer):
    expected = reference.v01(micro, max_batch, gpus[0], gpus[1], prefer, HCN)
    assert get_compatible_gpus(micro, max_batch, gpus[0], gpus[1], prefer) == expected
    if gpus[0] >= 1:  # the config path (min/max_gpus of 0 are not valid config values)
        section = dict(max_train_batch_size=max_batch, micro_batch_sizes=micro, min_gpus=gpus[0], max_gpus=gpus[1],
                       prefer_larger_batch=prefer, version=0.1)
        assert compute_elastic_config(_config(**section), VERSION) == expected
        batch, valid = expected
        for world in sorted({1, 2, 3, 5, 7, 8, 12, 64, *valid[:3], *valid[-2:]}):
            if world in valid:
                micro_batch = compute_elastic_config(_config(**section), VERSION, world_size=world)[2]
                assert micro_batch == max(m for m in micro if (batch // world) % m == 0)
                assert batch % (micro_batch * world) == 0  # whole accumulation steps
            else:
                with pytest.raises(ElasticityIncompatibleWorldSize):
                    compute_elastic_config(_config(**section), VERSION, world_size=world)


GRID_V02 = [(m, b, w, g, mp, p) for m, b, w, (g, mp), p in itertools.product(
    [[2, 4, 6], [8, 12, 16, 17], [1, 2, 3, 7], [4, 8]], [2000, 10000], [1, 2, 4, 8, 12, 16, 24, 64],
    [(1, 1), (4, 1), (8, 2), (8, 4), (8, 8)], (True, False))
    if max(m) <= b // (g // mp) and w % mp == 0]


@pytest.mark.parametrize("micro, max_batch, world, per_node, mp, prefer", GRID_V02,
                         ids=[f"{m}-{b}-w{w}-g{g}-mp{mp}-{'L' if p else 'S'}" for m, b, w, g, mp, p in GRID_V02])
def test_version_0_2_grid(micro, max_batch, world, per_node, mp, prefer):
    expected = reference.v02(micro, max_batch, world, 1, 10000, prefer, per_node, mp, HCN)
    section = dict(max_train_batch_size=max_batch, micro_batch_sizes=micro, min_gpus=1, max_gpus=10000,
                   prefer_larger_batch=prefer, version=0.2, num_gpus_per_node=per_node, model_parallel_size=mp)
    got = get_compatible_gpus(micro, max_batch, 1, 10000, prefer, version=0.2, current_num_gpus=world,
                              num_gpus_per_node=per_node, model_parallel_size=mp)
    assert got == expected
    batch, valid, _ = expected
    if world in valid:  # what DeepSpeed's runtime asks: the world size given is checked against the valid list
        micro_batch = compute_elastic_config(_config(**section), VERSION, world_size=world)[2]
        assert micro_batch == max(m for m in micro if (batch // world) % m == 0)
    else:
        with pytest.raises(ElasticityIncompatibleWorldSize):
            compute_elastic_config(_config(**section), VERSION, world_size=world)
