"""The 1-bit optimizers through the command line: DeepSpeed's documented configs validate; a wrong stage, backend
name or param, or params that break a rule between them, is one line with exit code 2; and the gpt_onebit recipe
composes with each of the three."""
from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli

ONE_BIT_ADAM = {"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16,
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False,
                                                              "comm_backend_name": "nccl"}},
                "fp16": {"enabled": True}}
# DeepSpeed's documented examples (docs/config-json: "Another example of optimizer with ...")
ZERO_ONE_ADAM = {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "weight_decay": 0.01, "bias_correction": False,
                                                   "var_freeze_step": 1000, "var_update_scaler": 16,
                                                   "local_step_scaler": 1000, "local_step_clipper": 16,
                                                   "cuda_aware": False, "comm_backend_name": "nccl"}}
ONE_BIT_LAMB = {"type": "OneBitLamb", "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False,
                                                 "max_coeff": 0.3, "min_coeff": 0.01, "freeze_step": 1000,
                                                 "cuda_aware": False, "comm_backend_name": "nccl", "coeff_beta": 0.9,
                                                 "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}}


@pytest.mark.parametrize("optimizer, stage", [(ONE_BIT_ADAM["optimizer"], 1), (ZERO_ONE_ADAM, 0), (ONE_BIT_LAMB, 1)])
def test_deepspeeds_documented_configs_validate(tmp_path, optimizer: dict, stage: int) -> None:
    path = tmp_path / "onebit.json"
    path.write_text(json.dumps({**ONE_BIT_ADAM, "optimizer": optimizer, "zero_optimization": {"stage": stage}}))
    result = run_cli("config", "--validate", str(path), "--world-size", "256")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("change, key", [
    ({"zero_optimization": {"stage": 2}}, "optimizer.type"),
    ({"optimizer": ZERO_ONE_ADAM, "zero_optimization": {"stage": 1}}, "optimizer.type"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "optimizer.type"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "gloo"}}}, "optimizer.params.comm_backend_name"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_steps": 10}}}, "optimizer.params.freeze_steps"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm"),
    ({"optimizer": {**ONE_BIT_LAMB, "params": {**ONE_BIT_LAMB["params"], "freeze_step": 5}}}, "optimizer.params.coeff_beta"),
    ({"optimizer": {**ONE_BIT_LAMB, "params": {**ONE_BIT_LAMB["params"], "min_coeff": 1.0}}}, "optimizer.params.min_coeff"),
    # what initialize refuses with a default on one side (coeff_beta 0.9): validate refuses it too
    ({"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 2}}}, "optimizer.params.coeff_beta"),
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
