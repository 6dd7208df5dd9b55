"""``deepspeed.linear`` (``dsrun/linear``): the LoRA ``OptimizedLinear``'s output, what is trainable, the
``Init`` context and ``init_lora``, a state-dict load, and the refusals (sharding over another world size,
offload, a quantized weight without a quantizer). The 2-rank sharded base weight and the engine leaving it
unbroadcast are DeepSpeed's own ``linear/test_ctx.py`` (benchmarks/deepspeed_unit_tests.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsrun.linear import Init, LoRAConfig, LoRAOptimizedLinear, OptimizedLinear, QuantizationConfig, init_lora

pytestmark = pytest.mark.usefixtures("world_of_one")


def test_lora_output_is_the_base_plus_the_scaled_adapters() -> None:
    torch.manual_seed(0)
    assert type(OptimizedLinear(4, 3, dtype=torch.float32)) is torch.nn.Linear  # no config: a plain linear
    layer = OptimizedLinear(8, 6, lora_config=LoRAConfig(lora_r=2, lora_alpha=4), dtype=torch.float32)
    assert isinstance(layer, LoRAOptimizedLinear) and layer.lora_scaling_factor == 2.0
    assert not layer.weight.requires_grad and layer.weight.ds_optim_param
    assert [p.requires_grad for p in (layer.lora_weight_1.weight, layer.lora_weight_2.weight)] == [True, True]
    x = torch.randn(5, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight))  # B starts at zero: the base model's output
    with torch.no_grad():
        layer.lora_weight_2.weight.normal_()
    a, b = layer.lora_weight_1.weight, layer.lora_weight_2.weight
    torch.testing.assert_close(layer(x), x @ layer.weight.T + 2.0 * (x @ a.T) @ b.T)
    layer(x).sum().backward()
    assert layer.weight.grad is None and a.grad is not None and b.grad is not None


def test_init_context_builds_every_linear_as_lora_and_init_lora_freezes_the_rest() -> None:
    config = LoRAConfig(lora_r=2, lora_alpha=2)
    with Init(lora_config=config):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                    torch.nn.Linear(in_features=4, out_features=2))
    assert torch.nn.Linear is not None and torch.nn.Linear.__name__ == "Linear"  # restored
    layers = [model[0], model[2]]
    assert all(isinstance(m, LoRAOptimizedLinear) and not m._initialized for m in layers)
    assert layers[1].weight.shape == (2, 4)
    with pytest.raises(RuntimeError, match="init_lora was never called"):
        model(torch.randn(1, 4))
    init_lora(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{i}.lora_weight_{j}.weight" for i in (0, 2) for j in (1, 2)}  # LayerNorm frozen too


def test_state_dict_load_keeps_lora_on_targets_only() -> None:
    config = LoRAConfig(lora_r=2, target_mods=["q_proj"], delay_lora_init=True)
    model = torch.nn.ModuleDict({"q_proj": OptimizedLinear(4, 4, lora_config=config, dtype=torch.float32),
                                 "o_proj": OptimizedLinear(4, 4, lora_config=config, dtype=torch.float32)})
    weights = {"q_proj.weight": torch.randn(4, 4), "o_proj.weight": torch.randn(4, 4)}
    model.load_state_dict(weights)
    init_lora(model)
    assert model["q_proj"]._initialized and torch.equal(model["q_proj"].weight, weights["q_proj.weight"])
    assert model["o_proj"].disabled and not hasattr(model["o_proj"], "lora_weight_1")
    x = torch.randn(2, 4)
    assert torch.equal(model["o_proj"](x), F.linear(x, weights["o_proj.weight"]))


def test_what_dsrun_refuses_is_one_line_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="base_weight_sharding=2: .* has 1 ranks here; set it to 1"):
        OptimizedLinear(4, 4, lora_config=LoRAConfig(base_weight_sharding=2))
    with pytest.raises(ValueError, match="LoRAConfig.offload"):
        OptimizedLinear(4, 4, lora_config=LoRAConfig(offload=True))
    with pytest.raises(ValueError, match="bias=True"):
        LoRAOptimizedLinear(4, 4, bias=True, lora_config=LoRAConfig())
    with pytest.raises(ValueError, match="FP quantizer .* pass quantizer="):  # QuantizedParameter's
        OptimizedLinear(4, 4, lora_config=LoRAConfig(), quantization_config=QuantizationConfig())
    with pytest.raises(ValueError, match="Expecting LoRAConfig"):
        OptimizedLinear(4, 4, lora_config={"lora_r": 2})
