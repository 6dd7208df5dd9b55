"""Reads of DeepSpeed keys outside dsrun/config go through ``ds_section`` and keep their old behaviour where the
old read's default differed from the schema's."""
from __future__ import annotations

from pathlib import Path

from dsrun.autotuning.script import ALL_STAGES, space_mapping
from dsrun.autotuning.space import STAGE_KEY
from dsrun.comm.comm import comms_logger, configure
from dsrun.estimate.inputs import BufferSettings
from dsrun.precision.config import get_bfloat16_config, get_fp16_enabled
from dsrun.workloads.data_efficiency import prepare_ds_config


def test_an_unset_overlap_comm_stays_unset_for_the_estimator() -> None:
    assert BufferSettings.from_zero_config({}) == BufferSettings()
    assert BufferSettings.from_zero_config({"stage": 3}).overlap_comm is None
    assert BufferSettings.from_zero_config({"overlap_comm": False}).overlap_comm is False
    got = BufferSettings.from_zero_config({"reduce_bucket_size": 5e7, "offload_param": {"buffer_count": 7}})
    assert (got.reduce_bucket_size, got.offload_param_buffer_count) == (50_000_000, 7)


def test_a_script_stage_left_auto_is_tuned_over_every_stage() -> None:
    assert space_mapping({"zero_optimization": {"stage": "auto"}}, True) == {"space": {STAGE_KEY: ALL_STAGES}}
    assert space_mapping({}, True) == {"space": {STAGE_KEY: ALL_STAGES}}
    assert space_mapping({"zero_optimization": {"stage": 2}}, True) == {"space": {STAGE_KEY: [2]}}


def test_a_dict_config_overrides_only_the_comms_logger_keys_it_sets() -> None:
    saved = (comms_logger.enabled, comms_logger.verbose, comms_logger.prof_all, comms_logger.prof_ops,
             comms_logger.debug)
    try:
        configure(enabled=False, verbose=True, prof_all=False, prof_ops=["all_reduce"], debug=False)
        configure({"comms_logger": {"enabled": True}})
        assert (comms_logger.enabled, comms_logger.verbose, comms_logger.prof_all) == (True, True, False)
        assert comms_logger.prof_ops == ["all_reduce"]
    finally:
        configure(enabled=saved[0], verbose=saved[1], prof_all=saved[2], prof_ops=saved[3], debug=saved[4])


def test_precision_sections_take_the_legacy_bfloat16_name() -> None:
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    assert not get_bfloat16_config({}).enabled
    assert get_fp16_enabled({"fp16": {"enabled": True}})


def test_a_config_without_a_curriculum_is_not_prepared(tmp_path: Path) -> None:
    config = {"data_efficiency": {"enabled": True, "data_sampling": {"enabled": False}}}
    assert prepare_ds_config(config, None, 256, tmp_path) is config
