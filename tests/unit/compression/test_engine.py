"""The engine applies and steps compression by itself, quantizes stored 16-bit weights, runs MoQ with
eigenvalue pacing, and resumes the schedule from a checkpoint."""
import pytest
import torch

import dsrun
from dsrun.compression.compress import plan_of
from dsrun.compression.moq import moq_switch_steps
from dsrun.models.gpt import GPT
from dsrun.utils.errors import ConfigError

from .conftest import TwoLayer, merge, technique

pytestmark = pytest.mark.usefixtures("world_of_one")


def _ds(extra: dict, precision: str = "fp32") -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              **extra}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _train(engine, steps: int, x: torch.Tensor) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_initialize_applies_and_steps_compression_training():
    torch.manual_seed(0)
    model = TwoLayer()
    config = _ds(merge(
        technique("weight_quantization", {"quantize_weight_in_forward": True, "schedule_offset": 1},
                  {"start_bits": 8, "target_bits": 6, "quantization_period": 1}),
        technique("sparse_pruning", {"schedule_offset": 0, "method": "topk"}, {"dense_ratio": 0.5}, ["fc1"])))
    params = list(model.parameters())  # taken before initialize: the learned scores are added for us
    engine, *_ = dsrun.initialize(model=model, model_parameters=params, config=config)
    assert plan_of(model) is not None
    scores = model.fc1.sparse_mask_scores
    before = scores.detach().clone()
    bits = []
    for _ in range(4):
        bits.append(model.fc1.ds_compression.weight.bits)
        _train(engine, 1, torch.randn(4, 16))
    assert bits == [None, 8, 7, 6] and engine.compression.scheduler.training_steps == 4
    assert not torch.equal(scores.detach(), before)  # the optimizer trains the scores


def test_checkpoint_resume_continues_the_schedule_exactly(tmp_path):
    config = _ds(merge(
        technique("weight_quantization", {"quantize_weight_in_forward": True, "schedule_offset": 1},
                  {"start_bits": 8, "target_bits": 4, "quantization_period": 2}),
        technique("sparse_pruning", {"schedule_offset": 2, "method": "l1"}, {"dense_ratio": 0.5}, ["fc1"])))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))

    def fresh():
        torch.manual_seed(0)
        model = TwoLayer()
        return dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    straight = fresh()
    first = _train(straight, 3, x)
    straight.save_checkpoint(str(tmp_path))
    rest = _train(straight, 4, x)
    resumed = fresh()
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.compression.scheduler.training_steps == 3 and first
    assert _train(resumed, 4, x) == rest


def test_quantize_weight_outside_the_forward_quantizes_the_stored_bf16_weights():
    torch.manual_seed(0)
    model = TwoLayer()
    config = _ds(technique("weight_quantization", {"quantize_weight_in_forward": False, "schedule_offset": 0,
                                                   "quantize_groups": 4}, {"start_bits": 3, "target_bits": 3}), "bf16")
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(4, 16, dtype=torch.bfloat16)  # bf16 does not cast inputs (as DeepSpeed)
    losses = _train(engine, 5, x)
    for row in model.fc1.weight.detach().float().reshape(4, -1):
        assert len(torch.unique(row)) <= 7  # 3-bit symmetric grid
    assert len(set(losses)) == 5  # the fp32 masters keep learning under the quantized copy
    with pytest.raises(ConfigError, match="quantize_weight_in_forward: is false"):
        dsrun.initialize(model=TwoLayer(), model_parameters=TwoLayer().parameters(),
                         config=_ds(technique("weight_quantization", {}, {"start_bits": 8, "target_bits": 8})))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _moq(**overrides) -> dict:
    qt = {"enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 5},
          "quantize_schedule": {"quantize_period": 1, "schedule_offset": 1}, "quantize_groups": 2}
    qt.update(overrides)
    return {"quantize_training": qt}


def _run_gpt(extra: dict, steps: int):
    model = _gpt()
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=_ds(extra, "bf16"))
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(5))
    history = []
    for _ in range(steps):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        history.append(engine.compression.moq.weights[0].bits)
    return model, engine, history


