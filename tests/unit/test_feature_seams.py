"""The seams issue 37 item 3 left to the features: the backward reduction switch the ZeRO step reads, and MoE's
checkpoint files declared by its feature (dsrun/moe/feature.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dsrun.features import Feature, Features, ParameterFiles
from dsrun.moe.feature import MARK, MoEFeature, model_file, optim_file
from dsrun.zero.step_hooks import GradientReduction, StepState


def test_the_reduction_switch_is_latched_at_a_boundary_backward() -> None:
    reduction = GradientReduction()
    assert reduction.enabled and reduction.reduced
    reduction.enabled = False
    assert reduction.reduced  # the step in flight still reads reduced gradients
    reduction.latch()
    assert not reduction.reduced
    state = StepState(strategy=SimpleNamespace(reduction=reduction), coef=1.0, grad_norm=None)
    assert state.reduced is False


def test_moe_feature_is_silent_without_moe_layers() -> None:
    feature = MoEFeature.build(None)  # type: ignore[arg-type]
    assert feature.parameter_files() == [] and feature.checkpoint_entries() == {}
    feature.attach(SimpleNamespace(module=torch.nn.Linear(2, 2), has_moe_layers=False, strategy=object(),
                                   groups=SimpleNamespace(expert_data_first=True), global_rank=0))
    assert feature.parameter_files() == [] and feature.checkpoint_entries() == {}
    assert feature.checkpoint_layout_matches({"dsrun": {"expert_data_first": False}})
    assert not feature.owns_checkpoint_name(f"layer{MARK}0.weight")


def test_moe_feature_saves_and_compares_the_expert_layout() -> None:
    feature = MoEFeature()
    feature.attach(SimpleNamespace(module=torch.nn.Linear(2, 2), has_moe_layers=True, strategy=object(),
                                   groups=SimpleNamespace(expert_data_first=True), global_rank=0))
    assert feature.checkpoint_entries() == {"dsrun": {"expert_data_first": True}}
    assert feature.checkpoint_layout_matches({"dsrun": {"expert_data_first": True}})
    assert not feature.checkpoint_layout_matches({"dsrun": {}})
    assert feature.owns_checkpoint_name(f"moe.deepspeed_moe.experts{MARK}3.w") and not feature.owns_checkpoint_name("w")
    assert model_file(1, 3) == "layer_1_expert_3_mp_rank_00_model_states.pt"
    assert optim_file(1, 3) == "layer_1_expert_3_mp_rank_00_optim_states.pt"


def test_features_gather_their_parameter_files() -> None:
    param = torch.nn.Parameter(torch.zeros(2))

    class Owns(Feature):
        def parameter_files(self) -> list[ParameterFiles]:
            return [ParameterFiles("m.pt", "o.pt", {"saved.w": param}, {"saved.w": "local.w"}, writer=True)]

        def owns_checkpoint_name(self, name: str) -> bool:
            return name.startswith("saved.")

        def checkpoint_layout_matches(self, states: dict) -> bool:
            return states.get("same", True)

    features = Features([Feature(), Owns()])
    assert [f.model_file for f in features.parameter_files()] == ["m.pt"]
    assert features.owns_checkpoint_name("saved.w") and not features.owns_checkpoint_name("local.w")
    assert features.checkpoint_layout_matches({}) and not features.checkpoint_layout_matches({"same": False})
