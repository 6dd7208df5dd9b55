"""The support ledger's proof for logging, monitors and profilers: for every key it marks implemented with
``tests/unit/runtime/test_config_effects_reporting.py::test_key_changes_behaviour[KEY]``, the case below
changes the key and sees what dsrun reports change (a one-rank world, in this process; the monitors'
packages are replaced by recording fakes where a real one would need a server or an account)."""
from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest
import torch

from tests.unit.runtime._effects import engine, files, registry, step

pytestmark = pytest.mark.usefixtures("world_of_one")

EFFECTS, effect = registry()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_key_changes_behaviour":
        metafunc.parametrize("key", sorted(EFFECTS))


def test_key_changes_behaviour(key: str, tmp_path, monkeypatch, capsys) -> None:
    EFFECTS[key](key=key, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)


@effect("steps_per_print")
def _steps_per_print(capsys, **_):
    lines = []
    for every in (1, 2):
        step(engine({"steps_per_print": every}), 4)
        lines.append(capsys.readouterr().out.count("[dsrun] step="))
    assert lines == [4, 2]


def test_steps_per_print_left_out_prints_no_progress_line_as_deepspeed_0_19(capsys):
    """DeepSpeed 0.19's default is None (0.14: 10): no "step=" line; the wall-clock means come every step."""
    import dsrun
    from tests.unit.runtime._effects import BASE, Net

    config = {k: v for k, v in BASE.items() if k != "steps_per_print"}
    quiet = dsrun.initialize(model=Net(), config=config)[0]
    assert quiet.steps_per_print() is None
    step(quiet, 12)
    assert "[dsrun] step=" not in capsys.readouterr().out
    timed = dsrun.initialize(model=Net(), config={**config, "wall_clock_breakdown": True})[0]
    step(timed, 3)
    assert capsys.readouterr().out.count("time (ms) | forward:") == 3


@effect("wall_clock_breakdown")
def _wall_clock(capsys, **_):
    out = []
    for flag in (False, True):
        step(engine({"wall_clock_breakdown": flag, "steps_per_print": 1}), 2)
        out.append(capsys.readouterr().out)
    assert "time (ms) | forward:" not in out[0] and out[1].count("time (ms) | forward:") == 2


@effect("csv_monitor.enabled", "csv_monitor.output_path", "csv_monitor.job_name",
        "tensorboard.enabled", "tensorboard.output_path", "tensorboard.job_name")
def _file_monitors(key, tmp_path, **_):
    section = key.split(".")[0]
    for name, keys in (("off", {"enabled": False}), ("a", {}), ("b", {"job_name": "other"}),
                       ("c", {"output_path": str(tmp_path / "elsewhere")})):
        e = engine({section: {"enabled": True, "output_path": str(tmp_path / name), "job_name": "job", **keys}})
        step(e)
        e.monitor.close()
    assert files(tmp_path / "off") == 0 and files(tmp_path / "a" / "job") > 0
    assert files(tmp_path / "b" / "other") > 0 and files(tmp_path / "elsewhere" / "job") > 0


def fake_module(monkeypatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@effect("wandb.enabled", "wandb.group", "wandb.team", "wandb.project")
def _wandb(key, monkeypatch, **_):
    calls: list[dict] = []
    run = types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    fake_module(monkeypatch, "wandb", init=lambda **kw: calls.append(kw) or run)
    for keys in ({"enabled": False}, {"enabled": True, "project": "p", "group": "g", "team": "t"}):
        engine({"wandb": keys}).monitor.close()
    assert calls == [{"project": "p", "group": "g", "entity": "t", "name": None}]


@effect("comet.enabled", "comet.samples_log_interval", "comet.project", "comet.workspace", "comet.api_key",
        "comet.experiment_name", "comet.experiment_key", "comet.online", "comet.mode")
def _comet(monkeypatch, **_):
    started: list[dict] = []
    logged: list[int] = []
    experiment = types.SimpleNamespace(set_name=lambda name: started[-1].update(name=name), end=lambda: None,
                                       log_metric=lambda label, value, step: logged.append(step))
    fake_module(monkeypatch, "comet_ml", start=lambda **kw: started.append(kw) or experiment)
    keys = {"project": "p", "workspace": "w", "api_key": "k", "experiment_name": "e", "experiment_key": "x" * 32,
            "online": False, "mode": "create", "samples_log_interval": 4}
    for comet in ({"enabled": False}, {"enabled": True, **keys}):
        e = engine({"comet": comet})
        step(e, 4)  # 2 samples per step: global samples 2, 4, 6, 8
        e.monitor.close()
    assert started == [{"project": "p", "workspace": "w", "api_key": "k", "experiment_key": "x" * 32,
                        "online": False, "mode": "create", "name": "e"}]
    assert sorted(set(logged)) == [2, 4, 8]  # one event per metric each time the samples cross a multiple of 4


@effect("mlflow.enabled", "mlflow.tracking_uri", "mlflow.experiment_name", "mlflow.run_name", "mlflow.log_artifacts")
def _mlflow(tmp_path, monkeypatch, **_):
    calls: list[tuple] = []

    class Client:
        def __init__(self, tracking_uri):
            calls.append(("uri", tracking_uri))

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name, artifact_location=None):
            calls.append(("experiment", name))
            return "1"

        def create_run(self, experiment_id, run_name=None, tags=None):
            calls.append(("run", run_name))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r"))

        def log_artifact(self, run_id, path):
            calls.append(("artifact", path))

        def log_batch(self, *a, **k):
            pass

        def set_terminated(self, *a, **k):
            pass

    fake_module(monkeypatch, "mlflow")
    fake_module(monkeypatch, "mlflow.tracking", MlflowClient=Client)
    fake_module(monkeypatch, "mlflow.entities", Metric=lambda *a: a, Param=lambda *a: a)
    artifact = tmp_path / "a.txt"
    artifact.write_text("x")
    for keys in ({"enabled": False}, {"enabled": True, "tracking_uri": "http://t:5000", "experiment_name": "x",
                                      "run_name": "r1"}, {"enabled": True, "tracking_uri": "http://u:5000",
                                                          "log_artifacts": False}):
        e = engine({"mlflow": keys})
        e.monitor.log_artifacts([str(artifact)])
        e.monitor.close()
    assert calls == [("uri", "http://t:5000"), ("experiment", "x"), ("run", "r1"), ("artifact", str(artifact)),
                     ("uri", "http://u:5000"), ("experiment", "dsrun"), ("run", None)]


