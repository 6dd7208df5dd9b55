"""The five DeepSpeed LR schedules against the values of api-inventory.md §2.4."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.optim.lr_schedules import (VALID_LR_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR,
                                        WarmupLR, build_lr_scheduler)
from dsrun.utils.errors import ConfigError


def _opt(lr: float = 0.1, cls: type = torch.optim.SGD) -> torch.optim.Optimizer:
    return cls([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        scheduler.step()
        out.append(scheduler.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_defaults() -> None:
    """No warmup_max_lr: the warm-up ends at the optimizer's lr (0.1 here), as DeepSpeed 0.19 does; 0.14
    ended at 0.001, 100x lower, silently."""
    lrs = _lrs(WarmupLR(_opt(0.1)), 1001)
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(0.01003433319, rel=1e-9)  # 0.1 * ln 2 / ln 1000
    assert lrs[9] == pytest.approx(0.1 / 3, rel=1e-9)
    assert lrs[99] == pytest.approx(0.2 / 3, rel=1e-9)
    assert lrs[998] == pytest.approx(0.09998551627, rel=1e-9)
    assert lrs[999] == lrs[1000] == 0.1


def test_warmup_lr_without_max_warms_each_group_to_its_own_lr() -> None:
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    sched = WarmupLR(opt, warmup_num_steps=10)
    assert sched.max_lrs == [0.1, 0.2]
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # the warm-up starts at warmup_min_lr
    sched.step(10)  # the end of the warm-up: gamma = 1
    assert sched.get_lr() == [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])
    # from a config too (scheduler.params without warmup_max_lr)
    sched = build_lr_scheduler("WarmupLR", _opt(0.3), {"warmup_num_steps": 4, "warmup_type": "linear"})
    assert _lrs(sched, 5) == pytest.approx([0.0, 0.075, 0.15, 0.225, 0.3])


def test_warmup_decay_lr_keeps_deepspeeds_0_001_default() -> None:
    """DeepSpeed 0.19's WarmupDecayLR passes its own default (0.001) on, so it does not inherit the lr."""
    sched = WarmupDecayLR(_opt(0.1), total_num_steps=20, warmup_num_steps=10, warmup_type="linear")
    assert sched.max_lrs == [0.001]
    assert _lrs(sched, 11)[10] == pytest.approx(0.001)


def test_warmup_lr_linear_then_constant() -> None:
    lrs = _lrs(WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"), 13)
    assert lrs == pytest.approx([0.01 * k for k in range(10)] + [0.1] * 3)


def test_warmup_decay_lr_linear() -> None:
    lrs = _lrs(WarmupDecayLR(_opt(), total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10,
                             warmup_type="linear"), 22)
    expected = [0.01 * k for k in range(10)] + [0.1 - 0.01 * i for i in range(11)] + [0.0]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_warmup_cosine_lr_stays_at_its_floor_past_total() -> None:
    lrs = _lrs(WarmupCosineLR(_opt(0.1), total_num_steps=20, warmup_num_steps=10, warmup_type="linear"), 25)
    assert lrs[:10] == pytest.approx([0.01 * k for k in range(10)])
    assert lrs[10] == pytest.approx(0.09755307053, rel=1e-9)
    assert lrs[14] == pytest.approx(0.050005, rel=1e-9)
    # from total_num_steps on: 0.1 * cos_min_ratio (DeepSpeed 0.14 rose again: 0.002456929468 at k = 20)
    assert lrs[19:] == pytest.approx([1e-05] * 6, rel=1e-9)


def test_warmup_cosine_lr_edge_cases_deepspeed_pins() -> None:
    # total == warmup: no decay window; no division by zero, every step after the warm-up at the floor
    sched = WarmupCosineLR(_opt(0.01), total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1)
    for k in range(10, 15):
        sched.step(k)
        assert sched.get_lr_ratio() == pytest.approx(0.1)
    # an unknown warmup_type warns and warms up as "log"
    with pytest.warns(UserWarning, match="using .log."):
        odd = WarmupCosineLR(_opt(), total_num_steps=100, warmup_num_steps=10, warmup_type="cosine")
    assert odd.warmup_type == "log"
    odd.step(1)
    assert odd.get_lr_ratio() == pytest.approx(math.log(2) / math.log(10))
    # linear: ratio k / n during the warm-up
    lin = WarmupCosineLR(_opt(), total_num_steps=100, warmup_num_steps=10, warmup_type="linear")
    for k in range(10):
        lin.step(k)
        assert lin.get_lr_ratio() == pytest.approx(k / 10)
    # every param group starts at 0 and warms up as a ratio of its own lr
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.0015},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.003}])
    sched = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    sched.step(1)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0015 * math.log(2) / math.log(10),
                                                                 0.003 * math.log(2) / math.log(10)])


