"""The feature protocol (dsrun/features.py): a toy feature registered from here, with no engine edit,
wraps the model, hooks the optimizer step, round-trips a checkpoint entry and reports a metric."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.features import Feature, register_feature, unregister_feature
from tests.unit.runtime.conftest import world_of_one  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("world_of_one")


class Scaled(torch.nn.Module):
    """The toy's wrapper: the model's output times a learnable scale."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


class Toy(Feature):
    name = "toy"

    def __init__(self, every: int):
        self.every = every
        self.updates = 0

    @classmethod
    def build(cls, config):
        return cls(int(config.steps_per_print)) if config.steps_per_print else None

    def wrap_model(self, model):
        return Scaled(model)

    def attach(self, engine):
        def count(state):
            self.updates += 1

        engine.strategy.hooks.add("after_update", count)

    def checkpoint_entries(self):
        return {"toy": {"updates": self.updates}}

    def load_checkpoint_entries(self, states):
        self.updates = states["toy"]["updates"]

    def metrics(self):
        return {"updates": self.updates}


@pytest.fixture
def toy():
    register_feature(Toy)
    try:
        yield
    finally:
        unregister_feature(Toy)


class Events:
    enabled = True

    def __init__(self):
        self.events: list[tuple] = []

    def write_events(self, events):
        self.events += events

    def close(self):
        pass


def _engine():
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "steps_per_print": 1000}
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 1), config=config)
    return engine


def _step(engine):
    loss = engine(torch.randn(2, 4)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def test_a_registered_feature_wraps_hooks_checkpoints_and_reports(toy, tmp_path):
    engine = _engine()
    feature = next(f for f in engine.features if isinstance(f, Toy))
    assert isinstance(engine.module, Scaled) and feature.every == 1000
    before = engine.module.scale.detach().clone()
    engine.observer.monitor = events = Events()
    for _ in range(3):
        _step(engine)
    assert feature.updates == 3 and not torch.equal(engine.module.scale.detach(), before)
    assert ("Train/Features/toy/updates", 3.0, 6) in events.events
    engine.save_checkpoint(str(tmp_path), client_state={"mine": 1})
    resumed = _engine()
    _, client = resumed.load_checkpoint(str(tmp_path))
    assert next(f for f in resumed.features if isinstance(f, Toy)).updates == 3
    assert client == {"mine": 1}  # the feature's entry is not the client's
    assert resumed.features.metrics() == {"toy/updates": 3.0}


def test_an_unregistered_feature_is_not_built(toy):
    unregister_feature(Toy)
    engine = _engine()
    assert not any(isinstance(f, Toy) for f in engine.features) and isinstance(engine.module, torch.nn.Linear)