@effect("comms_logger.enabled", "comms_logger.verbose", "comms_logger.prof_all", "comms_logger.debug",
        "comms_logger.prof_ops")
def _comms_logger(key, capsys, **_):
    from dsrun import comm

    name = key.split(".")[1]
    keys = {"enabled": {"enabled": True}, "verbose": {"enabled": True, "verbose": True},
            "prof_all": {"enabled": True, "prof_all": False}, "debug": {"enabled": True, "debug": True},
            "prof_ops": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}}[name]
    reports = []
    try:
        for section in ({"enabled": True} if name != "enabled" else {}, keys):
            engine({"comms_logger": section})
            comm.comms_logger.reset()
            comm.all_reduce(torch.ones(4))
            reports.append((comm.comms_logger.summary_data(), capsys.readouterr().out))
    finally:
        comm.configure(enabled=False, verbose=False, prof_all=True, prof_ops=[], debug=False)
    (before, out_before), (after, out_after) = reports
    if name == "enabled":  # collectives are always counted; the logger adds their timing
        assert before["all_reduce"]["sizes"][0]["timed_calls"] == 0 < after["all_reduce"]["sizes"][0]["timed_calls"]
    elif name == "verbose":
        assert "comm op: all_reduce" not in out_before and "comm op: all_reduce" in out_after
    elif name in ("prof_all", "prof_ops"):  # prof_all false: only the prof_ops are profiled
        assert "all_reduce" in before and ("all_reduce" in after) is (name == "prof_ops")
    else:
        assert "caller" not in before["all_reduce"]["sizes"][0] and after["all_reduce"]["sizes"][0]["caller"]


@effect("flops_profiler.enabled", "flops_profiler.recompute_fwd_factor", "flops_profiler.profile_step",
        "flops_profiler.module_depth", "flops_profiler.top_modules", "flops_profiler.detailed",
        "flops_profiler.output_file")
def _flops_profiler(key, tmp_path, **_):
    def report(**keys: Any) -> str | None:
        e = engine({"flops_profiler": {"enabled": True, **keys}})
        step(e, 3)
        return e.observer.flops_report

    name = key.split(".")[1]
    if name == "enabled":
        assert report(enabled=False) is None and "Profile Summary at step 1:" in report()
    elif name == "recompute_fwd_factor":
        assert "= 2 * fwd flops" in report() and "= 3 * fwd flops" in report(recompute_fwd_factor=1.0)
    elif name == "profile_step":
        assert "Profile Summary at step 2:" in report(profile_step=2)
    elif name == "module_depth":
        assert report().count("\ndepth ") > report(module_depth=1).count("\ndepth ") > 0
    elif name == "top_modules":
        assert "Top 1 modules" in report() and "Top 3 modules" in report(top_modules=3)
    elif name == "detailed":
        assert "Detailed Profile per GPU" in report() and "Detailed Profile per GPU" not in report(detailed=False)
    else:
        text = report(output_file=str(tmp_path / "flops.txt"))
        assert (tmp_path / "flops.txt").read_text() == text