def test_lr_range_test_continuous_and_staircase() -> None:
    opt = _opt(0.5)
    sched = LRRangeTest(opt, lr_range_test_min_lr=1e-3, lr_range_test_step_size=10)
    assert opt.param_groups[0]["lr"] == 1e-3  # set to min_lr on construction
    lrs = _lrs(sched, 20)
    assert lrs[0] == pytest.approx(0.0011) and lrs[9] == pytest.approx(0.002) and lrs[19] == pytest.approx(0.003)
    stairs = _lrs(LRRangeTest(_opt(), lr_range_test_min_lr=1e-3, lr_range_test_step_size=10,
                              lr_range_test_staircase=True), 10)
    assert stairs[0] == pytest.approx(0.001) and stairs[8] == pytest.approx(0.001) and stairs[9] == pytest.approx(0.002)


def test_one_cycle_lr_and_momentum() -> None:
    opt = _opt(cls=torch.optim.Adam)
    sched = OneCycle(opt, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=4)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    lrs, moms = [], []
    for _ in range(10):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
    assert lrs == pytest.approx([0.000325, 0.00055, 0.000775, 0.001, 0.000775, 0.00055, 0.000325, 0.0001,
                                 0.0001, 0.0001])
    assert moms[3] == pytest.approx(0.8) and moms[0] == pytest.approx(0.875) and moms[7] == pytest.approx(0.9)


def test_one_cycle_stair_counts_hold_lr_and_momentum_flat() -> None:
    """Two stairs over each 8-step half: scale floor(i * 2 / 8) / 2, i the steps from the cycle's nearer end."""
    opt = _opt(cls=torch.optim.Adam)
    sched = OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=8, cycle_first_stair_count=2)
    lrs, moms = [], []
    for _ in range(16):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
    scales = [0, 0, 0, 0.5, 0.5, 0.5, 0.5, 1, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 0]
    assert lrs == pytest.approx([0.001 + 0.009 * f for f in scales])
    assert moms == pytest.approx([0.9 - 0.1 * f for f in scales])
    # a count of 0 is the continuous schedule; a count equal to the half's length is too
    continuous = _lrs(OneCycle(_opt(cls=torch.optim.Adam), 0.001, 0.01, cycle_first_step_size=8), 16)
    assert len(set(continuous[:8])) == 8
    assert _lrs(OneCycle(_opt(cls=torch.optim.Adam), 0.001, 0.01, cycle_first_step_size=8,
                         cycle_first_stair_count=8), 16) == pytest.approx(continuous)


def test_one_cycle_stairs_of_an_asymmetric_cycle_keep_the_peak_and_their_own_half() -> None:
    def lrs(first: int, second: int) -> list[float]:
        return _lrs(OneCycle(_opt(cls=torch.optim.Adam), 0.001, 0.01, cycle_first_step_size=10,
                             cycle_second_step_size=21, cycle_first_stair_count=first,
                             cycle_second_stair_count=second), 31)
    continuous = lrs(0, 0)
    aligned = lrs(10, 21)  # one stair per step: the continuous schedule, the peak included
    assert aligned == pytest.approx(continuous) and aligned[9] == pytest.approx(0.01)
    first_only, second_only = lrs(2, 0), lrs(0, 3)
    assert first_only[:10] != pytest.approx(continuous[:10]) and first_only[10:] == pytest.approx(continuous[10:])
    assert second_only[:10] == pytest.approx(continuous[:10])
    assert second_only[10:30] != pytest.approx(continuous[10:30])


def test_one_cycle_decay_after_the_cycle() -> None:
    sched = OneCycle(_opt(cls=torch.optim.Adam), 1e-4, 1e-3, decay_lr_rate=0.5, cycle_first_step_size=2,
                     decay_step_size=1)
    lrs = _lrs(sched, 6)
    # k = 4, 5 are past the 4-step cycle: min_lr / (1 + 0.5 * (k - 4 + 1))
    assert lrs[4] == pytest.approx(1e-4 / 1.5) and lrs[5] == pytest.approx(1e-4 / 2.0)


