"""DeepSpeed's optimizer-wrapper names (``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``,
``FP16_Optimizer``, ``FP16_UnfusedOptimizer``, ``BF16_Optimizer``) answer ``isinstance(engine.optimizer, ...)``
as DeepSpeed's engine (0.19) does for the same config: one wrapper per stage/precision/optimizer, none for fp32
without ZeRO."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.compat.runtime.bf16_optimizer import BF16_Optimizer
from dsrun.compat.runtime.fp16.fused_optimizer import FP16_Optimizer
from dsrun.compat.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from dsrun.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from dsrun.compat.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

WRAPPERS = (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, FP16_Optimizer, FP16_UnfusedOptimizer,
            BF16_Optimizer)
ADAM = {"type": "Adam", "params": {"lr": 0.01}}


def _wrapper_of(config: dict, optimizer=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    client = optimizer(model.parameters()) if optimizer else None
    engine, *_ = dsrun.initialize(model=model, optimizer=client, config={"train_batch_size": 1, **config},
                                  model_parameters=None if client else model.parameters())
    found = [cls.__name__ for cls in WRAPPERS if isinstance(engine.optimizer, cls)]
    assert isinstance(engine.optimizer, torch.optim.Optimizer)  # dsrun's engine.optimizer stays the torch optimizer
    return found[0] if len(found) == 1 else (None if not found else found)


@pytest.mark.parametrize("config, optimizer, expected", [
    ({"optimizer": ADAM}, None, None),  # fp32 without ZeRO: DeepSpeed keeps the bare optimizer
    ({"optimizer": ADAM, "bf16": {"enabled": True}}, None, "FP16_Optimizer"),  # DeepSpeed 0.19's "DDP bf16"
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, "bf16": {"enabled": True}}, None,
     "FP16_UnfusedOptimizer"),
    ({"optimizer": ADAM, "fp16": {"enabled": True}}, None, "FP16_Optimizer"),  # DeepSpeed builds FusedAdam
    ({"optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}, "fp16": {"enabled": True}}, None,
     "FP16_UnfusedOptimizer"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 0.01}}, "fp16": {"enabled": True}}, None, "FP16_UnfusedOptimizer"),
    ({"fp16": {"enabled": True}}, lambda p: torch.optim.SGD(p, lr=0.1), "FP16_UnfusedOptimizer"),
    ({"fp16": {"enabled": True}}, lambda p: dsrun.ops.adam.FusedAdam(p, lr=0.1), "FP16_Optimizer"),
    ({"optimizer": ADAM, "zero_optimization": {"stage": 1}}, None, "DeepSpeedZeroOptimizer"),
    ({"optimizer": ADAM, "zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, None, "DeepSpeedZeroOptimizer"),
    ({"optimizer": ADAM, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
      "data_types": {"grad_accum_dtype": "fp32"}, "dsrun_allow_unimplemented": True}, None,
     "BF16_Optimizer"),  # DeepSpeed's BF16_Optimizer (dsrun accumulates in fp32 there too: dsrun/zero/grad_accum.py)
    ({"optimizer": ADAM, "zero_optimization": {"stage": 3}}, None, "DeepSpeedZeroOptimizer_Stage3"),
], ids=["fp32", "bf16", "bf16-torch-adam", "fp16-adam", "fp16-torch-adam", "fp16-lamb", "fp16-client-sgd", "fp16-client-fused",
        "zero1", "zero2-fp16", "zero1-bf16-fp32-accum", "zero3"])
def test_isinstance_answers_as_deepspeeds_engine(world_of_one, config, optimizer, expected):
    assert _wrapper_of(config, optimizer) == expected


def test_deepspeeds_base_classes_stand_for_their_subclasses(world_of_one):
    from dsrun.compat.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

    def optimizer_of(section: dict):
        model = torch.nn.Linear(4, 2)
        return dsrun.initialize(model=model, model_parameters=model.parameters(),
                                config={"train_batch_size": 1, "optimizer": ADAM, **section})[0].optimizer

    zero1, fp16 = optimizer_of({"zero_optimization": {"stage": 1}}), optimizer_of({"fp16": {"enabled": True}})
    assert isinstance(zero1, ZeROOptimizer) and isinstance(zero1, DeepSpeedOptimizer)
    assert not isinstance(fp16, ZeROOptimizer) and isinstance(fp16, DeepSpeedOptimizer)
    assert issubclass(DeepSpeedZeroOptimizer, ZeROOptimizer) and issubclass(BF16_Optimizer, ZeROOptimizer)
    assert issubclass(FP16_Optimizer, DeepSpeedOptimizer) and not issubclass(FP16_Optimizer, ZeROOptimizer)


def test_a_torch_optimizer_no_engine_steps_is_none_of_them():
    optimizer = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    assert not any(isinstance(optimizer, cls) for cls in WRAPPERS) and not isinstance(3, DeepSpeedZeroOptimizer)
    with pytest.raises(TypeError, match="dsrun.initialize builds"):
        DeepSpeedZeroOptimizer()
