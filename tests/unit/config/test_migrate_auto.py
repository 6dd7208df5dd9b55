"""Legacy keys migrate with a warning (old+new together is an error); "auto" values resolve or drop."""
from __future__ import annotations

import pytest

from dsrun.config import LegacyConfigWarning, load_ds_config, validate_ds_config
from dsrun.utils.errors import ConfigError

MBS = {"train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize("legacy, check", [
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}},
     lambda c: c.zero_optimization.offload_optimizer.device == "cpu"),
    ({"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
     lambda c: c.zero_optimization.offload_param.device == "cpu"),
    ({"zero_optimization": {"stage": 3, "cpu_offload_params": True}},
     lambda c: c.zero_optimization.offload_param.device == "cpu"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
     lambda c: c.zero_optimization.stage3_gather_16bit_weights_on_model_save),
    ({"bfloat16": {"enabled": True}}, lambda c: c.bf16.enabled),
    ({"zero_optimization": True}, lambda c: c.zero_optimization.stage == 1),
    ({"zero_optimization": False}, lambda c: c.zero_optimization.stage == 0),
    ({"zero_optimization": True, "allgather_size": 1e7},
     lambda c: c.zero_optimization.allgather_bucket_size == 10_000_000),
    ({"fp32_allreduce": True}, lambda c: c.communication_data_type == "fp32"),
    ({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}},
     lambda c: c.zero_optimization.offload_optimizer.device == "none"),
])
def test_legacy_key_migrates_with_warning(legacy, check):
    with pytest.warns(LegacyConfigWarning):
        cfg = load_ds_config({**MBS, **legacy})
    assert check(cfg)
    # the written config uses only current keys, and loads again without warnings
    ds = cfg.to_ds_dict()
    for old in ("bfloat16", "cpu_offload", "cpu_offload_param", "cpu_offload_params", "allgather_size",
                "stage3_gather_fp16_weights_on_model_save", "fp32_allreduce", "cpu_offload_use_pin_memory"):
        assert old not in ds and old not in ds.get("zero_optimization", {})
    assert isinstance(ds.get("zero_optimization", {}), dict)
    assert validate_ds_config(ds) == []


def test_migration_warning_is_logged(caplog):
    with pytest.warns(LegacyConfigWarning):
        load_ds_config({**MBS, "bfloat16": {"enabled": True}})
    assert any("bfloat16" in r.getMessage() and "bf16" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("config, path", [
    ({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}, "bfloat16"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.cpu_offload"),
    ({"zero_optimization": {"stage": 3, "cpu_offload_param": True, "offload_param": {"device": "cpu"}}},
     "zero_optimization.cpu_offload_param"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                            "stage3_gather_16bit_weights_on_model_save": False}},
     "zero_optimization.stage3_gather_fp16_weights_on_model_save"),
    ({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}},
     "zero_optimization.prefetch_bucket_size"),
    ({"fp32_allreduce": True, "communication_data_type": "fp16"}, "fp32_allreduce"),
])
def test_old_and_new_together_is_an_error(config, path):
    problems = validate_ds_config({**MBS, **config})
    assert path in [p.path for p in problems]
    assert any("together with its replacement" in p.message for p in problems)


def test_unprefixed_stage3_names_are_accepted_as_deepspeed_does():
    cfg = load_ds_config({**MBS, "zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e6,
                                                       "max_live_parameters": 5}})
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 1_000_000
    assert cfg.zero_optimization.stage3_max_live_parameters == 5


def test_documented_prefer_large_batch_is_ignored_like_deepspeed():
    with pytest.warns(LegacyConfigWarning, match="prefer_larger_batch"):
        cfg = load_ds_config({"elasticity": {"enabled": True, "max_train_batch_size": 100,
                                             "micro_batch_sizes": [2, 4], "prefer_large_batch": False}})
    assert cfg.elasticity.prefer_larger_batch is True


HF_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True,
                          "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}

HF_VALUES = {
    "fp16.enabled": False, "bf16.enabled": True, "optimizer.params.lr": 3e-4,
    "optimizer.params.betas": [0.9, 0.95], "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.1,
    "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": 3e-4,
    "scheduler.params.warmup_num_steps": 100, "scheduler.params.total_num_steps": 1000,
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "zero_optimization.reduce_bucket_size": 4096 * 4096,
}


def test_hf_auto_config_resolves_from_auto_values():
    cfg = load_ds_config(HF_CONFIG, world_size=2, auto_values=HF_VALUES)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer.params["lr"] == 3e-4 and cfg.optimizer.params["betas"] == [0.9, 0.95]
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.gradient_clipping == 1.0
    assert cfg.zero_optimization.reduce_bucket_size == 4096 * 4096
    # dropped as DeepSpeed drops them: defaults apply
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True  # DeepSpeed 0.19's default
    ds = cfg.to_ds_dict()
    assert "auto" not in repr(ds)
    assert validate_ds_config(ds, world_size=2) == []


def test_unresolved_auto_values_are_named():
    problems = validate_ds_config(HF_CONFIG, world_size=2, path_prefix="ds")
    paths = {p.path for p in problems}
    for key in ("fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                "scheduler.params.total_num_steps", "gradient_clipping", "train_batch_size",
                "train_micro_batch_size_per_gpu"):
        assert f"ds.{key}" in paths, key
    # zero/offload "auto" values are dropped, never reported
    assert not any(p.startswith("ds.zero_optimization") for p in paths)
    assert all("auto" in p.message or "either" in p.message for p in problems)


def test_batch_auto_is_inferred_from_the_others():
    cfg = load_ds_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": 2}, world_size=3)
    assert cfg.train_batch_size == 24


def test_pipeline_stages_auto_is_a_real_value():
    cfg = load_ds_config({**MBS, "pipeline": {"stages": "auto"}})
    assert cfg.pipeline.stages == "auto"


def test_load_raises_listing_every_problem():
    with pytest.raises(ConfigError) as err:
        load_ds_config({**MBS, "fp16": {"enabled": "auto"}, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}})
    assert {p.path for p in err.value.problems} == {"fp16.enabled", "optimizer.params.lr"}