class LoggedLines(logging.Handler):
    """Records the messages of the ``DeepSpeed`` logger (whose handler writes to the stdout it found at import)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "LoggedLines":
        from dsrun.utils.logging import logger

        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        from dsrun.utils.logging import logger

        logger.removeHandler(self)


@effect("log_level")
def _log_level(**_):
    from dsrun.utils.logging import logger

    saved = [logger.level, *(h.level for h in logger.handlers)]
    try:
        engine({})
        assert logger.getEffectiveLevel() == logging.INFO  # left out: the logger keeps its level
        engine({"log_level": "error"})
        assert logger.getEffectiveLevel() == logging.ERROR and all(h.level == logging.ERROR for h in logger.handlers)
        with LoggedLines() as seen:
            logger.info("not shown")
            logger.error("shown")
        assert seen.lines == ["shown"]
        # kept as written, as DeepSpeed's getter returns it; any case is a level, anything else is refused
        assert engine({"log_level": "DEBUG"}).log_level() == "DEBUG" and logger.getEffectiveLevel() == logging.DEBUG
        from dsrun.utils.errors import ConfigError
        with pytest.raises(ConfigError, match="log_level: got 'loud'; .*expected one of debug, info"):
            engine({"log_level": "loud"})
    finally:
        logger.setLevel(saved[0])
        for handler, level in zip(logger.handlers, saved[1:]):
            handler.setLevel(level)


@effect("memory_breakdown")
def _memory_breakdown(monkeypatch, **_):
    import dsrun.profiling.memory_usage as memory_usage

    monkeypatch.setattr(memory_usage.gc, "collect", lambda: 0)  # each line collects first: seconds in pytest
    lines = []
    for flag in (False, True):
        with LoggedLines() as seen:
            step(engine({"memory_breakdown": flag}), 2)
        lines.append(seen.lines)
    assert not any("Engine" in line for line in lines[0])
    assert [line for line in lines[1] if "Engine" in line] == ["DeepSpeed Engine: After configure distributed model"] \
        + 2 * ["Engine before forward", "Engine after forward", "Engine before backward", "Engine after backward",
               "Engine before step", "Engine after step"]
    assert sum(line.startswith("MA ") and "Max_MA" in line for line in lines[1]) == 13
    assert sum(line.startswith("CPU Virtual Memory:") for line in lines[1]) == 13


@effect("dump_state")
def _dump_state(**_):
    dumps = []
    for flag in (False, True):
        with LoggedLines() as seen:
            engine({"dump_state": flag})
        dumps.append(seen.lines)
    assert "DeepSpeedEngine:" not in dumps[0]
    state = dumps[1][dumps[1].index("DeepSpeedEngine:") + 1:]
    assert f"  global_steps {'.' * 17} 0" in state and any(s.startswith("  world_size ..") for s in state)


@effect("disable_python_gc")
def _disable_python_gc(**_):
    import gc
    import weakref

    from dsrun.utils.python_gc import python_gc_manager

    class Node:
        partner: Any = None

    def cycle() -> weakref.ref:
        a, b = Node(), Node()
        a.partner, b.partner = b, a
        return weakref.ref(a)

    assert gc.isenabled()
    gc.freeze()  # the test process's own objects out of every collection here: each full one would take a second
    plain = engine({})
    assert gc.isenabled() and python_gc_manager.active_engines == 0
    plain.destroy()
    first, second = engine({"disable_python_gc": True}), engine({"disable_python_gc": True})
    try:
        assert not gc.isenabled() and python_gc_manager.active_engines == 2
        left = cycle()
        step(first, 3)
        for _ in range(5000):  # far past gen-0's threshold (700): automatic collection would have found it
            cycle()
        assert left() is not None
        assert first.collect_python_gc() > 0 and left() is None
        first.destroy()
        assert not gc.isenabled()  # the second engine still holds its lease
        second.destroy()
        assert gc.isenabled() and python_gc_manager.active_engines == 0
    finally:
        gc.enable()
        gc.unfreeze()


@effect("autotuning.model_info.profile", "autotuning.model_info_path")
def _model_info_profile(tmp_path, monkeypatch, **_):
    import json

    monkeypatch.chdir(tmp_path)
    step(engine({"autotuning": {"enabled": True}}), 2)  # not profiling: it trains on
    assert not (tmp_path / "autotuning_model_info.json").exists()
    for extra, path in (({}, tmp_path / "autotuning_model_info.json"),
                        ({"model_info_path": str(tmp_path / "info" / "model.json")}, tmp_path / "info" / "model.json")):
        profiling = engine({"autotuning": {"enabled": True, "model_info": {"profile": True}, **extra}})
        with pytest.raises(SystemExit) as stop:
            step(profiling)
        info = json.loads(path.read_text())
        assert stop.value.code == 0 and profiling.global_steps == 0  # stopped at the first backward
        assert info["num_params"] == info["trainable_num_params"] == 4 * 8 + 8 + 8 * 8 + 8 + 8 + 1
        assert info["activation_mem_per_gpu"] > 0 and info["rank"] == 0
