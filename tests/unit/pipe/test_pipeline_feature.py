"""The pipeline engine's own state goes through the feature protocol (dsrun/pipe/feature.py): its checkpoint
entries (the stage layout, ``mp_world_size``) come from the pipeline feature, the keys it owns are not the
client's state, a loaded layout is checked by it, its groups are the module's grid's, and its metrics reach the
monitors. A one-rank world."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsrun
from dsrun.checkpoint.safe_load import load_file
from dsrun.comm import ProcessGroups
from dsrun.pipe import PipelineModule
from dsrun.pipe.engine import PipelineEngine
from dsrun.pipe.feature import PipelineFeature
from dsrun.utils.errors import ConfigError, UserError

pytestmark = pytest.mark.usefixtures("world_of_one")

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}


class Events:
    enabled = True

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def write_events(self, events) -> None:
        self.events += events

    def close(self) -> None:
        pass


def engine_for(layers: int = 3, **extra) -> PipelineEngine:
    torch.manual_seed(0)
    module = PipelineModule(nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]), num_stages=1,
                            loss_fn=F.mse_loss)
    engine, *_ = dsrun.initialize(model=module, config={**CONFIG, **extra})
    return engine


def batches(n: int = 2):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(n)]


def test_the_pipeline_feature_is_the_engines_first_and_its_groups_are_the_grids() -> None:
    engine = engine_for()
    feature = engine.features.get(PipelineFeature)
    assert feature is engine.pipeline and next(iter(engine.features)) is feature
    assert engine.groups is engine.module.mpu().groups
    engine.destroy()


def test_the_stage_layout_in_a_checkpoint_is_the_features_entry(tmp_path, monkeypatch) -> None:
    engine = engine_for()
    engine.train_batch(iter(batches()))
    entries = engine.pipeline.checkpoint_entries()
    assert entries["mp_world_size"] == 1
    assert entries["dsrun"]["pipeline"] == {"stages": 1, "parts": [0, 3], "num_layers": 3, "virtual_stages": 1,
                                            "slice_rank": 0, "tied": {}, "dense_names": None, "moe_ep_sizes": {}}
    # what the feature says is what the file holds: a key it adds lands there, and is not the client's on load
    monkeypatch.setattr(PipelineFeature, "checkpoint_entries",
                        lambda self: {**entries, "pipeline_probe": 7,
                                      "dsrun": {"pipeline": {**entries["dsrun"]["pipeline"], "probe": "yes"}}})
    engine.save_checkpoint(str(tmp_path), client_state={"mine": 1})
    saved = load_file(tmp_path / "global_step1" / "mp_rank_00_model_states.pt")
    assert saved["module"] is None and saved["mp_world_size"] == 1 and saved["pipeline_probe"] == 7
    assert saved["dsrun"]["pipeline"]["probe"] == "yes" and saved["dsrun"]["pipeline"]["parts"] == [0, 3]
    assert saved["dsrun"]["zero_stage"] == 1  # dsrun's own keys stay beside the feature's
    with pytest.raises(UserError, match="client_state\\['pipeline_probe'\\]"):
        engine.save_checkpoint(str(tmp_path / "clash"), client_state={"pipeline_probe": 0})
    resumed = engine_for()
    _, client = resumed.load_checkpoint(str(tmp_path))
    assert client == {"mine": 1}
    assert resumed.pipeline.loaded_layout["probe"] == "yes" and resumed.global_steps == 1
    engine.destroy()
    resumed.destroy()


def test_a_layout_of_other_layers_is_refused_by_the_feature(tmp_path) -> None:
    engine = engine_for(layers=3)
    engine.save_checkpoint(str(tmp_path))
    other = engine_for(layers=4)
    with pytest.raises(UserError, match="the checkpoint has 3 layers, the PipelineModule 4"):
        other.load_checkpoint(str(tmp_path))
    assert other.pipeline.loaded_layout is None
    engine.destroy()
    other.destroy()


def test_the_last_batchs_timing_reaches_the_monitors_at_its_optimizer_step() -> None:
    engine = engine_for()
    engine.observer.monitor = engine.monitor = events = Events()
    engine.train_batch(iter(batches()))
    written = {name: value for name, value, _ in events.events if name.startswith("Train/Features/pipeline/")}
    assert set(written) == {"Train/Features/pipeline/pipeline_s", "Train/Features/pipeline/compute_s",
                            "Train/Features/pipeline/idle_fraction"}
    assert written["Train/Features/pipeline/pipeline_s"] == pytest.approx(engine.last_batch_timing["pipeline_s"])
    assert 0 < written["Train/Features/pipeline/compute_s"] <= written["Train/Features/pipeline/pipeline_s"]
    engine.destroy()


def test_the_feature_takes_only_the_grids_groups_and_refuses_sequence_parallelism() -> None:
    engine = engine_for()
    ulysses = PipelineFeature(engine.module, engine._config.model_copy(update={"sequence_parallel_size": 2}))
    with pytest.raises(ConfigError, match="does not compose with the pipeline engine"):
        ulysses.take_topology(engine.module, engine.groups)
    with pytest.raises(ValueError, match="module's grid"):
        engine.pipeline.take_topology(engine.module, ProcessGroups(world_size=1, rank=0))
    engine.pipeline.take_topology(engine.module, engine.groups)  # its own grid's: taken
    engine.destroy()
