"""The support ledger's tracer: every key it marks implemented (and traced) is read by dsrun at run time.

A tracer records each read of a field of the config's sections, made from outside ``dsrun.config`` (the
config layer validating itself does not count), while short engine runs cover the stages, precisions,
offloads, monitors, profilers, checkpoints and ``dsrun tune``'s settings. A key the runtime never reads
would act only by accident: the ledger must not call it implemented. (That changing a key changes
behaviour is proved per key by the tests each ledger entry names.)
"""
from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

import dsrun
from dsrun.config import load_ds_config
from dsrun.config.base import Section
from dsrun.config.ledger import LEDGER, Status
from dsrun.config.schema_keys import match_pattern

pytestmark = pytest.mark.usefixtures("world_of_one")


def _sections(section: Section, prefix: str) -> Iterator[tuple[Section, str]]:
    yield section, prefix
    for name in type(section).model_fields:
        value = section.__dict__.get(name)
        if isinstance(value, Section):
            yield from _sections(value, f"{prefix}{name}.")
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, Section):
                    yield from _sections(item, f"{prefix}{name}.{key}.")


@contextmanager
def trace_reads(cfg: Section, seen: set[str]) -> Iterator[None]:
    """Add to ``seen`` the ledger pattern of every field of ``cfg``'s sections read from outside dsrun.config;
    ``model_dump()`` of a section (not of the whole config) reads all of it."""
    paths = {id(section): prefix for section, prefix in _sections(cfg, "")}
    original = Section.__getattribute__

    def record(prefix: str, name: str) -> None:
        pattern = match_pattern(prefix + name, LEDGER)
        if pattern is not None:
            seen.add(pattern)

    def traced(self: Section, name: str) -> Any:
        prefix = paths.get(id(self))
        if prefix is not None and not sys._getframe(1).f_globals.get("__name__", "").startswith("dsrun.config"):
            fields = type(self).model_fields
            if name in fields:
                record(prefix, name)
            elif name == "model_dump" and self is not cfg:
                for inner, inner_prefix in _sections(self, prefix):
                    for field in type(inner).model_fields:
                        record(inner_prefix, field)
        return original(self, name)

    Section.__getattribute__ = traced  # type: ignore[method-assign]
    try:
        yield
    finally:
        del Section.__getattribute__


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x.to(self.layers[0].weight.dtype))))


def run(config: dict, seen: set[str], tmp: Path, steps: int = 2, checkpoint: bool = False) -> None:
    cfg = load_ds_config({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
                          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **config})
    data = torch.utils.data.TensorDataset(torch.randn(4, 4), torch.randn(4, 1))
    with trace_reads(cfg, seen):
        engine, _, loader, _ = dsrun.initialize(model=Net(), config=cfg, training_data=data)
        for x, y in list(loader)[:steps]:
            engine.backward(F.mse_loss(engine(x).float(), y))
            engine.step()
        if checkpoint:
            engine.save_checkpoint(str(tmp / "ckpt"))
            engine.load_checkpoint(str(tmp / "ckpt"))
        engine.save_16bit_model(str(tmp / "model"))
        engine.destroy()  # its monitors, and the cores an optimizer thread was pinned to (cpuadam_cores_perc)


def tune(seen: set[str], tmp: Path) -> None:
    from dsrun.autotuning import Tuner, build_space, settings_from

    cfg = load_ds_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {
        "enabled": True, "results_dir": str(tmp / "r"), "arg_mappings": {"train_micro_batch_size_per_gpu": "--b"},
        "model_info": {"num_params": 10}}})
    with trace_reads(cfg, seen):
        settings = settings_from(cfg.autotuning, {}, {"space": {"train_micro_batch_size_per_gpu": [1, 2]}}, tmp)
        space = build_space(settings, {"train_micro_batch_size_per_gpu": 1}, world_size=1)
        Tuner(settings, space, [], [], lambda overrides: None).model_info()


