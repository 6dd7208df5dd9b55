"""The 1-bit optimizers through the command line: DeepSpeed's documented configs validate, a wrong stage or
backend name is one line with exit code 2, and the gpt_onebit recipe composes with each of the three."""
from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli

ONE_BIT_ADAM = {"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16,
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False,
                                                              "comm_backend_name": "nccl"}},
                "fp16": {"enabled": True}}


def test_deepspeeds_onebit_adam_config_validates(tmp_path) -> None:
    path = tmp_path / "onebit.json"
    path.write_text(json.dumps({**ONE_BIT_ADAM, "zero_optimization": {"stage": 1}}))
    result = run_cli("config", "--validate", str(path), "--world-size", "256")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("change, key", [
    ({"zero_optimization": {"stage": 2}}, "optimizer.type"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "gloo"}}}, "optimizer.params.comm_backend_name"),
])
def test_what_dsrun_cannot_do_is_one_line_with_exit_2(tmp_path, change, key) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**ONE_BIT_ADAM, **change}))
    result = run_cli("config", "--validate", str(path), "--world-size", "256")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}: "), result.stderr


@pytest.mark.parametrize("option, warmup_key", [("onebit_adam", "freeze_step"), ("zero_one_adam", "var_freeze_step"),
                                                ("onebit_lamb", "freeze_step")])
def test_the_recipe_composes_with_each_optimizer(option: str, warmup_key: str) -> None:
    result = run_cli("config", "--json", "+recipe=gpt_onebit", f"optimizer={option}")
    assert result.returncode == 0, result.stderr
    ds = json.loads(result.stdout)
    assert ds["optimizer"]["params"][warmup_key] == 100 and ds["zero_optimization"]["stage"] == 0
