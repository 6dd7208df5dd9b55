"""Schema behaviour: DeepSpeed-behaviour defaults (config-keys.md §6 D1-D13), messages and hints, derived
values, notes, and the resolved dict."""
from __future__ import annotations

import json
import re

import pytest

from dsrun.config import DSConfig, load_ds_config, validate_ds_config
from dsrun.utils.errors import ConfigError

MBS = {"train_micro_batch_size_per_gpu": 1}


def load(extra: dict, **kwargs) -> DSConfig:
    return load_ds_config({**MBS, **extra}, **kwargs)


def test_deepspeed_behaviour_defaults():
    cfg = load({"sparse_attention": {}, "compression_training": {}})
    assert cfg.gradient_clipping == 1.0                                              # D1
    assert cfg.communication_data_type is None                                       # D2
    assert (cfg.fp16.initial_scale_power, cfg.fp16.min_loss_scale) == (16, 1.0)      # D3
    z = cfg.zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.sub_group_size) == (50_000_000, 1_000_000_000)  # D4
    assert z.overlap_comm is False                                                   # D5 (stage 0)
    assert (z.offload_optimizer.device, z.offload_param.device) == ("none", "none")  # D6
    assert z.offload_param.nvme_path is None
    assert z.offload_param.pin_memory is z.offload_optimizer.pin_memory is True      # DeepSpeed 0.19 (0.14: False)
    assert cfg.steps_per_print is None                                               # DeepSpeed 0.19 (0.14: 10)
    at = cfg.autotuning
    assert (at.overwrite, at.tuner_type, at.metric) == (True, "gridsearch", "throughput")  # D7
    assert cfg.tensorboard.output_path == "" and cfg.csv_monitor.output_path == ""   # D8
    assert cfg.elasticity.prefer_larger_batch is True                                # D9
    c = cfg.compression_training
    assert c.weight_quantization.shared_parameters.schedule_offset == 0              # D10
    assert c.activation_quantization.shared_parameters.schedule_offset == 1000
    assert c.sparse_pruning.shared_parameters.schedule_offset == 1000
    assert c.activation_quantization.shared_parameters.range_calibration == "dynamic"
    assert cfg.sparse_attention.num_different_global_patterns == 1                   # D11
    assert z.stage3_param_persistence_threshold == 100_000                           # D12
    assert z.ignore_unused_parameters is True                                        # D13


