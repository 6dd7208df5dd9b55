"""The batch triad: every combination of given keys, DeepSpeed's integer arithmetic, and clear errors."""
from __future__ import annotations

import pytest

from dsrun.config import load_ds_config, validate_ds_config
from dsrun.utils.errors import ConfigError

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@pytest.mark.parametrize("given, world, expected", [
    ({TBS: 64, MBS: 4, GAS: 2}, 8, (64, 4, 2)),        # all three
    ({TBS: 64, MBS: 4}, 8, (64, 4, 2)),                # gas = 64 // 4 // 8
    ({TBS: 64, GAS: 2}, 8, (64, 4, 2)),                # mbs = 64 // 8 // 2
    ({MBS: 4, GAS: 2}, 8, (64, 4, 2)),                 # tbs = 4 * 2 * 8
    ({TBS: 64}, 8, (64, 8, 1)),                        # gas = 1, mbs = 64 // 8
    ({MBS: 4}, 8, (32, 4, 1)),                         # gas = 1, tbs = 4 * 8
])
def test_any_two_give_the_third(given, world, expected):
    cfg = load_ds_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    assert f"world size {world}" in cfg.batch_explanation
    for key, value in zip((TBS, MBS, GAS), expected):
        assert f"{key} = {value}" in cfg.batch_explanation
    # the resolved dict carries all three, and re-validates at the same world size
    ds = cfg.to_ds_dict()
    assert (ds[TBS], ds[MBS], ds[GAS]) == expected
    assert validate_ds_config(ds, world_size=world) == []


def test_explanation_says_which_were_inferred_and_world_source():
    cfg = load_ds_config({TBS: 64, MBS: 4}, world_size=8, world_size_source="launcher plan (2 nodes x 4)")
    assert "train_batch_size = 64 (given)" in cfg.batch_explanation
    assert "inferred" in cfg.batch_explanation.splitlines()[2]
    assert "launcher plan (2 nodes x 4)" in cfg.batch_explanation
    assert cfg.world_size == 8 and cfg.world_size_source.startswith("launcher plan")


def test_inconsistent_triad_shows_arithmetic_and_world_source():
    with pytest.raises(ConfigError) as err:
        load_ds_config({TBS: 30, MBS: 4, GAS: 1}, world_size=4, world_size_source="--world-size",
                       path_prefix="ds")
    (problem,) = err.value.problems
    assert problem.path == "ds.train_batch_size"
    assert "30 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 1 * world size 4 = 16" in problem.message
    assert "--world-size" in problem.message
    assert "16 or 32" in problem.hint


def test_integer_division_then_equality_like_deepspeed():
    # 30 // 4 // 2 = 3 and 4 * 3 * 2 = 24 != 30: DeepSpeed's assert fails; dsrun says why.
    problems = validate_ds_config({TBS: 30, MBS: 4}, world_size=2)
    assert [p.path for p in problems] == [TBS]
    assert "gradient_accumulation_steps was inferred" in problems[0].message


def test_inferred_zero_is_an_error():
    problems = validate_ds_config({TBS: 4, MBS: 8}, world_size=1)
    assert [p.path for p in problems] == [GAS]
    assert "must be > 0" in problems[0].message


def test_neither_tbs_nor_mbs_is_an_error():
    problems = validate_ds_config({GAS: 4})
    assert [p.path for p in problems] == [TBS]
    assert "either" in problems[0].message


def test_zero_or_negative_given_value_is_an_error():
    problems = validate_ds_config({TBS: 0, MBS: -1})
    assert {p.path for p in problems} == {TBS, MBS}


def test_float_batch_is_accepted_when_integral():
    cfg = load_ds_config({TBS: 32.0, MBS: 4e0})
    assert cfg.train_batch_size == 32 and cfg.gradient_accumulation_steps == 8


def test_fractional_batch_is_an_error():
    problems = validate_ds_config({TBS: 32.5, MBS: 4})
    assert [p.path for p in problems] == [TBS]


def test_world_size_changes_the_answer():
    a = load_ds_config({TBS: 32, MBS: 2}, world_size=2)
    b = load_ds_config({TBS: 32, MBS: 2}, world_size=4)
    assert (a.gradient_accumulation_steps, b.gradient_accumulation_steps) == (8, 4)


def test_elastic_batch_v01_matches_the_published_search():
    # bases 2, 4, 6 and their lcm 12, each scaled by the largest highly composite number that fits 2000:
    # 2*840=1680, 4*360=1440, 6*240=1440, 12*120=1440; 1680 is valid for the most GPU counts.
    cfg = load_ds_config({"elasticity": {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
                                         "version": 0.1}}, world_size=8, world_size_source="launcher plan")
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (1680, 6, 35)
    assert "elasticity v0.1" in cfg.batch_explanation and "launcher plan" in cfg.batch_explanation
    assert "train_batch_size" not in cfg.to_ds_dict()


def test_elastic_batch_rejects_an_incompatible_world_size():
    problems = validate_ds_config({"elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [8],
                                                  "max_gpus": 8, "version": 0.1}}, world_size=7)
    assert [p.path for p in problems] == ["elasticity"]
    assert "valid GPU counts: [1, 2, 3, 6]" in problems[0].hint


def test_world_size_below_one_is_reported():
    problems = validate_ds_config({MBS: 2}, world_size=0, world_size_source="--world-size", path_prefix="ds")
    assert [p.path for p in problems] == ["world_size"] and "--world-size" in problems[0].message
