"""The study loop with the launch replaced by a deterministic fake: samplers, pruning, failures, duplicates,
early stopping and resuming an interrupted study. (tests/e2e/test_tune.py runs real launches.)"""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import optuna
import pytest

from dsrun.autotuning import Tuner, build_space, settings_from, trial_rows, write_results
from dsrun.autotuning import study as study_module
from dsrun.autotuning.memory import MemoryCheck
from dsrun.autotuning.trial import LaunchResult
from dsrun.config.misc import AutotuningConfig

SPACE = {"zero_optimization.stage": [0, 1, 3], "train_micro_batch_size_per_gpu": [1, 4, 8]}


def throughput(stage: int, mbs: int) -> float:
    return 100.0 * mbs / (1 + 0.1 * stage)


def _value(overrides, key):
    for text in overrides:
        if text.lstrip("+").startswith(f"ds.{key}="):
            return int(text.split("=")[1])
    raise KeyError(key)


class FakeGate:
    """Micro batch 8 does not fit."""

    def check(self, cfg):
        mbs = _value(cfg, "train_micro_batch_size_per_gpu")
        return MemoryCheck(mbs < 8, mbs * 2**20, 7 * 2**20, f"estimated {mbs} MiB vs limit 7 MiB", {})


def fake_compose(overrides):
    resolved = SimpleNamespace(ds_dict=lambda: {"train_micro_batch_size_per_gpu": _value(overrides,
                                                "train_micro_batch_size_per_gpu"), "autotuning": {}},
                               plan=SimpleNamespace(world_size=1, hosts={"localhost": [0]}, hostfile=None),
                               world_size=1)
    return list(overrides), resolved


def fake_launch(calls, crash_stage=None, flat=False):
    def launch(exp, timeout, env=None, on_start=None):
        overrides = exp.command
        stage, mbs = _value(overrides, "zero_optimization.stage"), _value(overrides, "train_micro_batch_size_per_gpu")
        calls.append((stage, mbs))
        for name in ("stdout.log", "stderr.log"):
            (exp.directory / name).write_text("")
        if stage == crash_stage:
            return LaunchResult(1, 0.1, error=f"exit code 1\nrank0:\nTraceback (most recent call last):\n"
                                f"  File \"model.py\", line 3\nRuntimeError: stage {stage} exploded")
        latency = 1000.0 * mbs / (100.0 * mbs if flat else throughput(stage, mbs))
        worker = {"step_times_ms": [latency] * 5, "step_timers_ms": [None] * 5, "train_batch_size": mbs,
                  "world_size": 1, "step_flops": None}
        return LaunchResult(0, 0.1, worker_metrics=worker)
    return launch


def make_tuner(tmp_path, monkeypatch, calls, crash_stage=None, flat=False, **autotuning):
    monkeypatch.setattr(study_module, "launch", fake_launch(calls, crash_stage, flat))
    at = AutotuningConfig(**{"tuner_early_stopping": 100, "results_dir": str(tmp_path / "results"),
                             "exps_dir": str(tmp_path / "exps"), "end_profile_step": 5, **autotuning})
    settings = settings_from(at, {}, {"space": SPACE}, tmp_path)
    settings = replace(settings, model_info={"num_params": 1000})
    space = build_space(settings, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}, 1)
    tuner = Tuner(settings, space, ["+recipe=x"], [], fake_compose)
    tuner.gate = FakeGate()
    return tuner


def states(study):
    return [(t.user_attrs.get("kind"), t.state.name) for t in study.trials]


