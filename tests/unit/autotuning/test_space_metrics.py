"""The search space (fast mode, names, overrides, batch sizes), settings checks, the profile-window metric and
DeepSpeed's summary table, without launching anything."""
from __future__ import annotations

from pathlib import Path

import pytest

from dsrun.autotuning import ProfileError, build_space, metric_value, parse_bytes, profile_metrics, settings_from
from dsrun.autotuning.results import pipe_table
from dsrun.config.misc import AutotuningConfig
from dsrun.utils.errors import UserError

SPACE = {"zero_optimization": {"stage": [0, 1, 2, 3], "overlap_comm": [True, False]},
         "train_micro_batch_size_per_gpu": [1, 2, 4], "data.seq_len": [32]}
BASE_DS = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}


def settings(space=SPACE, raw=None, **autotuning):
    return settings_from(AutotuningConfig(**autotuning), raw if raw is not None else {}, {"space": space},
                         Path("/tmp/x"))


def test_fast_mode_tunes_stage_and_micro_batch_only():
    space = build_space(settings(fast=True), BASE_DS, world_size=2)
    assert list(space.dims) == ["zero_optimization.stage", "train_micro_batch_size_per_gpu"]
    assert space.size == 12 and space.ignored == ("zero_optimization.overlap_comm", "data.seq_len")
    assert space.fixed == {}


def test_full_mode_names_overrides_and_global_batch():
    space = build_space(settings(fast=False), BASE_DS, world_size=2)
    assert space.size == 24 and space.fixed == {"data.seq_len": 32}
    config = space.config({"zero_optimization.stage": 2, "zero_optimization.overlap_comm": True,
                           "train_micro_batch_size_per_gpu": 4})
    assert space.experiment_name(config) == "z2_ocT_gas2_tmbspg4"  # DeepSpeed's z{s}_..._gas{g}_tmbspg{m}
    assert space.train_batch_size(config) == 4 * 2 * 2  # micro x the recipe's accumulation x ranks
    assert space.overrides(config, {"train_micro_batch_size_per_gpu": "--data.batch"}) == [
        "++data.seq_len=32", "++ds.zero_optimization.stage=2", "++ds.zero_optimization.overlap_comm=true",
        "++ds.train_micro_batch_size_per_gpu=4", "++ds.train_batch_size=16", "++data.batch=4"]
    assert space.tuning_space_of(config) == "z2"


def test_micro_batch_sizes_come_from_the_autotuning_section_when_the_space_has_none():
    s = settings({"zero_optimization.stage": [1, 2]}, num_tuning_micro_batch_sizes=4,
                 min_train_micro_batch_size_per_gpu=2, max_train_batch_size=24)
    space = build_space(s, BASE_DS, world_size=2)
    assert space.dims["train_micro_batch_size_per_gpu"] == [2, 4]  # 8 x gas 2 x 2 ranks > 24


def test_a_space_with_nothing_to_tune_is_refused():
    with pytest.raises(UserError, match="empty search space"):
        build_space(settings({"zero_optimization.stage": [1], "train_micro_batch_size_per_gpu": [4]}), BASE_DS, 1)
    with pytest.raises(UserError, match="fast mode tunes only"):
        build_space(settings({"zero_optimization.overlap_comm": [True, False],
                              "train_micro_batch_size_per_gpu": [4]}), BASE_DS, 1)


@pytest.mark.parametrize("tune, raw, message", [
    ({"space": SPACE, "memory": 1}, {}, "tune.memory: unknown key"),
    ({"space": {"x": []}}, {}, "tune.space.x: has no values"),
    ({"space": {"x": [[1]]}}, {}, "tune.space.x: got [1]"),
    ({"space": SPACE, "trial_timeout": -1}, {}, "tune.trial_timeout"),
    ({"space": SPACE, "memory_limit": "much"}, {}, "tune.memory_limit: got 'much'"),
    ({"space": SPACE}, {"enabled": False}, "ds.autotuning.enabled: is false"),
])
def test_settings_mistakes_name_the_key(tune, raw, message):
    with pytest.raises(UserError) as err:
        settings_from(AutotuningConfig(), raw, tune, Path("/tmp"))
    assert message in str(err.value.problems[0])