def test_state_dict_round_trip_resumes_the_sequence() -> None:
    first = WarmupLR(_opt(), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    _lrs(first, 4)
    second = WarmupLR(_opt(), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    second.load_state_dict(first.state_dict())
    assert first.state_dict() == {"last_batch_iteration": 3}
    assert _lrs(second, 1) == pytest.approx([0.04]) and second.get_last_lr() == pytest.approx([0.04])


def test_build_from_config_names_and_errors() -> None:
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    sched = build_lr_scheduler("WarmupLR", _opt(), {"warmup_num_steps": 5})
    assert isinstance(sched, WarmupLR) and sched.warmup_num_steps == 5
    assert isinstance(build_lr_scheduler("StepLR", _opt(), {"step_size": 2}), torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ConfigError, match="WarmupLR"):
        build_lr_scheduler("WarmupLr", _opt(), {})
    with pytest.raises(ConfigError, match="scheduler.params"):
        build_lr_scheduler("WarmupLR", _opt(), {"warmup_steps": 5})
    with pytest.warns(UserWarning, match="using .log."):
        assert WarmupLR(_opt(), warmup_type="cosine").warmup_type == "log"


# --- issue 17: the first step's lr, DeepSpeed's argument checks, tensor lrs --------------------------------
FRESH = [(LRRangeTest, {"lr_range_test_min_lr": 1e-3}, 1e-3),
         (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10, "cycle_momentum": False},
          0.01),
         (WarmupLR, {"warmup_min_lr": 0.02, "warmup_num_steps": 10}, 0.02),
         (WarmupDecayLR, {"total_num_steps": 100, "warmup_min_lr": 0.02, "warmup_num_steps": 10}, 0.02),
         (WarmupCosineLR, {"total_num_steps": 100, "warmup_num_steps": 10}, 0.0)]


@pytest.mark.parametrize("cls, kwargs, first", FRESH, ids=[c[0].__name__ for c in FRESH])
def test_a_fresh_schedule_puts_its_first_value_into_the_optimizer(cls, kwargs, first) -> None:
    opt = _opt(0.1)
    sched = cls(opt, **kwargs)
    with pytest.warns(UserWarning) if cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR) else _no_warning():
        before = sched.get_lr()
    assert [g["lr"] for g in opt.param_groups] == before == pytest.approx([first])
    assert sched.get_last_lr() == before


@pytest.mark.parametrize("cls, kwargs, first", FRESH, ids=[c[0].__name__ for c in FRESH])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_tensor_lr_stays_the_same_tensor(cls, kwargs, first, shape) -> None:
    lr = torch.full(shape, 0.1, dtype=torch.float64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = cls(opt, **kwargs)
    assert opt.param_groups[0]["lr"] is lr and lr.shape == shape and lr.dtype == torch.float64
    assert lr.item() == pytest.approx(first)
    sched.step(1)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(sched.get_lr()[0])


@pytest.mark.parametrize("make", [
    lambda o: WarmupLR(o, warmup_num_steps=0), lambda o: WarmupLR(o, warmup_num_steps=-5),
    lambda o: WarmupLR(o, warmup_num_steps=None), lambda o: WarmupDecayLR(o, 100, warmup_num_steps=0),
    lambda o: WarmupCosineLR(o, 100, warmup_num_steps=-1), lambda o: LRRangeTest(o, lr_range_test_step_size=0),
    lambda o: LRRangeTest(o, lr_range_test_step_size=-5), lambda o: LRRangeTest(o, lr_range_test_step_size=2.5),
    lambda o: OneCycle(o, 0.001, 0.1, cycle_first_step_size=0),
    lambda o: OneCycle(o, 0.001, 0.1, cycle_first_step_size=-1),
    lambda o: OneCycle(o, 0.001, 0.1, cycle_first_step_size=100, cycle_second_step_size=-1),
    lambda o: OneCycle(o, [0.001, 0.002, 0.003], 0.1), lambda o: OneCycle(o, 0.001, 0.1, cycle_max_mom=[0.9, 0.95, 0.99]),
    lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.1, 0.2]), lambda o: LRRangeTest(o, lr_range_test_min_lr=[1e-3] * 3),
])
def test_constructors_reject_what_deepspeed_rejects(make) -> None:
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                            {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.1)
    with pytest.raises(ValueError):
        make(opt)


def test_one_cycle_takes_per_group_lists_and_a_zero_second_half() -> None:
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}], betas=(0.9, 0.99))
    OneCycle(opt, [0.001, 0.002], [0.01, 0.02], cycle_min_mom=[0.8, 0.85], cycle_first_step_size=5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.001, 0.002])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.85])
    assert OneCycle(_opt(cls=torch.optim.Adam), 0.001, 0.1, cycle_first_step_size=100,
                    cycle_second_step_size=0).step_ratio == 1.0


def test_config_errors_name_the_params() -> None:
    with pytest.raises(ConfigError, match="warmup_num_steps must be a positive integer"):
        build_lr_scheduler("WarmupLR", _opt(), {"warmup_num_steps": 0})


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def guard():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    return guard()
