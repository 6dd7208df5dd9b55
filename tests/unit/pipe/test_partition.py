"""How layers are cut into stages: DeepSpeed's uniform rule, balanced cuts over parameter counts or matching
class names, and 'profile', which times each layer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsrun.pipe import partition
from dsrun.pipe.partition import (layer_weights, partition_balanced, partition_layers, partition_uniform,
                                          profiling_inputs)
from dsrun.pipe.spec import LayerSpec, TiedLayerSpec
from dsrun.utils.errors import UserError


def test_partition_uniform_is_deepspeeds() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(8, 2) == [0, 4, 8]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]


def _max_part(weights, parts) -> float:
    return max(sum(weights[parts[i]:parts[i + 1]]) for i in range(len(parts) - 1))


def test_balanced_cut_minimises_the_heaviest_stage() -> None:
    weights = [5, 1, 1, 1, 1, 1, 5, 5]
    parts = partition_balanced(weights, 3)
    assert parts[0] == 0 and parts[-1] == len(weights) and all(a < b for a, b in zip(parts, parts[1:]))
    best = min(_max_part(weights, [0, i, j, 8]) for i in range(1, 7) for j in range(i + 1, 8))
    assert _max_part(weights, parts) == best == 8
    assert partition_balanced([0, 0, 0, 9], 2) == [0, 1, 4]  # every stage gets a layer; ties: the earliest cut


def test_parameters_counts_specs_without_building_them_for_real() -> None:
    built = []

    class Counted(nn.Linear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.weight.device.type)

    layers = [LayerSpec(Counted, 4, 8), nn.ReLU(), LayerSpec(Counted, 8, 2, bias=False), lambda x: x * 2]
    assert layer_weights(layers, "parameters") == [40.0, 0.0, 16.0, 0.0]
    assert built == ["meta", "meta"]


def test_type_regex_balances_matching_layers() -> None:
    layers = [LayerSpec(nn.Embedding, 8, 4)] + [LayerSpec(nn.TransformerEncoderLayer, 4, 1) for _ in range(4)] \
        + [LayerSpec(nn.LayerNorm, 4)]
    assert layer_weights(layers, "type:transformer") == [0, 1, 1, 1, 1, 0]
    assert partition_layers(layers, 2, "type:TRANSFORMER") == [0, 3, 6]
    with pytest.raises(UserError, match="matches no layer"):
        layer_weights(layers, "type:conv")
    with pytest.raises(UserError, match="allowed: 'parameters'"):
        layer_weights(layers, "params")


class Repeated(nn.Module):
    """The same parameters as any other Repeated, applied ``times`` times: compute without parameters."""

    def __init__(self, times: int):
        super().__init__()
        self.times = times
        self.linear = nn.Linear(128, 128)

    units = 0  # units of work every Repeated has done so far: the clock of the profile test

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            Repeated.units += 1
            x = torch.tanh(self.linear(x))
        return x


def test_profile_balances_time_where_parameters_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight layers of equal size doing 4, 4, 4, 4, 1, 1, 1, 1 units of work: by parameters the first stage
    gets 16 units and the second 4; profiling times each layer's forward and backward and cuts at 8-12 or 12-8
    (the FLOPs of the slowest stage fall by a quarter). The profile reads a clock that counts units of work, so
    the cut does not depend on how loaded the machine is."""
    monkeypatch.setattr(partition, "time", SimpleNamespace(perf_counter=lambda: float(Repeated.units)))
    work = [4, 4, 4, 4, 1, 1, 1, 1]
    layers = [LayerSpec(Repeated, k) for k in work]
    by_params = partition_layers(layers, 2, "parameters")
    with profiling_inputs(torch.randn(64, 128)):
        assert layer_weights(layers, "profile") == work
        by_time = partition_layers(layers, 2, "profile")
    assert by_params == [0, 4, 8] and _max_part(work, by_params) == 16
    assert by_time == partition_balanced(work, 2) and _max_part(work, by_time) == 12


def test_profile_needs_an_example_and_keeps_the_rng() -> None:
    layers = [LayerSpec(Repeated, 1), TiedLayerSpec("t", Repeated, 1), TiedLayerSpec("t", Repeated, 1)]
    with pytest.raises(UserError, match="profiling_inputs"):
        partition_layers(layers, 2, "profile")
    example = torch.randn(4, 128)
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    with profiling_inputs(example):
        partition_layers(layers, 2, "profile")
    assert torch.equal(torch.rand(1), expected)
