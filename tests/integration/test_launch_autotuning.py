"""``dsrun launch --autotuning tune|run SCRIPT ... --deepspeed ds_config.json`` (DeepSpeed's launcher flag) on a
user's script: 2 experiments (ZeRO-1, micro batch 1 and 2) of 2 steps each, DeepSpeed's results layout, then
``run`` trains the script with the best config. The experiments stop themselves: the engine writes
``autotuning.metric_path`` after ``end_profile_step`` and exits."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli

pytestmark = pytest.mark.slow  # three launches of a tiny script
SCRIPT = Path(__file__).with_name("_autotune_script.py")
CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
          "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2, "tuner_type": "gridsearch",
                         "num_tuning_micro_batch_sizes": 2, "tuner_num_trials": 4,
                         "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}}}


def _launch(tmp_path: Path, mode: str, config: dict) -> object:
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    return run_cli("launch", "--autotuning", mode, "--num_procs", "1", str(SCRIPT), "--deepspeed", "ds_config.json",
                   "--per_device_train_batch_size", "1", "--steps", "4", "--out", "trained.json",
                   cwd=tmp_path, timeout=420)


def test_autotuning_run_tunes_the_script_then_trains_the_best(tmp_path):
    done = _launch(tmp_path, "run", CONFIG)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    for name in ("z1_gas1_tmbspg1", "z1_gas1_tmbspg2"):
        metrics = json.loads((results / name / "metrics.json").read_text())
        assert metrics["throughput"] > 0 and metrics["train_batch_size"] == int(name[-1])
        measured = json.loads((results / name / "run" / "metrics.json").read_text())
        assert len(measured["step_times_ms"]) == 2  # the engine stopped at end_profile_step
        assert f"--per_device_train_batch_size {name[-1]}" in (results / name / "cmd.txt").read_text()
        assert (tmp_path / "autotuning_exps" / f"{name}.json").is_file()
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal and optimal["zero_optimization"]["stage"] == 1
    assert "Total number of experiments: 2." in (results / "summary.txt").read_text()
    command = (results / "cmd_optimal.txt").read_text()
    assert str(SCRIPT) in command and "ds_config_optimal.json" in command
    trained = json.loads((tmp_path / "trained.json").read_text())  # written only by the full run
    assert trained == {"steps": 4, "micro": optimal["train_micro_batch_size_per_gpu"], "stage": 1}


def test_refusals_are_one_line(tmp_path):
    no_config = run_cli("launch", "--autotuning", "tune", str(SCRIPT), cwd=tmp_path)
    assert no_config.returncode == 2 and "--deepspeed ds_config.json" in no_config.stderr
    slow = _launch(tmp_path, "tune", {**CONFIG, "autotuning": {**CONFIG["autotuning"], "fast": False}})
    assert slow.returncode == 2 and "autotuning.fast" in slow.stderr and "Traceback" not in slow.stderr
    off = _launch(tmp_path, "tune", {**CONFIG, "autotuning": {"enabled": False}})
    assert off.returncode == 2 and "autotuning.enabled" in off.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
