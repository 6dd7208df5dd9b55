"""The sinks write what DeepSpeed's would, and a user can read it back with each tool's own reader."""
from __future__ import annotations

import sys
import types

import pytest

from dsrun.config import load_ds_config
from dsrun.monitor import MonitorMaster
from dsrun.monitor.csv_monitor import CSVMonitor, csv_file_name
from dsrun.utils.errors import ConfigError

EVENTS = [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 1e-3, 8),
          ("Train/Samples/train_loss", 2.25, 16), ("Time per step", 0.125, 16)]


def test_csv_names_headers_and_rows_follow_deepspeed(tmp_path):
    monitor = CSVMonitor(tmp_path, "job")
    monitor.write_events(EVENTS)
    monitor.flush()
    assert csv_file_name("Train/Samples/train_loss") == "Train_Samples_train_loss.csv"
    loss = (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert loss == ["step,train_loss", "8,2.5", "16,2.25"]
    assert (tmp_path / "job" / "Time_per_step.csv").read_text().splitlines() == ["step,Time per step", "16,0.125"]
    # appended, header once: a resumed run continues the same file
    monitor.write_events([("Train/Samples/train_loss", 2.0, 24)])
    monitor.close()
    assert (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text().splitlines()[-2:] == ["16,2.25", "24,2.0"]


def test_monitor_master_fans_out_from_a_writer_thread_and_only_on_rank_0(tmp_path):
    cfg = load_ds_config({"train_batch_size": 8, "csv_monitor": {"enabled": True, "job_name": "j"},
                          "tensorboard": {"enabled": True, "job_name": "j"}})
    master = MonitorMaster(cfg, rank=0, default_output_dir=str(tmp_path))
    master.write_events(EVENTS)
    master.flush()
    assert (tmp_path / "j" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "8,0.001"]
    master.close()
    assert not master.errors

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "j"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Train/Samples/train_loss")] == [(8, 2.5), (16, 2.25)]
    assert set(acc.Tags()["scalars"]) == {"Train/Samples/train_loss", "Train/Samples/lr", "Time per step"}

    other = MonitorMaster(cfg, rank=1, default_output_dir=str(tmp_path / "rank1"))
    other.write_events(EVENTS)
    other.close()
    assert not other.enabled and not (tmp_path / "rank1").exists()


def test_closing_before_a_slow_sink_has_started_says_what_it_waits_for(tmp_path, monkeypatch, capsys):
    """A short run's rank 0 waited at its end, silently, for the writer thread still importing MLflow and
    opening its store (10 s and more on a busy machine): close() says what it waits for; once the sinks are
    up, closing says nothing."""
    import threading

    from dsrun.monitor import master as master_module

    release, real = threading.Event(), master_module.build_sink
    monkeypatch.setattr(master_module, "build_sink", lambda *a, **k: (release.wait(60), real(*a, **k))[1])
    cfg = load_ds_config({"train_batch_size": 8, "csv_monitor": {"enabled": True, "job_name": "j"}})
    slow = MonitorMaster(cfg, rank=0, default_output_dir=str(tmp_path / "a"))
    slow.write_events(EVENTS)
    slow.close(timeout=0.1)  # the sink is not built yet: the writer waits on `release`
    assert "closing the monitors: waiting for csv_monitor to start" in capsys.readouterr().err
    release.set()
    slow._thread.join(60)
    assert (tmp_path / "a" / "j" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "8,0.001"]

    started = MonitorMaster(cfg, rank=0, default_output_dir=str(tmp_path / "b"))
    started.flush()  # returns once the writer has built the sinks and written
    started.close()
    assert capsys.readouterr().err == ""


def test_output_path_in_the_config_wins_over_the_default(tmp_path):
    cfg = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "mine"), "job_name": "x"}}
    master = MonitorMaster(cfg, rank=0, default_output_dir=str(tmp_path / "run"), background=False)
    master.write_events([("a/b", 1.0, 1)])
    master.close()
    assert (tmp_path / "mine" / "x" / "a_b.csv").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("section,package", [("wandb", "wandb"), ("comet", "comet_ml")])
def test_missing_package_is_a_config_error_naming_the_fix(section, package):
    if package in sys.modules:
        pytest.skip(f"{package} is installed here")  # the error path only exists without the package
    with pytest.raises(ConfigError) as err:
        MonitorMaster({section: {"enabled": True}}, rank=0)
    text = str(err.value)
    assert f"{section}.enabled" in text and f"pip install {package}" in text


class _FakeWandbRun:
    def __init__(self):
        self.logged, self.config, self.finished = [], {}, False

    def log(self, data, step):
        self.logged.append((data, step))

    def finish(self):
        self.finished = True


def test_wandb_sink_logs_each_event_at_its_step(monkeypatch):
    run = _FakeWandbRun()
    run.config = types.SimpleNamespace(update=lambda params, allow_val_change: run.__dict__.update(params=params))
    calls = {}
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.update(kw) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    master = MonitorMaster({"wandb": {"enabled": True, "project": "p", "team": "t", "group": "g"}}, rank=0,
                           background=False)
    master.write_events(EVENTS[:2])
    master.log_params({"lr": 0.1})
    master.close()
    assert calls == {"project": "p", "group": "g", "entity": "t", "name": None}
    assert run.logged == [({"Train/Samples/train_loss": 2.5}, 8), ({"Train/Samples/lr": 0.001}, 8)]
    assert run.params == {"lr": 0.1} and run.finished


class _FakeExperiment:
    def __init__(self):
        self.metrics, self.name, self.ended = [], None, False

    def set_name(self, name):
        self.name = name

    def log_metric(self, name, value, step):
        self.metrics.append((name, value, step))

    def end(self):
        self.ended = True


def test_comet_sink_thins_events_by_samples_log_interval(monkeypatch):
    experiment = _FakeExperiment()
    started = {}
    fake = types.ModuleType("comet_ml")
    fake.start = lambda **kw: started.update(kw) or experiment
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    master = MonitorMaster({"comet": {"enabled": True, "project": "p", "experiment_name": "e",
                                      "samples_log_interval": 16}}, rank=0, background=False)
    master.write_events([("loss", 1.0, 8), ("loss", 0.9, 12), ("loss", 0.8, 16), ("loss", 0.7, 40)])
    master.close()
    assert started == {"project": "p"} and experiment.name == "e" and experiment.ended
    assert experiment.metrics == [("loss", 1.0, 8), ("loss", 0.8, 16), ("loss", 0.7, 40)]
