from tests.unit.runtime.conftest import world_of_one  # noqa: F401  (a fixture, found by pytest here)
import pytest
import torch
from torch import nn


class TwoLayer(nn.Module):
    """A small MLP with named layers, for compression tests."""

    def __init__(self, width: int = 16, hidden: int = 32, out: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def technique(name: str, shared: dict, params: dict, modules=("*",), related=None, group: str = "g1") -> dict:
    body = {"params": params, "modules": list(modules)}
    if related is not None:
        body["related_modules"] = related
    return {"compression_training": {name: {"shared_parameters": {"enabled": True, **shared},
                                            "different_groups": {group: body}}}}


def merge(*configs: dict) -> dict:
    out: dict = {"compression_training": {}}
    for c in configs:
        out["compression_training"].update(c["compression_training"])
    return out


@pytest.fixture
def two_layer():
    torch.manual_seed(0)
    return TwoLayer()