def test_overlap_comm_defaults_on_at_stage3_only_and_is_not_written():
    assert load({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    assert load({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm is False
    assert "overlap_comm" not in load({"zero_optimization": {"stage": 3}}).to_ds_dict()["zero_optimization"]


def test_compression_group_modules_default_to_all():
    cfg = load({"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}}}}}})
    assert cfg.compression_training.weight_quantization.different_groups["wq1"].modules == ["*"]


def test_sizes_written_as_floats_become_ints():
    cfg = load({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_max_live_parameters": 1e9,
                                      "sub_group_size": 1e12}})
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_max_live_parameters, z.sub_group_size) == (500_000_000, 10**9, 10**12)
    assert all(isinstance(v, int) for v in (z.reduce_bucket_size, z.sub_group_size))
    assert json.loads(json.dumps(cfg.to_ds_dict()))["zero_optimization"]["reduce_bucket_size"] == 500000000


def test_unknown_key_hints_at_every_level():
    problems = validate_ds_config({**MBS,
        "steps_per_prnt": 5,
        "zero_optimization": {"stgae": 2, "offload_optimizer": {"device": "cpu", "pin_mem": True}},
        "compression_training": {"weight_quantization": {"different_groups": {"g": {"params": {"start_bit": 4}}}}},
        "data_efficiency": {"data_sampling": {"curriculum_learning": {"curriculum_metrics": {"seqlen": {"min_dificulty": 1}}}}},
    }, path_prefix="ds")
    hints = {p.path: p.hint for p in problems}
    assert hints["ds.steps_per_prnt"] == "did you mean 'steps_per_print'?"
    assert hints["ds.zero_optimization.stgae"] == "did you mean 'stage'?"
    assert hints["ds.zero_optimization.offload_optimizer.pin_mem"] == "did you mean 'pin_memory'?"
    assert hints["ds.compression_training.weight_quantization.different_groups.g.params.start_bit"] == \
        "did you mean 'start_bits'?"
    assert hints["ds.data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen.min_dificulty"] == \
        "did you mean 'min_difficulty'?"


def test_unknown_key_without_close_match_lists_allowed_keys():
    (problem,) = validate_ds_config({**MBS, "aio": {"zzz": 1}})
    assert problem.path == "aio.zzz" and "block_size" in problem.hint and "queue_depth" in problem.hint


def test_bad_value_message_shows_value_and_allowed():
    (problem,) = validate_ds_config({**MBS, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})
    assert problem.path == "zero_optimization.offload_param.device"
    assert "'gpu'" in problem.message and "'cpu'" in problem.message and "'nvme'" in problem.message
    assert problem.hint == "did you mean 'cpu'?"
    (stage,) = validate_ds_config({**MBS, "zero_optimization": {"stage": 4}})
    assert "got 4" in stage.message and "3" in stage.message


def test_every_problem_is_listed_at_once():
    problems = validate_ds_config({
        "train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
        "fp16": {"enabled": True}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
        "optimizer": {"type": "OneBitAdam"},
        "scheduler": {"type": "WarmupDecayLR"},
        "autotuning": {"enabled": True, "start_profile_step": 9, "end_profile_step": 1},
        "tensorboard": {"enabeld": True},
    }, world_size=2)
    assert {p.path for p in problems} == {
        "train_batch_size", "bf16.enabled", "zero_optimization.offload_param.device", "optimizer.type",
        "scheduler.params.total_num_steps", "autotuning.end_profile_step", "tensorboard.enabeld"}


def test_case_insensitive_enums_are_normalised():
    cfg = load({"communication_data_type": "BF16", "checkpoint": {"tag_validation": "FAIL"},
                "autotuning": {"metric": "Latency", "tuner_type": "RANDOM"}})
    assert cfg.communication_data_type == "bf16"
    assert cfg.checkpoint.tag_validation == "Fail"
    assert (cfg.autotuning.metric, cfg.autotuning.tuner_type) == ("latency", "random")


def test_optimizer_names_are_case_insensitive_and_torch_names_accepted():
    assert load({"optimizer": {"type": "adamw"}}).optimizer.name == "adamw"
    assert load({"optimizer": {"type": "RMSprop", "params": {"lr": 0.01}}}).optimizer.type == "RMSprop"
    (problem,) = validate_ds_config({**MBS, "optimizer": {"type": "Adma"}})
    assert problem.path == "optimizer.type" and problem.hint == "did you mean 'Adam'?"


def test_untested_optimizer_with_zero_allowed_by_flag():
    assert validate_ds_config({**MBS, "optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 1},
                               "zero_allow_untested_optimizer": True}) == []


def test_torch_scheduler_name_accepted():
    assert load({"scheduler": {"type": "CosineAnnealingLR", "params": {"T_max": 10}}}).scheduler.type == "CosineAnnealingLR"


def test_flops_profiler_turns_on_wall_clock_breakdown_without_writing_it():
    cfg = load({"flops_profiler": {"enabled": True}})
    assert cfg.wall_clock_breakdown is True
    assert "wall_clock_breakdown" not in cfg.to_ds_dict()


@pytest.mark.parametrize("extra, comm, accum", [
    ({}, "fp32", "fp32"),
    ({"fp16": {"enabled": True}}, "fp16", "fp16"),
    ({"bf16": {"enabled": True}}, "bf16", "fp32"),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, "bf16", "bf16"),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "bf16"},
      "zero_optimization": {"stage": 2}}, "fp32", "bf16"),
])
def test_resolved_dtypes_follow_deepspeed(extra, comm, accum):
    cfg = load({**extra, "dsrun_allow_unimplemented": True})  # dsrun refuses an accumulation dtype it lacks
    assert cfg.resolved_communication_data_type == comm
    assert cfg.resolved_grad_accum_dtype == accum