def test_grid_search_decides_every_configuration_once(tmp_path, monkeypatch):
    calls = []
    tuner = make_tuner(tmp_path, monkeypatch, calls, crash_stage=3, tuner_type="gridsearch", tuner_num_trials=50)
    study = tuner.run()
    assert len(study.trials) == 9 and tuner.stop.text == "explored all 9 configurations"
    assert len(calls) == len(set(calls)) == 6  # micro batch 8 pruned before launch: 3 configurations
    rows = {r.name: r for r in trial_rows(study)}
    assert rows["z0_gas1_tmbspg8"].status == "pruned" and "limit 7 MiB" in rows["z0_gas1_tmbspg8"].note
    assert rows["z3_gas1_tmbspg4"].status == "failed"
    assert rows["z3_gas1_tmbspg4"].note == "RuntimeError: stage 3 exploded"
    best = tuner.best_trial()
    assert best.user_attrs["exp_name"] == "z0_gas1_tmbspg4" and best.value == pytest.approx(400.0)
    paths = write_results(tuner)
    summary = paths["summary"].read_text()
    assert "| global       |               6 |             400 | z0_gas1_tmbspg4 |" in summary
    assert "| z3           |               2 |                 |                 |" in summary
    assert "Traceback (most recent call last)" in summary.split("Failed experiments")[1]
    assert summary.rstrip().endswith("Total number of experiments: 6.")
    optimal = json.loads(paths["ds_config_optimal"].read_text())
    assert optimal == {"train_micro_batch_size_per_gpu": 4}  # the trial's config, autotuning block removed
    # the same command again: the study is complete, nothing is launched or added
    again = make_tuner(tmp_path, monkeypatch, calls, crash_stage=3, tuner_type="gridsearch", tuner_num_trials=50)
    assert len(again.run().trials) == 9 and len(calls) == 6


def test_model_based_never_launches_a_configuration_twice(tmp_path, monkeypatch):
    calls = []
    tuner = make_tuner(tmp_path, monkeypatch, calls, tuner_type="model_based", tuner_num_trials=7)
    study = tuner.run()
    assert len(calls) == len(set(calls))
    counted = [t for t in study.trials if t.user_attrs["kind"] in ("launched", "pruned")]
    assert len(counted) == 7  # duplicates are answered from the study and not counted
    assert all(t.user_attrs["duplicate_of"] is not None for t in study.trials if t.user_attrs["kind"] == "duplicate")
    assert all(t.user_attrs["config"]["train_micro_batch_size_per_gpu"] in (1, 4, 8) for t in study.trials)


def test_early_stopping_after_trials_without_improvement(tmp_path, monkeypatch):
    calls = []
    tuner = make_tuner(tmp_path, monkeypatch, calls, flat=True, tuner_type="random", tuner_num_trials=50,
                       tuner_early_stopping=2)  # every configuration measures the same: none improves
    study = tuner.run()
    launched = [t for t in study.trials if t.user_attrs["kind"] == "launched"]
    assert tuner.stop.text.startswith("early stopping: 2 launched trials without improvement")
    assert len(launched) == 3 and tuner.best_trial().number == launched[0].number


def test_an_interrupted_trial_is_marked_and_its_configuration_runs_again(tmp_path, monkeypatch):
    calls = []
    tuner = make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=3)
    tuner.run()
    # as if the tuner had been SIGKILLed during a fifth trial: it stays RUNNING in the database
    study = optuna.load_study(study_name="dsrun-tune", storage=f"sqlite:///{tuner.db_path}")
    done = {json.dumps(t.params, sort_keys=True) for t in study.trials}
    # the sampler's params are indices into the (ordered) values: stage 0,1,3 -> 0,1,2; micro batch 1,4 -> 0,1
    left = next(p for p in ({"zero_optimization.stage": s, "train_micro_batch_size_per_gpu": m}
                            for s in (0, 1, 2) for m in (0, 1)) if json.dumps(p, sort_keys=True) not in done)
    study.enqueue_trial(left)
    running = study.ask()
    for key in SPACE:
        running.suggest_int(key, 0, 2)
    first_calls = list(calls)
    again = make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=5)
    result = again.run()
    by_number = {t.number: t for t in result.trials}
    assert by_number[running.number].user_attrs["kind"] == "interrupted"
    assert by_number[running.number].state.name == "FAIL"
    retry = [t for t in result.trials if t.user_attrs.get("retry_of") == running.number]
    assert len(retry) == 1 and retry[0].params == left and retry[0].state.name == "COMPLETE"
    assert len(calls) == len(set(calls))  # nothing that had finished was launched again
    assert calls[:len(first_calls)] == first_calls
    counted = [t for t in result.trials if t.user_attrs["kind"] in ("launched", "pruned")]
    assert len(counted) == 5


