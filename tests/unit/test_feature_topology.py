"""The topology seams of the feature protocol (dsrun/features.py): a feature shapes the engine's process groups
(``group_sizes``), takes them before the model is broadcast (``take_topology``) and chooses the optimizer's
parameter groups (``optimizer_params``); MoE and Ulysses attach only through them (issue 37 item 3)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dsrun
from dsrun.config import load_ds_config
from dsrun.features import Feature, register_feature, unregister_feature
from dsrun.moe.feature import MoEFeature
from dsrun.sequence.feature import SequenceParallelFeature
from dsrun.utils.errors import ConfigError
from tests.unit.runtime.conftest import world_of_one  # the fixture

__all__ = ["world_of_one"]
pytestmark = pytest.mark.usefixtures("world_of_one")


class Topo(Feature):
    name = "topo"
    seen: list = []

    @classmethod
    def build(cls, config):
        return cls()

    def take_topology(self, model, groups):
        Topo.seen.append((type(model).__name__, groups.sequence_parallel_size))

    def optimizer_params(self, model, params):
        return [{"params": list(params), "lr": 0.5}]


@pytest.fixture
def topo():
    Topo.seen = []
    register_feature(Topo)
    try:
        yield
    finally:
        unregister_feature(Topo)


def test_a_feature_takes_the_topology_and_the_optimizer_params(topo):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 1), config=config)
    assert Topo.seen == [("Linear", 1)]
    assert engine.optimizer.param_groups[0]["lr"] == 0.5
    assert engine.has_moe_layers is False and list(engine.moe_layers) == []  # DeepSpeed's names, set by MoE's feature
    assert engine.sequence_parallel_size == 1
    assert not any(isinstance(f, SequenceParallelFeature) for f in engine.features)


def _config(**extra):
    return load_ds_config({"train_micro_batch_size_per_gpu": 1, **extra}, world_size=2)


def test_sequence_parallel_feature_asks_for_the_axis_and_sets_the_reduction_dtype():
    assert SequenceParallelFeature.build(_config()) is None
    config = _config(sequence_parallel_size=2, seq_parallel_comm_data_type="bf16")
    feature = SequenceParallelFeature.build(config)
    assert feature is not None and feature.group_sizes() == {"sequence": 2}
    feature.take_topology(torch.nn.Linear(2, 2), SimpleNamespace(sequence_parallel_size=2))
    assert config.communication_data_type == config.seq_parallel_comm_data_type
    with pytest.raises(ConfigError, match="client mpu"):
        feature.take_topology(torch.nn.Linear(2, 2), SimpleNamespace(sequence_parallel_size=1))


def test_moe_feature_leaves_a_dense_model_s_parameters_alone():
    params = list(torch.nn.Linear(2, 2).parameters())
    assert MoEFeature.build(_config()).optimizer_params(torch.nn.Linear(2, 2), params) is params
