"""The pacing functions against DeepSpeed's formulas at every step of long tables, and their state round trips.

The reference values are written out here from the formulas DeepSpeed documents and implements
(config-json "curriculum_learning", the curriculum-learning tutorial, the PLD tutorial), independently of the
code under test; a few are also checked by hand.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from dsrun.data_efficiency import CurriculumScheduler, ProgressiveLayerDrop, RandomLTDScheduler
from dsrun.utils.errors import ConfigError


def reference_root(step: int, total: int, low: int, high: int, multiple: int, root: float) -> int:
    """DeepSpeed: floor(((s/T)**(1/r))·(max−min) + min), minus its remainder modulo difficulty_step, capped."""
    value = math.floor((float(step) / total) ** (1.0 / root) * (high - low) + low)
    return min(value - value % multiple, high)


def legacy(schedule_type: str, **schedule_config) -> CurriculumScheduler:
    return CurriculumScheduler({"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                "max_difficulty": 1024, "schedule_type": schedule_type,
                                "schedule_config": schedule_config})


@pytest.mark.parametrize("schedule_type,root", [("fixed_linear", 1), ("fixed_root", 2), ("fixed_root", 3)])
@pytest.mark.parametrize("difficulty_step", [1, 8, 24])
def test_fixed_linear_and_root_follow_deepspeed_at_every_step(schedule_type, root, difficulty_step):
    total = 15000
    config = {"total_curriculum_step": total, "difficulty_step": difficulty_step}
    if schedule_type == "fixed_root":
        config["root_degree"] = root
    scheduler = legacy(schedule_type, **config)
    for step in range(0, total + 200):
        expected = reference_root(step, total, 8, 1024, difficulty_step, root)
        assert scheduler.get_difficulty(step) == expected, step
        assert expected % difficulty_step == 0 or expected == 1024
    # update_difficulty follows the schedule until it reaches max_difficulty (with difficulty_step 24 that is
    # after total_curriculum_step: 1024 rounds down to 1008 there), then stays
    reached = False
    for step in range(1, 2 * total + 2, 97):
        got = scheduler.update_difficulty(step)
        assert got == (1024 if reached else reference_root(step, total, 8, 1024, difficulty_step, root))
        reached = reached or got == 1024
    assert reached


def test_hand_checked_values_and_difficulty_step_rounding():
    linear = legacy("fixed_linear", total_curriculum_step=15000, difficulty_step=8)
    assert linear.get_difficulty(0) == 8
    assert linear.get_difficulty(7500) == 512      # floor(0.5·1016 + 8) = 516 → 516 − 516 % 8 = 512
    assert linear.get_difficulty(118) == 8         # floor(118/15000·1016 + 8) = 15 → 8
    assert linear.get_difficulty(119) == 16        # floor(16.06) = 16
    root = legacy("fixed_root", total_curriculum_step=15000, difficulty_step=8, root_degree=2)
    assert root.get_difficulty(3750) == 512        # sqrt(0.25) = 0.5
    assert root.get_difficulty(15000) == 1024


def test_fixed_discrete_matches_the_tutorials_example():
    scheduler = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
                                     "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}})
    # "at step 1-5 difficulty 1 is used, at step 6-10 difficulty 2 is used, from step 11 difficulty 3 is used"
    assert [scheduler.get_difficulty(s) for s in range(1, 16)] == [1] * 5 + [2] * 5 + [3] * 5


def test_custom_schedule_needs_a_function_and_then_uses_it():
    scheduler = CurriculumScheduler({"min_difficulty": 4, "max_difficulty": 64, "schedule_type": "custom"})
    with pytest.raises(ConfigError, match="set_custom_curriculum_learning_schedule"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: min(64, 4 * step))
    assert [scheduler.update_difficulty(s) for s in (1, 2, 10, 20, 30)] == [4, 8, 40, 64, 64]


def test_missing_schedule_keys_are_named():
    with pytest.raises(ConfigError, match="schedule_config.root_degree"):
        legacy("fixed_root", total_curriculum_step=10, difficulty_step=8)


def test_curriculum_state_round_trip_continues_identically():
    first = legacy("fixed_root", total_curriculum_step=300, difficulty_step=8, root_degree=2)
    for step in range(1, 101):
        first.update_difficulty(step)
    state = first.state_dict()
    second = legacy("fixed_root", total_curriculum_step=300, difficulty_step=8, root_degree=2)
    second.load_state_dict(state)
    assert second.get_current_difficulty() == first.get_current_difficulty()
    assert [first.update_difficulty(s) for s in range(101, 400)] == [second.update_difficulty(s) for s in range(101, 400)]


def random_ltd(min_value=128, max_value=2048, require_steps=2000, seq_per_step=16, batch=8, total=24, ltd=22):
    return RandomLTDScheduler({"total_layer_num": total, "random_ltd_layer_num": ltd,
                               "random_ltd_schedule": {"min_value": min_value, "max_value": max_value,
                                                       "schedule_type": "fixed_linear",
                                                       "schedule_config": {"require_steps": require_steps,
                                                                           "seq_per_step": seq_per_step}}},
                              global_batch_size=batch)


def test_random_ltd_schedule_and_layer_tokens_follow_the_formula():
    scheduler = random_ltd()
    expected_tokens = 0
    for step in range(2300):
        for _ in range(3):  # gradient accumulation: several forwards per step count once
            scheduler.update_seq(step)
        kept = reference_root(step, 2000, 128, 2048, 16, 1)
        assert scheduler.get_current_seq() == kept, step
        expected_tokens += 8 * (kept * 22 + 2048 * 2)
        assert scheduler.state["consumed_layer_tokens"] == expected_tokens
    assert scheduler.get_current_seq() == 2048


def test_random_ltd_state_round_trip():
    first = random_ltd()
    for step in range(500):
        first.update_seq(step)
    second = random_ltd()
    second.load_state_dict(first.state_dict())
    for step in range(500, 900):
        first.update_seq(step)
        second.update_seq(step)
        assert second.state_dict() == first.state_dict()


def test_pld_theta_follows_the_paper_at_every_step():
    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.001)
    assert pld.get_theta() == 1.0 and pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    for step in range(0, 20000, 7):
        pld.update_state(step)
        assert pld.get_theta() == (1 - 0.5) * np.exp(-0.001 * step) + 0.5
    assert abs(pld.get_theta() - 0.5) < 1e-8
    other = ProgressiveLayerDrop(theta=0.5, gamma=0.001)
    other.load_state_dict(pld.state_dict())
    assert other.get_theta() == pld.get_theta()