def test_notes_for_keys_without_effect():
    cfg = load({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 10, "grad_hooks": False,
                                      "zero_quantized_weights": True},
                "aio": {"block_size": 4096}})
    notes = "\n".join(cfg.warnings)
    assert "stage3_max_live_parameters only matter at stage 3" in notes
    assert "zero_quantized_weights (ZeRO++) only matter at stage 3" in notes
    assert "grad_hooks only matters at stage 1" in notes
    assert "aio only matters with NVMe offload" in notes
    at_stage3 = "\n".join(load({"zero_optimization": {"stage": 3, "parameter_alignment": True}}).warnings)
    assert "parameter_alignment only matters at stages 1-2" in at_stage3


@pytest.mark.parametrize("zero, message", [
    ({"zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}, "error feedback for qgZ's quantized gradients"),
    ({"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 1.0}}, "err_beta: must be a number in [0, 1)"),
    ({"zero_quantized_gradients": True, "zeropp_loco_param": {"reset_T": 0}}, "reset_T: must be a positive"),
    ({"zero_quantized_gradients": True, "zeropp_loco_param": {"beta": 0.5}}, "zeropp_loco_param.beta: is not a LoCo"),
])
def test_loco_needs_qgz_and_its_two_settings(zero, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load({"zero_optimization": {"stage": 3, **zero}})
    load({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {}}})


def test_to_ds_dict_keeps_only_set_keys_and_omits_grad_hooks():
    cfg = load({"zero_optimization": {"stage": 1, "grad_hooks": False}, "fp16": {"enabled": True}})
    ds = cfg.to_ds_dict()
    assert ds == {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 1}, "fp16": {"enabled": True}} or (
        set(ds) == {"train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                    "zero_optimization", "fp16"} and ds["zero_optimization"] == {"stage": 1})
    assert "mlflow" not in ds


def test_amp_extras_pass_through():
    cfg = load({"amp": {"enabled": True, "opt_level": "O2", "loss_scale": 128.0}, "dsrun_allow_unimplemented": True})
    assert cfg.amp.params == {"opt_level": "O2", "loss_scale": 128.0}
    assert cfg.to_ds_dict()["amp"] == {"enabled": True, "opt_level": "O2", "loss_scale": 128.0}


def test_config_object_is_accepted_as_source():
    cfg = load({"zero_optimization": {"stage": 2}})
    again = load_ds_config(cfg, world_size=1)
    assert again.to_ds_dict() == cfg.to_ds_dict()


def test_validate_never_raises_for_bad_input():
    assert validate_ds_config(["not", "a", "config"])  # type: ignore[arg-type]
    assert validate_ds_config({"zero_optimization": [1, 2]})


def test_disabled_sections_are_not_cross_checked_as_deepspeed_skips_them():
    # DeepSpeed reads these only when enabled; a half-written disabled section is not an error.
    assert validate_ds_config({**MBS,
        "elasticity": {"enabled": False, "version": 0.3},
        "autotuning": {"enabled": False, "start_profile_step": 9, "end_profile_step": 1},
        "comet": {"enabled": False, "mode": "get"},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": True},
        "compression_training": {"weight_quantization": {"different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 8}}}}},
    }) == []


@pytest.mark.parametrize("extra, path, text", [
    ({"pipeline": {"stages": 0}}, "pipeline.stages", "got 0; allowed: greater than or equal to 1, or 'auto'"),
    ({"prescale_gradients": "x"}, "prescale_gradients", "got 'x'; allowed: true or false"),
    ({"fp16": {"initial_scale_power": 15.5}}, "fp16.initial_scale_power", "got 15.5; allowed: a whole number"),
    ({"comms_logger": {"prof_ops": "all_reduce"}}, "comms_logger.prof_ops", "got 'all_reduce'; allowed: a list"),
    ({"bfloat16": {"enabled": True}, "bf16": {}}, "bfloat16", "deprecated key given together with its replacement 'bf16'"),
])
def test_one_plain_line_per_problem(extra, path, text):
    (problem,) = validate_ds_config({**MBS, **extra})
    assert problem.path == path and problem.message == text


def test_null_offload_sections_mean_no_offload():
    cfg = load({"zero_optimization": {"stage": 3, "offload_param": None, "offload_optimizer": None}})
    assert cfg.zero_optimization.offload_param.device == "none"
    assert cfg.zero_optimization.offload_optimizer.device == "none"