@pytest.fixture(scope="module")
def keys_read(world_of_one, tmp_path_factory) -> frozenset[str]:
    tmp = tmp_path_factory.mktemp("config_reads")
    monkeypatch = pytest.MonkeyPatch()
    fake_run = types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None, config=None)
    experiment = types.SimpleNamespace(set_name=lambda n: None, log_metric=lambda *a, **k: None, end=lambda: None)
    fakes = {"wandb": {"init": lambda **kw: fake_run}, "comet_ml": {"start": lambda **kw: experiment},
             "mlflow": {}, "mlflow.tracking": {"MlflowClient": FakeMlflowClient},
             "mlflow.entities": {"Metric": lambda *a: a, "Param": lambda *a: a}}
    for name, attrs in fakes.items():  # the sinks' packages, so their sections are read without a server
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    seen: set[str] = set()
    monitors = {"csv_monitor": {"enabled": True, "output_path": str(tmp / "m"), "job_name": "j"},
                "tensorboard": {"enabled": True, "output_path": str(tmp / "m"), "job_name": "t"},
                "wandb": {"enabled": True}, "comet": {"enabled": True},
                "mlflow": {"enabled": True, "tracking_uri": "http://tracking.invalid"}}
    try:
        run({"fp16": {"enabled": True, "auto_cast": True}, "wall_clock_breakdown": True, "gradient_clipping": 1.0,
             "prescale_gradients": True, "scheduler": {"type": "WarmupLR"}, "dataloader_drop_last": True,
             "comms_logger": {"enabled": True}, "flops_profiler": {"enabled": True, "output_file": str(tmp / "f")},
             "checkpoint": {"load_universal": True, "writer": {
                 "type": "fast", "io_buffer_size": 65536, "io_buffer_double": False, "show_statistics": True,
                 "decoupled": True}},
             **monitors}, seen, tmp, checkpoint=True)
        # a stage-2 save reads zero_optimization.elastic_checkpoint (the layout of its optimizer files)
        run({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "communication_data_type": "fp32"},
            seen, tmp, checkpoint=True)
        run({"bf16": {"enabled": True, "immediate_grad_update": True}, "zero_optimization": {"stage": 1},
             "data_types": {"grad_accum_dtype": "fp32"}}, seen, tmp)
        run({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}, "torch_autocast": {
                "enabled": True, "dtype": "bf16", "lower_precision_safe_modules": ["torch.nn.Linear"]},
             "zero_allow_untested_optimizer": True}, seen, tmp)
        run({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp / "p")},
                                   "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp / "o")}}}, seen, tmp)
        run({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, seen, tmp)
        run({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5},
                                   "zenflow": {"select_strategy": "epoch", "select_interval": 1, "steps_per_epoch": 2,
                                               "update_interval": 2, "overlap_step": True}}}, seen, tmp)
        # MiCS's keys are the ZeRO++ feature's, read only when one of them is on (a world of one: shard groups of 1)
        run({"zero_optimization": {"stage": 3, "mics_shard_size": 1, "mics_hierarchical_params_gather": True,
                                   "zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.5}}},
            seen, tmp)
        tune(seen, tmp)
    finally:
        monkeypatch.undo()
    return frozenset(seen)


class FakeMlflowClient:
    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri

    def get_experiment_by_name(self, name: str) -> None:
        return None

    def create_experiment(self, name: str, artifact_location: Any = None) -> str:
        return "1"

    def create_run(self, experiment_id: str, run_name: Any = None, tags: Any = None) -> Any:
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r"))

    def log_batch(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_terminated(self, *args: Any, **kwargs: Any) -> None:
        pass


TRACED = sorted(k for k, e in LEDGER.items() if e.status == Status.IMPLEMENTED and e.traced)


@pytest.mark.parametrize("key", TRACED)
def test_the_runtime_reads_every_implemented_key(key: str, keys_read: frozenset[str]) -> None:
    assert key in keys_read, f"{key} is marked implemented but no engine run read it: flip it back, or read it"
