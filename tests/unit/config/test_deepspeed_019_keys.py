"""Every key DeepSpeed 0.19 reads is known to dsrun's schema (directly or through a rename in migrate.py), so a
0.19 config is never refused as "unknown"; an unknown top-level key with no near match is ignored with one
warning line, as DeepSpeed ignores it, and a near miss stays an error with a suggestion."""
from __future__ import annotations

import logging
from pathlib import Path

from dsrun.config import load_ds_config, validate_ds_config
from dsrun.config.model import DSConfig
from dsrun.config.schema_keys import match_pattern, schema_keys

KEYS = [line.strip() for line in (Path(__file__).with_name("deepspeed_0_19_keys.txt")).read_text().splitlines()
        if line.strip() and not line.startswith("#")]
RENAMED = {"zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param",
           "zero_optimization.cpu_offload_use_pin_memory", "zero_optimization.stage3_gather_fp16_weights_on_model_save",
           "seq_parallel_communication_data_type", "aio.intra_op_parallelism"}


def test_every_deepspeed_019_key_is_in_the_schema():
    patterns = list(schema_keys(DSConfig))
    # a key is known as a leaf, under a leaf (an open dict) or as a section of leaves (weight_quantization's rules)
    unknown = [k for k in KEYS if k not in RENAMED and not any(
        match_pattern(".".join(k.split(".")[:n]), patterns) for n in range(1, k.count(".") + 2))
        and not any(p.startswith(k + ".") for p in patterns)]
    assert len(KEYS) > 200 and not unknown, unknown


def test_renamed_019_keys_load_as_their_dsrun_names():
    cfg = {"train_micro_batch_size_per_gpu": 1, "aio": {"intra_op_parallelism": 3},
           "seq_parallel_communication_data_type": "FP32"}
    loaded = load_ds_config(cfg)
    assert loaded.aio.thread_count == 3 and "seq_parallel_comm_data_type" in loaded.model_fields_set


def test_unknown_top_level_keys_warn_once_and_near_misses_stay_errors(caplog):
    with caplog.at_level(logging.WARNING, logger="dsrun.config"):
        problems = validate_ds_config({"train_micro_batch_size_per_gpu": 1, "cuda_visible_devices": "0,1",
                                       "my_launcher_note": 3, "zero_optimisation": {"stage": 1}})
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warned) == 1 and "'cuda_visible_devices'" in warned[0] and "'my_launcher_note'" in warned[0]
    assert [(p.path, p.hint) for p in problems] == [("zero_optimisation", "did you mean 'zero_optimization'?")]