def test_a_different_space_in_the_same_results_dir_is_refused_unless_overwrite(tmp_path, monkeypatch):
    calls = []
    make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=2).run()
    with pytest.raises(Exception, match="another search space or metric"):
        make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=2, metric="latency").run()
    tuner = make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=2, metric="latency")
    tuner.settings = replace(tuner.settings, overwrite=True)
    assert len(tuner.run().trials) == 2  # a fresh study


def test_one_tuner_per_results_dir(tmp_path, monkeypatch):
    import fcntl

    calls = []
    tuner = make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=1)
    (tmp_path / "results").mkdir()
    with open(tmp_path / "results" / ".lock", "w") as held:  # as if another dsrun tune were running
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(Exception, match="another dsrun tune is using"):
            tuner.run()
    assert len(tuner.run().trials) == 1  # free again once the other one is gone


def test_ctrl_c_marks_the_running_trial_interrupted_and_queues_it_again(tmp_path, monkeypatch):
    calls = []
    tuner = make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=3)
    real = study_module.launch

    def interrupted_launch(exp, timeout, env=None, on_start=None):
        if len(calls) == 1:  # the second launch is interrupted by Ctrl-C
            calls.append("interrupted")
            raise KeyboardInterrupt
        return real(exp, timeout, env, on_start)

    monkeypatch.setattr(study_module, "launch", interrupted_launch)
    with pytest.raises(KeyboardInterrupt):
        tuner.run()
    lost = [t for t in tuner.study.trials if t.user_attrs.get("kind") == "interrupted"]
    assert len(lost) == 1 and lost[0].state.name == "FAIL" and tuner.stop.text == "interrupted"
    again = make_tuner(tmp_path, monkeypatch, calls, tuner_type="gridsearch", tuner_num_trials=3)
    study = again.run()
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == lost[0].number]
    assert len(retry) == 1 and retry[0].params == lost[0].params and retry[0].state.name != "RUNNING"


def test_a_reader_polling_the_database_never_races_the_tuner_creating_it(tmp_path):
    """The database appears whole: a reader that opens it while the tuner starts (as the SIGKILL test and
    optuna-dashboard do) never stamps the schema concurrently with the tuner (UNIQUE alembic_version)."""
    import sqlite3
    import threading

    errors, stop = [], threading.Event()
    dbs = [tmp_path / f"r{i}" / "study.db" for i in range(15)]

    def poll():
        while not stop.is_set():
            for db in dbs:
                if db.is_file():
                    try:
                        optuna.load_study(study_name=study_module.STUDY_NAME, storage=f"sqlite:///{db}")
                    except KeyError:  # schema whole, study not created yet
                        pass
                    except Exception as error:  # noqa: BLE001 - any other failure is the race
                        errors.append(repr(error))

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    reader = threading.Thread(target=poll, daemon=True)
    reader.start()
    try:
        for db in dbs:
            db.parent.mkdir()
            study_module._new_storage(db)
            optuna.create_study(study_name=study_module.STUDY_NAME, storage=f"sqlite:///{db}", load_if_exists=True)
    finally:
        stop.set()
        reader.join(timeout=30)
    assert errors == []
    for db in dbs:
        assert sorted(p.name for p in db.parent.iterdir()) == ["study.db"]  # no partial file left behind
        with sqlite3.connect(db) as connection:
            assert len(connection.execute("SELECT version_num FROM alembic_version").fetchall()) == 1
