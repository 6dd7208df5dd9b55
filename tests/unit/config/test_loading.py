"""Reading DeepSpeed configs in every accepted form, and the errors for unreadable ones."""
from __future__ import annotations

import base64
import json

import pytest

from dsrun.config import load_ds_config, read_config_source, validate_ds_config
from dsrun.utils.errors import ConfigError, UserError

BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}


def test_dict_source():
    cfg = load_ds_config(BASE)
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)


def test_json_file_and_text(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE))
    assert load_ds_config(path).train_batch_size == 2
    assert load_ds_config(str(path)).train_batch_size == 2
    assert load_ds_config(json.dumps(BASE)).train_batch_size == 2


def test_hjson_file_with_comments_and_unquoted_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{\n  # micro batch\n  train_micro_batch_size_per_gpu: 4\n  fp16: {enabled: true},\n}\n")
    cfg = load_ds_config(path)
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.fp16.enabled


def test_yaml_file(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("train_batch_size: 16\ngradient_accumulation_steps: 2\nbf16:\n  enabled: true\n")
    cfg = load_ds_config(path, world_size=4)
    assert cfg.train_micro_batch_size_per_gpu == 2 and cfg.bf16.enabled


def test_base64_source():
    encoded = base64.b64encode(json.dumps(BASE).encode()).decode()
    assert load_ds_config(encoded).zero_optimization.stage == 2


@pytest.mark.parametrize("text", [
    '{"train_batch_size": 8, "train_batch_size": 16}',
    '{"fp16": {"enabled": true, "enabled": false}, "train_batch_size": 8}',
])
def test_duplicate_json_keys_are_an_error(text, tmp_path):
    with pytest.raises(ConfigError, match="duplicate keys"):
        read_config_source(text)
    path = tmp_path / "dup.json"
    path.write_text(text)
    problems = validate_ds_config(path)
    assert len(problems) == 1 and problems[0].path == str(path) and "duplicate" in problems[0].message


def test_duplicate_yaml_keys_are_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train_batch_size: 8\ntrain_batch_size: 16\n")
    with pytest.raises(ConfigError, match="duplicate keys"):
        read_config_source(path)


def test_duplicate_keys_in_base64_json():
    encoded = base64.b64encode(b'{"steps_per_print": 1, "steps_per_print": 2}').decode()
    with pytest.raises(ConfigError, match="duplicate keys"):
        read_config_source(encoded)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as err:
        load_ds_config(missing)
    assert err.value.problems[0].path == str(missing)
    assert "not found" in err.value.problems[0].message


def test_malformed_json_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": [1, }')
    problems = validate_ds_config(path)
    assert problems and problems[0].path == str(path)


def test_malformed_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train_batch_size: [1\n")
    problems = validate_ds_config(path)
    assert problems and problems[0].path == str(path) and "YAML" in problems[0].message


def test_non_object_is_an_error(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        read_config_source(path)


def test_garbage_string_is_an_error():
    with pytest.raises(ConfigError, match="neither an existing file"):
        read_config_source("not a config")


def test_config_error_is_a_user_error_and_value_error():
    with pytest.raises(UserError) as err:
        load_ds_config({"train_batch_size": 0})
    assert isinstance(err.value, ValueError)


def test_omegaconf_dictconfig_source():
    from omegaconf import OmegaConf

    cfg = load_ds_config(OmegaConf.create({"train_micro_batch_size_per_gpu": 3, "fp16": {"enabled": True}}))
    assert cfg.train_batch_size == 3 and cfg.fp16.enabled
