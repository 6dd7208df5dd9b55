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
    assert partition_balanced([0, 0, 0, 9], 2) == [0, 3, 4]  # every stage gets a layer; ties: the latest cut


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


# --- DeepSpeed's cuts, layer for layer ---------------------------------------------------------------------
# (weights, parts) -> DeepSpeed 0.19.8's deepspeed.runtime.utils.partition_balanced(weights, parts), as
# `python benchmarks/pipeline_example.py partitions` prints it (it runs DeepSpeed's own function beside dsrun's)
DEEPSPEED_BALANCED = [
    ([1, 2, 1], 4, [0, 1, 2, 3, 3]),
    ([1, 1, 1, 1], 4, [0, 1, 2, 3, 4]),
    ([1, 1, 1, 1, 1], 4, [0, 2, 3, 4, 5]),
    ([1, 1, 1, 1, 0, 1], 4, [0, 2, 3, 5, 6]),
    ([0, 0, 0, 9], 2, [0, 3, 4]),
    ([5, 1, 1, 1, 1, 1, 5, 5], 3, [0, 4, 7, 8]),
    ([4, 4, 4, 4, 1, 1, 1, 1], 2, [0, 3, 8]),
    ([1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 4, [0, 3, 6, 8, 10]),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 3, [0, 5, 8, 11]),
    ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], 3, [0, 4, 6, 7]),
    ([10, 0, 0, 0, 10], 2, [0, 4, 5]),
    ([7, 2, 2, 2, 7], 3, [0, 1, 4, 5]),
    ([2**40, 1, 2**40, 1], 2, [0, 2, 4]),
    ([0, 1, 1, 1, 1, 0], 2, [0, 3, 6]),
    ([1, 0, 0, 1, 0, 0, 1, 0], 3, [0, 3, 6, 8]),
]

# (model, partition_method, stages) -> the cut of DeepSpeed 0.19.8's PipelineModule._partition_layers of the
# example's layers (DeepSpeedExamples training/pipeline_parallelism/train.py: join_layers(AlexNet(10)) and
# join_layers(vgg19(num_classes=10)), 22 and 46 layers), from the same benchmark
DEEPSPEED_EXAMPLE_CUTS = [
    ('alexnet', 'parameters', 2, [0, 19, 22]),
    ('alexnet', 'parameters', 3, [0, 16, 19, 22]),
    ('alexnet', 'parameters', 4, [0, 8, 16, 19, 22]),
    ('alexnet', 'uniform', 2, [0, 11, 22]),
    ('alexnet', 'uniform', 3, [0, 8, 15, 22]),
    ('alexnet', 'uniform', 4, [0, 6, 12, 17, 22]),
    ('alexnet', 'type:conv2d', 2, [0, 8, 22]),
    ('alexnet', 'type:conv2d', 3, [0, 6, 10, 22]),
    ('alexnet', 'type:conv2d', 4, [0, 6, 8, 10, 22]),
    ('alexnet', 'type:Linear', 2, [0, 21, 22]),
    ('alexnet', 'type:Linear', 3, [0, 19, 21, 22]),
    ('alexnet', 'type:Linear', 4, [0, 19, 20, 21, 22]),
    ('alexnet', 'TYPE:relu', 2, [0, 11, 22]),
    ('alexnet', 'TYPE:relu', 3, [0, 9, 17, 22]),
    ('alexnet', 'TYPE:relu', 4, [0, 7, 11, 20, 22]),
    ('alexnet', 'type:lambda', 2, [0, 21, 22]),
    ('alexnet', 'type:lambda', 3, [0, 20, 21, 22]),
    ('alexnet', 'type:lambda', 4, [0, 19, 20, 21, 22]),
    ('alexnet', 'Parameters', 2, [0, 19, 22]),
    ('alexnet', 'Parameters', 3, [0, 16, 19, 22]),
    ('alexnet', 'Parameters', 4, [0, 8, 16, 19, 22]),
    ('vgg19', 'parameters', 2, [0, 39, 46]),
    ('vgg19', 'parameters', 3, [0, 39, 42, 46]),
    ('vgg19', 'parameters', 4, [0, 28, 39, 42, 46]),
    ('vgg19', 'uniform', 2, [0, 23, 46]),
    ('vgg19', 'uniform', 3, [0, 16, 31, 46]),
    ('vgg19', 'uniform', 4, [0, 12, 24, 35, 46]),
    ('vgg19', 'type:conv', 2, [0, 19, 46]),
    ('vgg19', 'type:conv', 3, [0, 14, 25, 46]),
    ('vgg19', 'type:conv', 4, [0, 10, 19, 28, 46]),
    ('vgg19', 'type:linear|pool', 2, [0, 37, 46]),
    ('vgg19', 'type:linear|pool', 3, [0, 27, 39, 46]),
    ('vgg19', 'type:linear|pool', 4, [0, 27, 37, 42, 46]),
]


