"""``init_inference`` on MoE models in a one-rank world: the ``moe`` settings are checked against the model's
MoE layers, each disagreement one line naming the key (expert parallelism itself: tests/integration)."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.models.moe_gpt import MoEGPT
from dsrun.moe.layer import split_experts
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")
NANO = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _model(**moe) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(moe={"num_experts": 4, "k": 2, **moe}, **NANO)


MISMATCHES = [
    ({"moe_experts": [3]}, "moe.moe_experts: is [3], but the model's MoE layers hold [4, 4] experts"),
    ({"moe": {"moe_experts": [4, 2]}}, "moe.moe_experts"),
    ({"moe_type": "residual"}, "moe.type: is 'residual', but the model's MoE layers are standard"),
    ({"moe": {"ep_size": 3}}, "moe.ep_size: 3 does not divide a layer's 4 experts"),
    ({"moe": {"enabled": False}}, "moe.enabled: is false"),
    ({"ep_group": object()}, "moe.ep_group: a user-made expert group is not implemented yet"),
    ({"tensor_parallel": {"tp_size": 2}}, "tp_size: tensor parallelism of an MoE model is not implemented"),
    ({"dtype": torch.int8}, "dtype: INT8 weight quantization of an MoE model"),
    ({"replace_with_kernel_inject": True}, "replace_with_kernel_inject: the fused path has no MoE layers"),
]


@pytest.mark.parametrize("settings, message", MISMATCHES, ids=[m.split(":")[0] for _, m in MISMATCHES])
def test_moe_settings_the_model_disagrees_with_are_refused(settings, message) -> None:
    with pytest.raises(ConfigError) as caught:
        dsrun.init_inference(_model(), **settings)
    assert message in str(caught.value)


def test_an_ep_size_that_does_not_divide_the_world_is_refused() -> None:
    with pytest.raises(ConfigError, match="moe.ep_size: 2 does not divide the world size 1"):
        dsrun.init_inference(_model(), moe={"ep_size": 2}, dtype=torch.float32)


def test_matching_settings_serve_the_model_unchanged() -> None:
    model = _model()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(ids)
    engine = dsrun.init_inference(model, dtype=torch.float32, moe={"ep_size": 1, "moe_experts": [4],
                                                                   "type": "standard"})
    assert engine.ep_size == 1
    torch.testing.assert_close(engine(ids), want, rtol=0, atol=0)


def test_split_experts_refuses_a_layer_already_spread_and_a_size_that_does_not_divide() -> None:
    layer = _model().transformer["h"][0].mlp.moe
    with pytest.raises(ValueError, match="ep_size=3 does not divide num_experts=4"):
        split_experts(layer, 3)
    assert split_experts(layer, 1) == [0, 1, 2, 3]
    layer.ep_size = 2
    with pytest.raises(ValueError, match="already spreads its experts over 2 ranks"):
        split_experts(layer, 2)
