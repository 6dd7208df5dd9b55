"""The ``elasticity`` section acting on a whole config: the batch triad ``load_ds_config`` resolves is the one
``compute_elastic_config`` gives for that world size, the global batch stays when the world shrinks (gradient
accumulation makes up for it), and every key of the section changes the outcome."""
from __future__ import annotations

import pytest

from dsrun.config import load_ds_config, validate_ds_config
from dsrun.elasticity import compute_elastic_config

BASE = {"enabled": True, "max_train_batch_size": 48, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4,
        "version": 0.1}


def _triad(section: dict, world: int, **top) -> tuple[int, int, int]:
    cfg = load_ds_config({"elasticity": section, **top}, world_size=world)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_same_global_batch_at_every_valid_world_size(world):
    batch, valid, micro = compute_elastic_config({"elasticity": BASE}, "0.14.1", world_size=world)
    assert world in valid
    assert _triad(BASE, world) == (batch, micro, batch // (micro * world)) == (48, 4, 12 // world)


def test_an_invalid_world_size_is_one_problem_naming_the_valid_ones():
    problems = validate_ds_config({"elasticity": dict(BASE, max_gpus=8)}, world_size=5, world_size_source="the plan")
    assert [p.path for p in problems] == ["elasticity"]
    assert "world size 5, from the plan" in problems[0].message and "valid GPU counts: [1, 2, 3, 4, 6, 8" \
        in problems[0].hint


SMALL = dict(BASE, micro_batch_sizes=[2, 3, 5], max_train_batch_size=30, max_gpus=8)


@pytest.mark.parametrize("base, key, value, world", [
    (SMALL, "max_train_batch_size", 60, 2),            # 24 -> 60
    (dict(SMALL, max_train_batch_size=60), "micro_batch_sizes", [2, 3], 2),   # 60 -> 48
    (SMALL, "min_gpus", 5, 6),                         # 24 -> 30, which suits 5 and 6 GPUs
    (SMALL, "max_gpus", 2, 2),                         # 24 -> 30, which suits 1 and 2 GPUs
    (dict(SMALL, max_train_batch_size=60), "prefer_larger_batch", False, 2),  # 60 -> 48 (a tie)
], ids=lambda v: v if isinstance(v, str) else "")
def test_each_key_changes_the_resolved_batch(base, key, value, world):
    changed = dict(base, **{key: value})
    assert _triad(changed, world) != _triad(base, world)
    for section in (base, changed):
        batch, _, micro = compute_elastic_config({"elasticity": section}, "0.14.1", world_size=world)
        assert _triad(section, world) == (batch, micro, batch // (micro * world))


def test_version_0_2_fits_a_world_size_version_0_1_refuses():
    assert [p.path for p in validate_ds_config({"elasticity": SMALL}, world_size=7)] == ["elasticity"]
    # 7 GPUs suit no candidate; v0.2 fits the batch to them: the largest multiple of 2 * 7 within 30
    assert _triad(dict(SMALL, version=0.2), 7) == (28, 2, 2)


def test_version_0_2_keys_change_the_resolved_batch():
    v02 = dict(SMALL, version=0.2)
    per_node = dict(v02, num_gpus_per_node=2)
    # searched per node of 2 GPUs, 3 GPUs (1.5 nodes) are no valid node count: the batch is fitted to them
    assert (_triad(v02, 3), _triad(per_node, 3)) == ((24, 2, 4), (30, 5, 2))
    # with model parallelism 2 each node is one data-parallel rank
    assert _triad(dict(per_node, model_parallel_size=2), 3) == (24, 2, 4)


def test_enabled_and_ignore_non_elastic_batch_info():
    top = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    assert _triad(dict(BASE, enabled=False), 2, **top) == (8, 2, 2)
    assert [p.path for p in validate_ds_config({"elasticity": BASE, **top}, world_size=2)] == [
        "train_batch_size", "train_micro_batch_size_per_gpu"]
    assert _triad(dict(BASE, ignore_non_elastic_batch_info=True), 2, **top) == _triad(BASE, 2)


def test_the_scheduler_section_must_match(monkeypatch):
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"max_train_batch_size": 64, "micro_batch_sizes": [2, 4], '
                                                      '"version": 0.1}')
    problems = validate_ds_config({"elasticity": BASE}, world_size=2)
    assert [p.path for p in problems] == ["elasticity"] and "max_train_batch_size=64" in problems[0].message
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"max_train_batch_size": 48, "micro_batch_sizes": [2, 4], '
                                                      '"version": 0.1}')
    assert validate_ds_config({"elasticity": BASE}, world_size=2) == []
