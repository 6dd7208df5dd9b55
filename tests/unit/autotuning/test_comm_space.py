"""ZeRO-3 communication settings in the search space (conf/autotuning/comm.yaml): every trial records the
estimator's comm bytes per step, and they rank trials within ``tune.comm_tolerance`` of the best metric. The
recipe is composed for real (gpt_tune on 4 ranks), the memory gate is the real estimator; only the launch is
a fake that measures every configuration the same, or the unquantized ones 2% faster."""
from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from dsrun.autotuning import Tuner, build_space, settings_from, trial_rows
from dsrun.autotuning import study as study_module
from dsrun.autotuning.results import best_row
from dsrun.autotuning.trial import LaunchResult
from dsrun.cli.tune import Reporter, tune_and_report
from dsrun.compose import compose_runspec
from dsrun.estimate.comm_volume import step_comm_volume
from dsrun.estimate.runspec import build_recipe_model, inputs_from_runspec
from dsrun.runspec import resolve_run

ZP = "zero_optimization"
OVERRIDES = ["+recipe=gpt_tune", "autotuning=comm", "launcher.num_procs=4", f"tune.space.{ZP}.stage=[3]",
             "tune.space.train_micro_batch_size_per_gpu=[2]", "tune.memory_limit=64GiB", "tune.comm_tolerance=0",
             f"ds.{ZP}.stage3_param_persistence_threshold=0",  # every parameter gathered again for backward
             "ds.autotuning.tuner_type=gridsearch", "ds.autotuning.tuner_early_stopping=100"]
KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size", "mics_shard_size")


def _flag(command: list[str], key: str) -> str:
    return next(c.split("=", 1)[1] for c in command if c.lstrip("+").startswith(f"ds.{ZP}.{key}="))


def fake_launch(exp, timeout, env=None, on_start=None):
    """Throughput 100 samples/s, 102 without qwZ and qgZ."""
    for name in ("stdout.log", "stderr.log"):
        (exp.directory / name).write_text("")
    quantized = "true" in (_flag(exp.command, "zero_quantized_weights"), _flag(exp.command, "zero_quantized_gradients"))
    latency = 1000.0 * 8 / (100.0 if quantized else 102.0)
    worker = {"step_times_ms": [latency] * 5, "step_timers_ms": [None] * 5, "train_batch_size": 8,
              "world_size": 4, "step_flops": None}
    return LaunchResult(0, 0.1, worker_metrics=worker)


def test_comm_settings_are_tuned_and_each_trial_records_the_estimators_bytes(tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(study_module, "launch", fake_launch)
    cfg = compose_runspec(OVERRIDES, [])
    resolved = resolve_run(cfg)
    settings = settings_from(resolved.ds.autotuning, OmegaConf.to_container(cfg.ds.autotuning, resolve=True),
                             OmegaConf.to_container(cfg.tune, resolve=True), tmp_path)
    settings = replace(settings, model_info={"num_params": 1000})
    space = build_space(settings, resolved.ds_dict(), resolved.world_size)
    assert {f"{ZP}.{k}" for k in KEYS} <= set(space.dims) and space.size == 16

    composed_runs = {}

    def compose(overrides):
        """The recipe composed once, each trial's own overrides applied to a copy (Hydra's composition
        costs a second or more a trial; the tuner's recording is what this test checks)."""
        composed = copy.deepcopy(cfg)
        for text in (o for o in overrides if o not in OVERRIDES):
            key, value = text.lstrip("+").split("=", 1)
            OmegaConf.update(composed, key, yaml.safe_load(value), force_add=True)
        composed_runs[tuple(overrides)] = composed
        return composed, resolve_run(composed)

    tuner = Tuner(settings, space, OVERRIDES, [], compose)
    assert tune_and_report(tuner, Reporter(settings, space), run_best=False) == 0  # as dsrun tune runs it
    study = tuner.study
    assert "comm MB/step" in capsys.readouterr().out
    launched = [t for t in study.trials if t.user_attrs["kind"] == "launched"]
    invalid = [t for t in study.trials if t.user_attrs["kind"] == "invalid"]
    assert len(launched) == 12 and len(invalid) == 4  # hpZ with MiCS: refused as the engine refuses it
    assert all("cannot be combined" in t.user_attrs["error"] for t in invalid)

    model = None
    recorded = {}
    for t in launched:
        config = t.user_attrs["config"]
        composed = composed_runs[tuple(json.loads((settings.results_dir / t.user_attrs["exp_name"] / "exp.json")
                                             .read_text())["overrides"])]
        model = model or build_recipe_model(composed)
        expected = step_comm_volume(inputs_from_runspec(composed, model)[0]).to_dict()
        assert t.user_attrs["estimated_comm_per_step"] == expected
        exp = json.loads((settings.results_dir / t.user_attrs["exp_name"] / "exp.json").read_text())
        assert exp["comm_estimate_per_step"] == expected
        recorded[tuple(config[f"{ZP}.{k}"] for k in KEYS)] = expected

    # the figures differ as the settings do (4 ranks, fp32 gpt_tune)
    plain = recorded[(False, False, 1, -1)]
    qwz, qgz = recorded[(True, False, 1, -1)], recorded[(False, True, 1, -1)]
    hpz, mics = recorded[(False, False, 2, -1)], recorded[(False, False, 1, 2)]
    assert qwz["gather_bytes"] < 0.26 * plain["gather_bytes"] and qwz["gradient_bytes"] == plain["gradient_bytes"]
    assert qgz["gradient_op"] == "all_to_all_single" and qgz["gradient_bytes"] < 0.14 * plain["gradient_bytes"]
    assert hpz["gather_bytes"] == plain["gather_bytes"] and hpz["traffic_bytes"] < plain["traffic_bytes"]
    assert mics["replica_bytes"] > 0 == plain["replica_bytes"] and mics["traffic_bytes"] != plain["traffic_bytes"]
    assert len({json.dumps(v, sort_keys=True) for v in recorded.values()}) == len(recorded)

    # ranking: tolerance 0 keeps the measured best (an unquantized configuration, the fewest bytes among
    # those); within 5% the fewest bytes of all win
    least = min(recorded.values(), key=lambda v: v["traffic_bytes"])
    best = tuner.best_trial()
    assert best.value == max(t.value for t in launched)
    assert best.user_attrs["estimated_comm_per_step"]["traffic_bytes"] == min(
        t.user_attrs["estimated_comm_per_step"]["traffic_bytes"] for t in launched if t.value == best.value)
    rows = trial_rows(study)
    assert best_row(rows, settings).number == best.number
    loose = best_row(rows, replace(settings, comm_tolerance=0.05))
    assert loose.comm_bytes == least["traffic_bytes"] and loose.value < best.value
    summary = (settings.results_dir / "summary.txt").read_text()
    assert "comm_bytes_per_step" in summary and f"{least['traffic_bytes']:.6g}" in summary