@pytest.mark.parametrize("weights,parts,expected", DEEPSPEED_BALANCED)
def test_partition_balanced_is_deepspeeds(weights, parts, expected) -> None:
    assert partition_balanced(weights, parts) == expected


def test_balanced_cuts_minimise_the_spread_and_ties_go_late() -> None:
    """DeepSpeed's criterion is the spread (heaviest - lightest stage), not the heaviest stage, and of equal
    spreads the later boundary wins. [10, 0, 0, 0, 10] in 2: cutting after 1, 2, 3 or 4 items all give 10 | 10,
    so the cut falls after the fourth: [0, 4, 5]. [0, 0, 0, 9] in 2: every cut is 0 | 9: [0, 3, 4]. With
    fewer items than parts the cut is uniform ([1, 2, 1] in 4: one item each, the last part empty)."""
    assert partition_balanced([10, 0, 0, 0, 10], 2) == [0, 4, 5]
    assert partition_balanced([0, 0, 0, 9], 2) == [0, 3, 4]
    assert partition_balanced([1, 2, 1], 4) == [0, 1, 2, 3, 3]


def test_deepspeed_runtime_utils_serves_the_same_functions() -> None:
    from dsrun.compat.runtime import utils as ds_utils  # what `deepspeed.runtime.utils` is under the alias

    assert ds_utils.partition_uniform(num_items=10, num_parts=4) == [0, 3, 6, 8, 10]
    # the cases of DeepSpeed's tests/unit/utils/test_partition_balanced.py: (weights, parts, spread)
    for weights, parts, spread in (([1, 2, 1], 4, 2), ([1, 1, 1, 1], 4, 0), ([1, 1, 1, 1, 1], 4, 1),
                                   ([1, 1, 1, 1, 0, 1], 4, 1)):
        cut = ds_utils.partition_balanced(weights=weights, num_parts=parts)
        sums = [sum(weights[a:b]) for a, b in zip(cut, cut[1:])]
        assert max(sums) - min(sums) == spread


def _example_layers(model: str) -> list:
    """The example's ``join_layers(net)`` of torchvision's AlexNet / VGG-19 (the tests' stand-in, the same
    layers), on the meta device."""
    import importlib.util

    from tests.harness.deepspeed_examples import TORCHVISION_STANDIN

    spec = importlib.util.spec_from_file_location("torchvision_standin_models",
                                                  TORCHVISION_STANDIN / "torchvision" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    with torch.device("meta"):
        net = models.AlexNet(num_classes=10) if model == "alexnet" else models.vgg19(num_classes=10)
    return [*net.features, net.avgpool, lambda x: torch.flatten(x, 1), *net.classifier]


@pytest.mark.parametrize("model,method,stages,expected", DEEPSPEED_EXAMPLE_CUTS)
def test_the_pipeline_examples_models_are_cut_where_deepspeed_cuts_them(model, method, stages, expected) -> None:
    assert partition_layers(_example_layers(model), stages, method) == expected


def test_the_alexnet_example_keeps_its_big_linear_layers_apart() -> None:
    """DeepSpeedExamples' AlexNet at 2 stages by parameters: layers 0-18 (the convolutions and the 37.7M
    first Linear: 40.2M) on stage 0, 19-21 (the 16.8M and 41K Linears) on stage 1; boundaries 17 and 18
    leave the same spread, and DeepSpeed takes the latest, 19. Cutting at 17 instead (the earliest
    boundary of the smallest heaviest stage) starts stage 1 on an in-place ReLU."""
    layers = _example_layers("alexnet")
    weights = layer_weights(layers, "parameters")
    assert [i for i, w in enumerate(weights) if w] == [0, 3, 6, 8, 10, 16, 19, 21]
    assert partition_layers(layers, 2, "parameters") == [0, 19, 22]
    assert sum(weights[:19]) == 40_222_528 and sum(weights[19:]) == 16_822_282


def test_method_names_are_case_insensitive_and_errors_keep_deepspeeds_types() -> None:
    layers = _example_layers("alexnet")
    assert partition_layers(layers, 2, "PARAMETERS") == partition_layers(layers, 2, "parameters")
    assert partition_layers(layers, 3, "Uniform") == [0, 8, 15, 22]
    assert layer_weights(layers, "type:LAMBDA")[14] == 1.0  # a function layer matches by its __name__
    with pytest.raises(RuntimeError, match="matches no layer"):
        layer_weights(layers, "type:embedding")
    with pytest.raises(NotImplementedError, match="allowed"):
        layer_weights(layers, "balanced")
