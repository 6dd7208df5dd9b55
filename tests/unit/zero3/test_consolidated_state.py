"""DeepSpeed's ``engine._zero3_consolidated_16bit_state_dict`` gathers the full weights whatever
``stage3_gather_16bit_weights_on_model_save`` says: Hugging Face's Trainer saves a PEFT model's adapters under ZeRO-3
through it (``exclude_frozen_parameters=True``) with the flag off too, and an empty answer there left the adapters'
file holding ZeRO-3's empty placeholders. Only ``save_16bit_model`` needs the flag."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dsrun


def _frozen_base_with_trainable_head() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)  # the base a LoRA model freezes; the head stands for its adapters
    return model


def _placeholders(engine, partitioned: bool) -> bool:
    """Partitioned: state_dict() holds placeholders; else kept whole (a world of one, docs/zero3.md)."""
    if partitioned:
        return all(p.numel() == 0 for p in engine.module.parameters())
    return all(p.ds_whole and p.numel() == p.ds_numel for p in engine.module.parameters())


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("partitioned", [True, False], ids=["partitioned", "whole"])
@pytest.mark.parametrize("gather_flag", [False, True])
def test_zero3_consolidated_state_gathers_the_trainable_weights_with_or_without_the_save_flag(tmp_path, gather_flag,
                                                                                            partitioned):
    model = _frozen_base_with_trainable_head()
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    # a world of one keeps ZeRO-3 parameters whole; parameter offload keeps them partitioned, gathered when used
    offload = {"offload_param": {"device": "cpu"}} if partitioned else {}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": gather_flag, **offload}}
    engine, *_ = dsrun.initialize(model=model, config=config)
    assert _placeholders(engine, partitioned)

    trainable = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert sorted(trainable) == ["1.bias", "1.weight"]
    for name, value in trainable.items():
        assert torch.equal(value, expected[name])
    everything = engine._zero3_consolidated_16bit_state_dict()
    assert sorted(everything) == sorted(expected)
    assert all(torch.equal(everything[name], expected[name]) for name in expected)
    assert _placeholders(engine, partitioned)  # released again after the gather (partitioned), still whole

    if gather_flag:
        assert engine.save_16bit_model(str(tmp_path), "model.bin") is True
        assert sorted(torch.load(tmp_path / "model.bin")) == sorted(expected)
    else:  # the 16-bit export alone keeps DeepSpeed's rule: nothing written without the flag
        with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
            assert engine.save_16bit_model(str(tmp_path), "model.bin") is False
        assert not (tmp_path / "model.bin").exists()
    engine.destroy()
