"""The table-driven corpus: invalid configs (``cases/invalid/*.json``, each case names the key paths its
problems must be reported at) and valid DeepSpeed-style configs (``cases/valid/*``)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dsrun.config import load_ds_config, read_config_source, validate_ds_config
from dsrun.config.support import NOT_IMPLEMENTED
from dsrun.utils.errors import EXIT_USAGE, ConfigError, UserError

CASES = Path(__file__).parent / "cases"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _invalid_cases() -> list:
    cases = []
    for path in sorted((CASES / "invalid").glob("*.json")):
        for case in json.loads(path.read_text()):
            cases.append(pytest.param(case, id=f"{path.stem}: {case['name']}"))
    return cases


INVALID = _invalid_cases()
VALID_FILES = sorted(p for p in (CASES / "valid").iterdir() if p.suffix in (".json", ".hjson", ".yaml", ".yml"))
# Valid configs whose batch arithmetic needs a particular world size (the data-parallel size: with
# elasticity v0.2's model_parallel_size 2, 16 GPUs are 8 data-parallel ranks).
WORLD_SIZES = {"elasticity_v01.json": 8, "elasticity_v02.json": 8, "zero3_offload_nvme.json": 8,
               "hf_zero3_resolved.json": 4, "onebit_adam_fp16.json": 4,
               "zero3_partial_offload_zeropp.json": 16}  # hpZ groups of 8 ranks cut a data group of 16


def _with_batch(config: dict) -> dict:
    elastic = isinstance(config.get("elasticity"), dict) and config["elasticity"].get("enabled")
    if any(k in config for k in BATCH_KEYS) or elastic:
        return config
    return {"train_micro_batch_size_per_gpu": 1, **config}


def _schema_only(config: dict) -> dict:
    """The corpus checks the schema and the rules; what dsrun does not implement is the support ledger's
    business (tests/unit/config/test_support_ledger.py), so its refusals are turned into warnings here."""
    return {**config, "dsrun_allow_unimplemented": True}


def _is_support_refusal(problem) -> bool:
    return NOT_IMPLEMENTED in problem.message


def test_corpus_size():
    sections = {case.values[0]["paths"][0].split(".")[0].split("[")[0] for case in INVALID}
    assert len(INVALID) >= 60
    assert len(VALID_FILES) >= 20
    for section in ("zero_optimization", "fp16", "bf16", "amp", "optimizer", "scheduler", "aio", "autotuning",
                    "flops_profiler", "activation_checkpointing", "sparse_attention", "data_efficiency",
                    "curriculum_learning", "tensorboard", "wandb", "comet", "csv_monitor", "mlflow", "elasticity",
                    "comms_logger", "compression_training", "checkpoint", "data_types", "progressive_layer_drop",
                    "eigenvalue", "pipeline", "train_batch_size", "gradient_clipping", "communication_data_type"):
        assert section in sections, f"no invalid case for {section}"


@pytest.mark.parametrize("case", INVALID)
def test_invalid_config_reports_key_path(case):
    config = _schema_only(_with_batch(case["config"]))
    world = case.get("world_size", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = validate_ds_config(config, world_size=world, path_prefix="ds")
        with pytest.raises(ConfigError) as err:
            load_ds_config(config, world_size=world, path_prefix="ds")
    expected = {f"ds.{p}" for p in case["paths"]}
    assert {p.path for p in problems} == expected, [str(p) for p in problems]
    assert {p.path for p in err.value.problems} == expected
    # what the CLI prints: one line per problem, starting with the key path; exit code 2 for a UserError
    assert isinstance(err.value, UserError) and EXIT_USAGE == 2
    for line, problem in zip(str(err.value).splitlines(), err.value.problems):
        assert line.startswith(problem.path + ": ")
        assert len(line) > len(problem.path) + 10


@pytest.mark.parametrize("path", VALID_FILES, ids=[p.name for p in VALID_FILES])
def test_valid_config_loads_and_round_trips(path):
    world = WORLD_SIZES.get(path.name, 1)
    raw = read_config_source(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # only what dsrun does not implement may stop a valid DeepSpeed config, never its schema or rules
        assert all(_is_support_refusal(p) for p in validate_ds_config(path, world_size=world))
        raw = _schema_only(raw)
        assert validate_ds_config(raw, world_size=world) == []
        cfg = load_ds_config(raw, world_size=world)
        ds = cfg.to_ds_dict()
        again = load_ds_config(ds, world_size=world)
    assert again.to_ds_dict() == ds
    assert again == cfg  # every setting, defaults included, survives the round trip
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world
    assert (again.train_batch_size, again.train_micro_batch_size_per_gpu, again.gradient_accumulation_steps) == (
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    if not cfg.elasticity.enabled:
        assert ds["train_batch_size"] == cfg.train_batch_size
    json.dumps(ds)  # plain JSON, loadable by DeepSpeed