def test_sizes_and_resume_default():
    assert parse_bytes("2GiB", "k") == 2 * 2**30 and parse_bytes("500MB", "k") == 500_000_000
    assert parse_bytes(1e9, "k") == 10**9 and parse_bytes("1.5e3", "k") == 1500 and parse_bytes(None, "k") is None
    # DeepSpeed's code default is overwrite=True; dsrun resumes unless the user sets it
    assert settings().overwrite is False and settings(raw={"overwrite": True}).overwrite is True
    assert settings(metric="FLOPS").metric == "flops" and settings(metric="latency").direction == "minimize"


def _worker(timers=True, steps=5, tbs=8):
    return {"step_times_ms": [100.0, 50.0, 40.0, 44.0, 42.0][:steps],
            "step_timers_ms": [{"forward": 10.0 + i, "backward": 20.0, "step": 5.0} if timers else None
                               for i in range(steps)],
            "train_batch_size": tbs, "world_size": 2, "step_flops": 4.0e9, "micro_batch_size": 4,
            "gradient_accumulation_steps": 1}


def test_profile_window_uses_the_engine_timers():
    m = profile_metrics(_worker(), start=3, end=5)  # steps 3..5 = indices 2..4: forward 12, 13, 14
    assert m["fwd"] == pytest.approx(13.0) and m["bwd"] == 20.0 and m["step"] == 5.0
    assert m["latency"] == pytest.approx(38.0)
    assert m["throughput"] == pytest.approx(8 * 1000 / 38.0)
    assert m["FLOPS_per_gpu"] == pytest.approx(4.0e9 / 2 * 1000 / 38.0)
    assert m["step_latencies_ms"] == [40.0, 44.0, 42.0]
    assert metric_value(m, "latency") == pytest.approx(38.0) and metric_value(m, "flops") == m["FLOPS_per_gpu"]


def test_profile_window_falls_back_to_step_wall_time_and_checks_its_length():
    m = profile_metrics(_worker(timers=False), start=3, end=5)
    assert m["latency"] == pytest.approx(42.0) and m["latency_source"].startswith("step wall time")
    with pytest.raises(ProfileError, match="recorded 3 step"):
        profile_metrics(_worker(steps=3), start=3, end=5)
    with pytest.raises(ProfileError, match="FLOPs"):
        metric_value({**m, "FLOPS_per_gpu": None}, "flops")


def test_summary_table_is_tabulates_pipe_format():
    # DeepSpeed's summary.txt example, row for row
    text = pipe_table(["tuning_space", "num_experiments", "best_metric_val", "best_exp_name"],
                      [["z0", 4, 59.0229, "z0_gas1_tmbspg2"], ["global", 13, 87.3017, "z1_gas1_tmbspg3"]],
                      [False, True, True, False])
    assert text.splitlines() == [
        "| tuning_space | num_experiments | best_metric_val | best_exp_name   |",
        "| :----------- | --------------: | --------------: | :-------------- |",
        "| z0           |               4 |         59.0229 | z0_gas1_tmbspg2 |",
        "| global       |              13 |         87.3017 | z1_gas1_tmbspg3 |"]


def test_samplers_see_numbers_by_rank_and_other_values_as_categories():
    import optuna

    from dsrun.autotuning.study import make_sampler

    s = settings({"zero_optimization": {"stage": [3, 0, 1], "overlap_comm": [True, False]},
                  "train_micro_batch_size_per_gpu": [8, 2]}, fast=False, tuner_type="gridsearch")
    space = build_space(s, BASE_DS, 1)
    assert space.sampler_space() == {"zero_optimization.stage": [0, 1, 2], "zero_optimization.overlap_comm":
                                     [True, False], "train_micro_batch_size_per_gpu": [0, 1]}
    study = optuna.create_study(sampler=make_sampler(s, space))
    seen = []
    for _ in range(space.size):
        trial = study.ask()
        seen.append(space.suggest(trial))
        assert space.decode(trial.params) == seen[-1]
        study.tell(trial, 0.0)
    assert sorted(map(str, seen)) == sorted(map(str, space.grid()))  # every configuration, as values