def test_moq_bit_schedule_through_the_engine(capsys):
    model, engine, history = _run_gpt(_moq(quantize_verbose=True), 8)
    switches = moq_switch_steps(1, 1, 8, 5)  # [2, 4, 8]
    assert [8 - sum(s <= step for s in switches) for step in range(1, 9)] == history == [8, 7, 7, 6, 6, 6, 6, 5]
    assert "MoQ: transformer.wte.weight at 7 bits from step 2" in capsys.readouterr().out
    weight = model.transformer.h[0].mlp.c_fc.weight.detach().float().reshape(2, -1)
    assert all(len(torch.unique(row)) <= 2 ** 5 - 1 for row in weight)


def test_moq_type_and_mixing_change_the_stored_weights():
    base, _, _ = _run_gpt(_moq(), 3)
    asym, _, _ = _run_gpt(_moq(quantize_algo={"q_type": "asymmetric"}), 3)
    mixed, _, _ = _run_gpt(_moq(fp16_mixed_quantize={"enabled": True, "quantize_change_ratio": 0.5}), 3)
    w = [m.transformer.h[0].mlp.c_fc.weight for m in (base, asym, mixed)]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])


def test_eigenvalues_stretch_the_moq_period():
    eig = {"eigenvalue": {"enabled": True, "layer_name": "transformer.h", "layer_num": 2, "max_iter": 20}}
    _, engine, history = _run_gpt({**_moq(), **eig}, 8)
    values = engine.compression.eigenvalue.values
    assert set(values) == {0, 1} and max(values.values()) == 1.0
    top = max(values, key=values.get)
    block_weight = next(w for w in engine.compression.moq.weights if w.layer == top)
    assert block_weight.period >= 2 * 5  # the most sensitive block's period grew by the full factor 5
    with pytest.raises(ConfigError, match="eigenvalue.enabled: the eigenvalues pace MoQ"):
        dsrun.initialize(model=_gpt(), model_parameters=_gpt().parameters(), config=_ds(eig, "bf16"))


@pytest.mark.parametrize("key,value", [("max_iter", 1), ("tol", 10.0), ("stability", 10.0)])
def test_eigenvalue_iteration_settings_change_the_estimate(key, value):
    from dsrun.compression.eigenvalue import Eigenvalue
    from dsrun.config.misc import EigenvalueConfig

    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(5))
    estimates = []
    for settings in ({}, {key: value}):
        model = _gpt()
        eig = Eigenvalue(model, EigenvalueConfig(**{"enabled": True, "layer_name": "transformer.h", "layer_num": 2,
                                                    "max_iter": 30, "tol": 1e-6, **settings}))
        model(tokens[:, :-1], tokens[:, 1:])
        torch.manual_seed(0)
        eig.compute()
        raw = eig.values
        estimates.append(raw)
    assert estimates[0] != estimates[1]


def test_eigenvalue_resolution_layers_and_verbose(capsys):
    from dsrun.compression.eigenvalue import Eigenvalue
    from dsrun.config.misc import EigenvalueConfig
    from dsrun.utils.errors import UserError

    model = _gpt()
    eig = Eigenvalue(model, EigenvalueConfig(enabled=True, layer_name="transformer.h", layer_num=1,
                                             gas_boundary_resolution=3, verbose=True))
    assert [eig.due() for _ in range(6)] == [False, False, True, False, False, True]
    model(torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    assert set(eig.compute()) == {0}  # layer_num=1: the first block only
    assert "eigenvalue: block 0: 1.0000" in capsys.readouterr().out
    with pytest.raises(UserError, match="eigenvalue.layer_name: 'bert.encoder.layer' is not a module"):
        Eigenvalue(model, EigenvalueConfig(enabled=True))


def test_stored_weight_quantization_under_zero3_writes_the_16bit_shards():
    from dsrun.zero import GatheredParameters

    model, engine, history = _run_gpt({**_moq(quantize_bits={"start_bits": 6, "target_bits": 6}),
                                       "zero_optimization": {"stage": 3}}, 3)
    assert history == [6, 6, 6]
    weight = model.transformer.h[0].mlp.c_fc.weight
    with GatheredParameters([weight]):
        rows = weight.detach().float().reshape(2, -1)
        assert all(len(torch.unique(r)) <= 2 ** 6 - 1 for r in rows)  # 6-bit symmetric grid
    master = engine.strategy.masters[0]
    assert len(torch.unique(master.detach())) > 2 ** 6  # the fp32 master keeps full precision
